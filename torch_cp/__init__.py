"""torch_cp: context parallelism over a placed paged KV cache for Hugging Face Qwen, GLM and
DeepSeek-V3.

The parts: the core (``placement``, ``mesh``, ``plan``, ``kv``, ``attention``), the Hugging Face
bridge (``torch_cp.hf``: patch_model, from_pretrained, the paged Cache, model.generate), the
engine (``torch_cp.engine``: requests, scheduler, steps, sampling, generate), plus
``torch_cp.models`` (one file per family) and ``torch_cp.graphs`` (CUDA-graph buckets, compiled
layers). The command line is ``python -m torch_cp``. See docs/architecture.md.
"""

from torch_cp.attention import (
    AttentionGeometry,
    ContextParallelAttention,
    Exchange,
    Partial,
    TorchBackend,
    merge_partials,
)
from torch_cp.engine import Engine, RequestOutput, Result, SamplingParams, generate
from torch_cp.engine.memory import kv_bytes_per_rank, state_bytes_per_rank
from torch_cp.hf import (
    GenerateCache,
    PagedKVCache,
    from_pretrained,
    install_generate,
    new_cache,
    patch_model,
    unpatch_model,
)
from torch_cp.kv import GQAPool, MLAPool, PageAllocator, PrefixCachingAllocator
from torch_cp.mesh import init_mesh, kv_head_replicas, partner_placement
from torch_cp.placement import ContextParallel
from torch_cp.plan import Bucket, StepPlan, StepRefused, build_step_plan
from torch_cp.runtime import ModelRuntime
from torch_cp.tiny import tiny_qwen3, tiny_qwen3_5

__all__ = [
    "AttentionGeometry",
    "Bucket",
    "ContextParallel",
    "ContextParallelAttention",
    "Engine",
    "Exchange",
    "GQAPool",
    "GenerateCache",
    "MLAPool",
    "ModelRuntime",
    "PageAllocator",
    "PagedKVCache",
    "Partial",
    "PrefixCachingAllocator",
    "RequestOutput",
    "Result",
    "SamplingParams",
    "StepPlan",
    "StepRefused",
    "TorchBackend",
    "build_step_plan",
    "from_pretrained",
    "generate",
    "init_mesh",
    "install_generate",
    "kv_bytes_per_rank",
    "state_bytes_per_rank",
    "kv_head_replicas",
    "merge_partials",
    "new_cache",
    "partner_placement",
    "patch_model",
    "tiny_qwen3",
    "tiny_qwen3_5",
    "unpatch_model",
]
