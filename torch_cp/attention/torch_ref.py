"""The torch reference backend: dense gather, explicit masks, base-2 LSE. Slow and obviously right.

It runs on any device and is the oracle for every other backend. Masked keys and values are
replaced by zeros before they meet a probability, so NaN in a masked slot (the sink page, padding)
never reaches a real row.
"""

from __future__ import annotations

import math

import torch

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.partial import Partial
from torch_cp.plan import Bucket, StepPlan

LN2 = math.log(2.0)
# Float32 elements a chunk of queries may gather (its keys, values, scores and probabilities):
# each query reads its own masked copy of its keys, so a 2048-token prefill in one piece would
# take tens of GiB; in chunks it takes about 256 MiB whatever the step's length.
CHUNK_ELEMENTS = 2**26


def dense_partial(q_nhd: torch.Tensor, k_blhd: torch.Tensor, v_blhd: torch.Tensor,
                  mask_nl: torch.Tensor, scale: float, key_batch: torch.Tensor | None = None
                  ) -> Partial:
    """Attention of each query over the keys its mask allows, in float32, in chunks of queries
    of at most ``CHUNK_ELEMENTS`` gathered elements.

    Args:
        q_nhd: [N, H, Dk]. k_blhd: [B, L, Hkv, Dk], v_blhd: [B, L, Hkv, Dv] with H % Hkv == 0.
        mask_nl: [N, L] bool, True where query n may see key l.
        key_batch: [N] which of the B key sets each query reads (default: B == 1, all read set 0).
    Returns:
        out [N, H, Dv] in q's dtype (0 for queries with no key) and lse [N, H] (-inf for those).
    """
    n, h, _ = q_nhd.shape
    length, hkv, dk = k_blhd.shape[1:]
    index = key_batch.clamp(min=0) if key_batch is not None else torch.zeros(
        n, dtype=torch.long, device=q_nhd.device)
    per_query = length * (hkv * (dk + v_blhd.shape[-1]) + 2 * h)
    step = max(1, CHUNK_ELEMENTS // max(per_query, 1))
    if n <= step:
        return _dense_chunk(q_nhd, k_blhd, v_blhd, mask_nl, scale, index)
    parts = [_dense_chunk(q_nhd[i:i + step], k_blhd, v_blhd, mask_nl[i:i + step], scale,
                          index[i:i + step]) for i in range(0, n, step)]
    return Partial(torch.cat([p.out for p in parts]), torch.cat([p.lse for p in parts]))


def _dense_chunk(q_nhd, k_blhd, v_blhd, mask_nl, scale, index) -> Partial:
    n, h, dk = q_nhd.shape
    hkv = k_blhd.shape[2]
    keep = mask_nl.unsqueeze(-1).unsqueeze(-1)  # [N, L, 1, 1]
    zero = torch.zeros((), dtype=torch.float32, device=q_nhd.device)
    k = torch.where(keep, k_blhd[index].float(), zero)  # [N, L, Hkv, Dk]
    v = torch.where(keep, v_blhd[index].float(), zero)
    q = q_nhd.float().view(n, hkv, h // hkv, dk)
    scores = torch.einsum("ngqd,nlgd->ngql", q, k) * scale  # [N, Hkv, G, L]
    scores = scores.masked_fill(~mask_nl[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # natural log, -inf where nothing is visible
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, zero).unsqueeze(-1))
    out = torch.einsum("ngql,nlgd->ngqd", probs, v)
    out = torch.where(finite.unsqueeze(-1), out, zero)
    return Partial(out.reshape(n, h, -1).to(q_nhd.dtype), (lse / LN2).reshape(n, h))


class TorchBackend:
    """Reference partial attention for GQA and MLA pools (see ``AttentionBackend``)."""

    name = "torch"

    def __init__(self, geometry: AttentionGeometry, dtype: torch.dtype | None = None):
        self.geometry = geometry
        self.dtype = dtype
        self._plan: StepPlan | None = None

    def add_bucket(self, bucket: Bucket) -> None:
        """Nothing to make: the kernels read only the plan's tensors, which a capture keeps."""

    def plan(self, plan: StepPlan) -> None:
        self._plan = plan

    def _pool_kv(self, caches: list[torch.Tensor], layer_idx: int, table: torch.Tensor):
        """Keys and values of every row's pages: [B, pages * local_page, Hkv, D]."""
        rows, width = table.shape
        if self.geometry.kind == "gqa":
            cache = caches[0][layer_idx][table.long()]  # [B, W, 2, page, Hkv, D]
            k, v = cache[:, :, 0], cache[:, :, 1]
            return (k.reshape(rows, -1, *k.shape[-2:]), v.reshape(rows, -1, *v.shape[-2:]))
        ckv, kpe = (t[layer_idx][table.long()] for t in caches)  # [B, W, page, R]
        ckv = ckv.reshape(rows, -1, 1, ckv.shape[-1])
        return torch.cat((ckv, kpe.reshape(rows, -1, 1, kpe.shape[-1])), -1), ckv

    def run_context(self, q: torch.Tensor, caches: list[torch.Tensor], layer_idx: int
                    ) -> Partial:
        plan = self._plan
        assert plan is not None, "plan() must run before run_context()"
        k, v = self._pool_kv(caches, layer_idx, plan.context.table)
        rows = plan.token_row
        lens = plan.context.lens[rows.clamp(min=0)]
        slot = torch.arange(k.shape[1], device=q.device)
        mask = (slot[None, :] < lens[:, None]) & (rows[:, None] >= 0)
        return dense_partial(q, k, v, mask, self.geometry.scale, key_batch=rows)

    def run_own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        plan = self._plan
        assert plan is not None, "plan() must run before run_own()"
        if self.geometry.kind == "mla":
            k, v = torch.cat((k, v), -1).unsqueeze(1), k.unsqueeze(1)
        rows = plan.token_row
        index = torch.arange(rows.shape[0], device=q.device)
        mask = (rows[:, None] == rows[None, :]) & (index[None, :] <= index[:, None])
        mask &= (rows >= 0)[:, None]
        return dense_partial(q, k.unsqueeze(0), v.unsqueeze(0), mask, self.geometry.scale)
