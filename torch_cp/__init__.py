"""torch_cp: context parallelism over a placed paged KV cache for Hugging Face Qwen and GLM models."""

from torch_cp.attention import (
    AttentionGeometry,
    ContextParallelAttention,
    Exchange,
    Partial,
    TorchBackend,
    merge_partials,
)
from torch_cp.kv import GQAPool, MLAPool, PageAllocator
from torch_cp.mesh import init_mesh, kv_head_replicas, partner_placement
from torch_cp.placement import ContextParallel
from torch_cp.plan import StepPlan, build_step_plan

__all__ = [
    "AttentionGeometry",
    "ContextParallel",
    "ContextParallelAttention",
    "Exchange",
    "GQAPool",
    "MLAPool",
    "PageAllocator",
    "Partial",
    "StepPlan",
    "TorchBackend",
    "build_step_plan",
    "init_mesh",
    "kv_head_replicas",
    "merge_partials",
    "partner_placement",
]
