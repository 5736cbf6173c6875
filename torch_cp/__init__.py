"""torch_cp: context parallelism over a placed paged KV cache for Hugging Face Qwen and GLM."""

from torch_cp.attention import (
    AttentionGeometry,
    ContextParallelAttention,
    Exchange,
    Partial,
    TorchBackend,
    merge_partials,
)
from torch_cp.cache import PagedKVCache
from torch_cp.engine import Engine, Result, generate
from torch_cp.hf_generate import GenerateCache, install_generate, new_cache
from torch_cp.kv import GQAPool, MLAPool, PageAllocator
from torch_cp.memory import kv_bytes_per_rank
from torch_cp.mesh import init_mesh, kv_head_replicas, partner_placement
from torch_cp.patch import patch_model, unpatch_model
from torch_cp.placement import ContextParallel
from torch_cp.plan import StepPlan, build_step_plan
from torch_cp.sampling import SamplingParams
from torch_cp.scheduler import StepRefused
from torch_cp.tiny import tiny_qwen3

__all__ = [
    "AttentionGeometry",
    "ContextParallel",
    "ContextParallelAttention",
    "Engine",
    "Exchange",
    "GQAPool",
    "GenerateCache",
    "MLAPool",
    "PageAllocator",
    "PagedKVCache",
    "Partial",
    "Result",
    "SamplingParams",
    "StepPlan",
    "StepRefused",
    "TorchBackend",
    "build_step_plan",
    "generate",
    "init_mesh",
    "install_generate",
    "kv_bytes_per_rank",
    "kv_head_replicas",
    "merge_partials",
    "new_cache",
    "partner_placement",
    "patch_model",
    "tiny_qwen3",
    "unpatch_model",
]
