"""CUDA-graph buckets, static step buffers, capture and replay."""

from torch_cp.graphs.buckets import Bucket, default_buckets, pick_bucket
from torch_cp.graphs.runner import CUDAGraphRunner
from torch_cp.graphs.static_plan import StaticPlan

__all__ = ["Bucket", "CUDAGraphRunner", "StaticPlan", "default_buckets", "pick_bucket"]
