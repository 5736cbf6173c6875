"""What a patched model carries: its placement, exchange, backend and pool geometry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_cp.attention.backend import AttentionBackend, AttentionGeometry
from torch_cp.attention.exchange import Exchange
from torch_cp.kv.pool import GQAPool, MLAPool
from torch_cp.placement import ContextParallel
from torch_cp.plan import StepPlan


@dataclass
class ModelRuntime:
    """Attached to a patched model as ``model.torch_cp``; shared by all its attention layers.

    Attributes:
        placement: this rank's placement (P = 1 without context parallelism).
        exchange: the partner collectives (records them when ``exchange.records`` is a list).
        backend: the partial-attention backend; planned once per step by ``begin_step``.
        geometry: per-rank attention shapes (GQA or absorbed MLA).
        num_layers: attention layers that use the pool (layer index = pool index).
        dtype, device: of the pool.
    """

    placement: ContextParallel
    exchange: Exchange
    backend: AttentionBackend
    geometry: AttentionGeometry
    num_layers: int
    dtype: torch.dtype
    device: torch.device

    def new_pool(self, num_pages: int, page_size: int) -> GQAPool | MLAPool:
        """A placed pool of ``num_pages`` logical pages (plus the sink page) for every layer."""
        g = self.geometry
        if g.kind == "gqa":
            return GQAPool(self.num_layers, num_pages, page_size, g.kv_heads, g.head_dim,
                           self.placement, self.dtype, self.device)
        return MLAPool(self.num_layers, num_pages, page_size, g.kv_lora_rank, g.rope_dim,
                       self.placement, self.dtype, self.device)

    def begin_step(self, plan: StepPlan) -> None:
        """Plan the backend for one step (host side, outside any graph capture)."""
        self.backend.plan(plan)
