"""The partial-attention backend protocol: plan once per step, run per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from torch_cp.attention.partial import Partial
from torch_cp.plan import StepPlan


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

    ``plan`` runs once per step, on the host, outside any graph capture; ``run_*`` run per layer
    and must not read anything from the host.
    """

    name: str
    geometry: AttentionGeometry

    def plan(self, plan: StepPlan) -> None: ...

    def run_context(self, q: torch.Tensor, pool, layer_idx: int) -> Partial:
        """q [N, context_q_heads, head_dim] over this partner's pool slots of each token's row."""
        ...

    def run_own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        """q [N, q_heads, head_dim] over the step's own tokens of its row, causally.

        GQA: k [N, kv_heads, head_dim], v [N, kv_heads, head_dim_v]. MLA: k = ckv [N, kv_lora_rank],
        v = kpe [N, rope_dim] (the pool write's inputs).
        """
        ...
