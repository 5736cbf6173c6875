"""The partial-attention backend protocol: plan once per step, run per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from torch_cp.attention.partial import Partial
from torch_cp.plan import Bucket, StepPlan


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes of one model's attention on one rank.

    GQA: q [N, q_heads, head_dim], K/V [.., kv_heads, head_dim(_v)].
    MLA (absorbed): q [N, q_heads, kv_lora_rank + rope_dim] (q_nope through W_UK, then q_pe), one
    latent KV head: keys ``ckv | kpe``, values ``ckv``; so ``head_dim = kv_lora_rank + rope_dim``
    and ``head_dim_v = kv_lora_rank``.

    Attributes:
        q_heads: query heads this rank owns (before any TP-mode gather).
        context_q_heads: query heads the context kernel sees: ``P * q_heads`` in TP mode.
    """

    kind: Literal["gqa", "mla"]
    q_heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    scale: float
    context_q_heads: int
    rope_dim: int = 0

    @property
    def kv_lora_rank(self) -> int:
        return self.head_dim_v


class AttentionBackend(Protocol):
    """Computes partials over this partner's slots (context) and over a step's own tokens.

    ``add_bucket`` runs once per captured shape, before the capture; ``plan`` once per step, on
    the host, outside any graph capture (it picks the kernels of ``plan.bucket``); ``run_*`` per
    layer, reading nothing from the host.

    Attributes:
        name: ``"torch"`` or ``"flashinfer"``.
        geometry: this rank's attention shapes.
        dtype: query and pool dtype (``None``: any).
    """

    name: str
    geometry: AttentionGeometry
    dtype: torch.dtype | None

    def add_bucket(self, bucket: Bucket) -> None:
        """Make kernels that a CUDA graph of ``bucket``'s steps can capture (idempotent)."""
        ...

    def plan(self, plan: StepPlan) -> None: ...

    def run_context(self, q: torch.Tensor, caches: list[torch.Tensor], layer_idx: int
                    ) -> Partial:
        """q [N, context_q_heads, head_dim] over this partner's slots of each token's row, in
        layer ``layer_idx`` of the pool tensors ``caches`` (``GQAPool.tensors``: ``[kv]``;
        ``MLAPool.tensors``: ``[ckv, kpe]``)."""
        ...

    def run_own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        """q [N, q_heads, head_dim] over the step's own tokens of its row, causally.

        GQA: k [N, kv_heads, head_dim], v [N, kv_heads, head_dim_v]. MLA: k = ckv [N, kv_lora_rank],
        v = kpe [N, rope_dim] (the pool write's inputs).
        """
        ...
