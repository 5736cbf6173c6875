"""The engine: requests, scheduling and admission, step planning and launching, sampling, and
``generate()`` over a patched model's placed pool."""

from torch_cp.engine.engine import Engine
from torch_cp.engine.generation import generate
from torch_cp.engine.requests import Result
from torch_cp.engine.sampling import SamplingParams

__all__ = ["Engine", "Result", "SamplingParams", "generate"]
