"""ContextParallelAttention: write, attend own slots, exchange, merge."""

from __future__ import annotations

import torch
from torch import nn

from torch_cp.attention.backend import AttentionBackend
from torch_cp.attention.exchange import Exchange
from torch_cp.attention.merge import own_tokens_merge, partner_merge
from torch_cp.attention.ops import (
    context_partial,
    own_partial,
    register_backend,
)
from torch_cp.attention.partial import Partial
from torch_cp.plan import StepPlan


class ContextParallelAttention(nn.Module):
    """Attention of one layer over a placed paged pool.

    Per step and layer: the new tokens' K/V are written through the placement (owner writes, the
    other partners write the sink page); each partner attends its own slots of the context
    (TP mode: for every partner's query heads); the partials are exchanged and merged exactly.
    A decode step's rows attend the pool after their token is written. Other steps attend the
    cached context from the pool and their own tokens causally from the K/V passed in, and the two
    partials merge once; a step with no cached context (``plan.attends_context``, the same on
    every partner) attends its own tokens only, with no exchange. The backend's kernels run as
    custom ops (``torch_cp.attention.ops``), so the whole forward compiles.
    """

    def __init__(self, layer_idx: int, backend: AttentionBackend, exchange: Exchange):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.exchange = exchange
        self.handle = register_backend(backend)
        self.merge = partner_merge(backend)
        self.merge_own = own_tokens_merge(backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool,
                plan: StepPlan, written: bool = False) -> torch.Tensor:
        """Args:
            q: [N, H, Dk] this rank's query heads (MLA: absorbed ``q_nope | q_pe``).
            k, v: the step's new keys/values, [N, Hkv, D] (MLA: ``ckv`` [N, R], ``kpe`` [N, rope]).
            pool: the layer's placed pool (``GQAPool`` or ``MLAPool``).
            plan: the step plan (built for this partner).
            written: k and v are in the pool already (``GQAPool.rotate_and_write``).
        Returns:
            [N, H, Dv] attention output (MLA: in latent space, before W_UV).
        """
        if not written:
            pool.write(self.layer_idx, k, v, plan.write_index)
        if not plan.attends_context:  # merging an empty context partial would change nothing
            return own_partial(q, k, v, self.handle)[0]
        placement = self.exchange.placement
        tp_mode = placement.size > 1 and placement.mode == "tp"
        q_context = self.exchange.gather_heads(q) if tp_mode else q
        partial = Partial(*context_partial(q_context, pool.tensors,
                                           self.handle, self.layer_idx))
        if placement.size > 1:
            exchanged = (self.exchange.return_partials(partial) if tp_mode
                         else self.exchange.gather_partials(partial))
            partial = self.merge(*exchanged)
        if not plan.is_decode:
            partial = self.merge_own(partial, Partial(*own_partial(q, k, v, self.handle)))
        return partial.out
