"""The engine: requests, scheduling and admission, step planning and launching, sampling, and
``generate()`` over a patched model's placed pool."""

from torch_cp.engine.engine import Engine
from torch_cp.engine.feedback import EngineWarning, IgnoredSettingWarning, PositionLimitWarning
from torch_cp.engine.generation import generate
from torch_cp.engine.requests import RequestOutput, Result, normalize_prompts
from torch_cp.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineWarning", "IgnoredSettingWarning", "PositionLimitWarning",
           "RequestOutput", "Result", "SamplingParams", "generate", "normalize_prompts"]
