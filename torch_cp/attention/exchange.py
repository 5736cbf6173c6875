"""Collectives between partners, through traceable functional collectives (over gloo outside
tracing, the classic ones: ``compat.gather_dim0``).

SP mode: every partner attends the same rows and heads, so partials are all-gathered.
TP mode: partners own different query heads of one KV head. Queries are all-gathered, each partner
attends every gathered head over its slots, and an all-to-all returns each head's P partials to the
partner that owns the head. All-to-all (rather than all-gather of LSE plus a reduce-scatter of
rescaled outputs) moves the same bytes, keeps outputs in their dtype on the wire without summing
them there, and lets both modes share one exact float32 merge.

Gloo has no all-gather of CUDA tensors, so over a gloo group (P processes sharing one GPU in
tests) CUDA tensors take a round trip through the host; NCCL groups move them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torch_cp import compat
from torch_cp.attention.partial import Partial
from torch_cp.placement import ContextParallel


@dataclass(frozen=True)
class CollectiveRecord:
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Exchange:
    """Partner collectives for one placement. ``records`` (when a list) logs every collective."""

    placement: ContextParallel
    records: list[CollectiveRecord] | None = field(default=None)

    def _staged(self, collective, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda and dist.get_backend(self.placement.group) == "gloo":
            return collective(t.cpu()).to(t.device)
        return collective(t)

    def _record(self, op: str, t: torch.Tensor) -> None:
        if self.records is not None:
            self.records.append(CollectiveRecord(op, tuple(t.shape), t.dtype))

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[X, ...] -> [P, X, ...] with partner p's tensor at index p."""
        self._record("all_gather", t)
        group = self.placement.group
        gather = lambda x: compat.gather_dim0(x.contiguous(), group)
        return self._staged(gather, t).view(self.placement.size, *t.shape)

    def _all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """[P, X, ...] -> [P, X, ...]: chunk p goes to partner p; index p then holds partner
        p's chunk."""
        self._record("all_to_all", t)
        return self._staged(lambda x: compat.all_to_all_dim0(x.contiguous(),
                                                             self.placement.group), t)

    def gather_heads(self, q_nhd: torch.Tensor) -> torch.Tensor:
        """TP mode: [N, H, D] -> [N, P * H, D], partner p's heads at ``[p * H, (p + 1) * H)``."""
        n, h, d = q_nhd.shape
        return self._all_gather(q_nhd).permute(1, 0, 2, 3).reshape(n, self.placement.size * h, d)

    def return_partials(self, partial: Partial) -> tuple[torch.Tensor, torch.Tensor]:
        """TP mode: this partner's partial of every gathered head [N, P * H, Dv] -> the P partials
        of this partner's own heads, [P, N, H, Dv] and [P, N, H]."""
        p = self.placement.size
        n, ph, dv = partial.out.shape
        out = partial.out.view(n, p, ph // p, dv).permute(1, 0, 2, 3)
        lse = partial.lse.view(n, p, ph // p).permute(1, 0, 2)
        return self._all_to_all(out), self._all_to_all(lse)

    def gather_partials(self, partial: Partial) -> tuple[torch.Tensor, torch.Tensor]:
        """SP mode: [N, H, Dv], [N, H] -> every partner's, [P, N, H, Dv] and [P, N, H]."""
        return self._all_gather(partial.out), self._all_gather(partial.lse)
