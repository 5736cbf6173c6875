"""What a patched model carries: its placement, TP split, exchange, backend and pool geometry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from torch_cp.agreement import together
from torch_cp.attention.backend import AttentionBackend, AttentionGeometry
from torch_cp.attention.exchange import Exchange
from torch_cp.fused_linear import fuse_replaced
from torch_cp.kv.pool import GQAPool, MLAPool
from torch_cp.placement import ContextParallel
from torch_cp.state import LinearGeometry, StatePool

if TYPE_CHECKING:
    from torch_cp.models.base import Family


@dataclass
class ModelRuntime:
    """Attached to a patched model as ``model.torch_cp``; shared by all its attention layers.

    Attributes:
        placement: this rank's placement (P = 1 without context parallelism).
        exchange: the partner collectives (records them when ``exchange.records`` is a list).
        backend: the partial-attention backend; planned once per step (``PagedKVCache``).
        geometry: per-rank attention shapes (GQA or absorbed MLA).
        num_layers: attention layers that use the pool (layer index = pool index).
        dtype, device: of the pool.
        page_size: the logical page size patch_model checked against P; pools default to it.
        tp, tp_rank, tp_group: the tensor-parallel split (tp = 1: not sharded).
        family: the model family that patched the attention modules (None: built by hand).
        originals: (module, its own forward) pairs that ``unpatch_model`` restores (attention,
            DeltaNet, gated MLP and router modules).
        linear: per-rank shapes of a hybrid model's linear-attention layers (None: no state).
        linear_kernels: their kernels, ``"torch"`` or ``"fla"`` (``torch_cp.state.kernels``).
        experts_before: the MoE experts implementations before torch_cp first switched them
            (the model's and each experts module's config's; ``graphs.experts``: before a
            capture, ``capturable_experts``; at patching, ``avoid_unfit_grouped_mm``), which
            ``unpatch_model`` puts back; None while nothing was switched.
        planned_for: the step plan the backend was planned for last (``PagedKVCache.begin_step``;
            None before any). The backend is the model's, shared by every cache and engine on
            it: a step planned ahead is planned again at its launch when another planned since.
    """

    placement: ContextParallel
    exchange: Exchange
    backend: AttentionBackend
    geometry: AttentionGeometry
    num_layers: int
    dtype: torch.dtype
    device: torch.device
    page_size: int = 16
    tp: int = 1
    tp_rank: int = 0
    tp_group: object | None = None
    family: Family | None = None
    originals: list = field(default_factory=list, repr=False)
    linear: LinearGeometry | None = None
    linear_kernels: str = "torch"
    experts_before: tuple | None = field(default=None, repr=False)
    planned_for: object | None = field(default=None, repr=False, compare=False)

    def __deepcopy__(self, memo):
        raise ValueError("a patched model cannot be deep-copied: its patched forwards, backend and "
                         "pools belong to this model, and a copy would attend through them; copy "
                         "the model before torch_cp.patch_model, or unpatch_model it first")

    @property
    def spans_ranks(self) -> bool:
        """Whether one step of this model runs on more than one rank (partners or TP)."""
        return self.placement.size > 1 or self.tp > 1

    def new_pool(self, num_pages: int, page_size: int | None = None,
                 device: torch.device | str | None = None) -> GQAPool | MLAPool:
        """A placed pool of ``num_pages`` logical pages (plus the sink page) for every layer,
        on the model's device (or ``device``: "meta" sizes one without allocating it)."""
        g = self.geometry
        page_size = self.page_size if page_size is None else page_size
        device = self.device if device is None else device
        if g.kind == "gqa":
            return GQAPool(self.num_layers, num_pages, page_size, g.kv_heads, g.head_dim,
                           self.placement, self.dtype, device)
        return MLAPool(self.num_layers, num_pages, page_size, g.kv_lora_rank, g.rope_dim,
                       self.placement, self.dtype, device)


def new_state_pool(runtime: ModelRuntime, num_slots: int) -> StatePool | None:
    """A state pool of ``num_slots`` request slots (plus the sink and zero slots) for a hybrid
    model's linear-attention layers; None for a model without them."""
    if runtime.linear is None:
        return None
    return StatePool(runtime.linear, num_slots, runtime.dtype, runtime.device)


def new_pools(runtime: ModelRuntime, num_pages: int, page_size: int | None, state_slots: int,
              call: str) -> tuple[GQAPool | MLAPool, StatePool | None]:
    """``runtime.new_pool(num_pages, page_size)`` and ``new_state_pool(runtime, state_slots)``,
    on every rank the model spans or on none (``agreement.together``: one rank out of memory
    alone left the others in the next collective); ``call`` names the allocation. Never
    inference tensors: pools made under ``torch.inference_mode`` (a ``new_cache`` there) serve
    steps outside it too."""
    with torch.inference_mode(False):
        return together(runtime.spans_ranks, runtime.device, call,
                        lambda: (runtime.new_pool(num_pages, page_size),
                                 new_state_pool(runtime, state_slots)))


def runtime_of(model) -> ModelRuntime:
    """``model.torch_cp``; ValueError when ``model`` was not patched (the one place saying so)."""
    runtime = getattr(model, "torch_cp", None)
    if not isinstance(runtime, ModelRuntime):
        raise ValueError("the model is not patched: call torch_cp.patch_model(model, ...) first")
    return runtime


def model_dtype_device(model) -> tuple[torch.dtype | None, torch.device | None]:
    """The dtype and device ``patch_model`` sizes pools for (its first parameter's; the model's
    own ``dtype`` where it has one); Nones for a model without parameters."""
    param = next(model.parameters(), None)
    if param is None:
        return None, None
    return getattr(model, "dtype", param.dtype), param.device


def runtime_to_run(model) -> ModelRuntime:
    """``runtime_of(model)``, for making pools and running steps: ValueError when the model was
    cast or moved after patching (``patch_model`` sized the pools and built the attention
    backend for the dtype and device it saw; they would not follow; an engine made before
    keeps them). Linears whose parameters were replaced are fused again
    (``fused_linear.fuse_replaced``)."""
    runtime, problems = runtime_and_problems(model)
    if problems:
        raise ValueError(problems[0])
    return runtime


def runtime_and_problems(model) -> tuple[ModelRuntime, list[str]]:
    """``runtime_to_run``'s runtime and its problem, if any, unraised: for a call that names
    every rank's problems together (``torch_cp.agreement``)."""
    runtime = runtime_of(model)
    fuse_replaced(model)
    return runtime, cast_problems(model, runtime)


def cast_problems(model, runtime: ModelRuntime) -> list[str]:
    """The model cast or moved since ``patch_model`` made ``runtime``, as a problem (or none)."""
    dtype, device = model_dtype_device(model)
    if dtype is None:
        return []
    changes = []
    if dtype != runtime.dtype:
        changes.append(f"cast to {dtype}")
    if _indexed(device) != _indexed(runtime.device):
        changes.append(f"moved to {device}")
    if not changes:
        return []
    return [f"the model was {' and '.join(changes)} after torch_cp.patch_model, which built "
            f"its pools and attention backend for {runtime.dtype} on {runtime.device}: cast "
            f"and move the model before patching it (or unpatch_model, cast, and patch again)"]


def _indexed(device: torch.device | str) -> torch.device:
    """``device`` as tensors report it: a CUDA device with its index ("cuda" is the current
    one), any other without one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device if device.type == "cuda" else torch.device(device.type)  # "cpu:0" is "cpu"
