"""CUDA-graph buckets, static step buffers, capture and replay, regional compilation."""

from torch_cp.graphs.buckets import default_buckets, pick_bucket
from torch_cp.graphs.compile import compiled_layers
from torch_cp.graphs.runner import CUDAGraphRunner
from torch_cp.graphs.static_plan import StaticPlan

__all__ = ["CUDAGraphRunner", "StaticPlan", "compiled_layers", "default_buckets", "pick_bucket"]
