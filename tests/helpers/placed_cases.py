"""Random batches for placed-attention tests and a dense reference written plainly in torch."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from buckets import padding_bucket

from torch_cp.attention import AttentionGeometry, ContextParallelAttention, Exchange, TorchBackend
from torch_cp.kv import GQAPool, MLAPool
from torch_cp.placement import ContextParallel
from torch_cp.plan import build_step_plan

PAGE_SIZE = 8
NUM_PAGES = 64


@dataclass(frozen=True)
class Case:
    """One placed-attention case.

    kind "gqa": ``kv_heads`` KV heads in SP mode, one KV head shared by the partners in TP mode.
    ``group`` is the query heads per KV head a rank owns (TP mode: the P partners together hold
    ``P * group`` query heads of their KV head). kind "mla": one latent head.
    ``batch`` "decode" (one new token a row after a context step) or "mixed" (decode, prefill,
    extend and short rows in one step).
    """

    mode: str
    kind: str
    batch: str
    group: int
    dtype: torch.dtype
    seed: int
    kv_heads: int = 1

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"{self.mode}-{self.kind}-{self.batch}-g{self.group}-h{self.kv_heads}-{dt}"
                f"-s{self.seed}")


def rows_for(case: Case, size: int) -> list[tuple[int, int]]:
    """(context, new tokens) per row: decode rows, rows shorter than P, prefill and extend rows,
    lengths that are not multiples of the page size."""
    rng = random.Random(case.seed)
    if case.batch == "decode":
        return [(c, 1) for c in [0, 1, size - 1, 7, 8, 9, rng.randint(10, 40), rng.randint(10, 40)]]
    return [(rng.randint(5, 30), 1), (0, rng.randint(2, 13)),
            (rng.randint(3, 25), rng.randint(2, 6)), (0, 1), (1, max(1, size - 2)),
            (rng.randint(9, 17), 1), (0, size), (16, 8)]


@dataclass
class Tensors:
    q: torch.Tensor  # [L, Hq, Dk] per row, in a list
    k: torch.Tensor
    v: torch.Tensor


def make_rows(case: Case, rows, dims) -> list[Tensors]:
    """Full-sequence q/k/v of every row (every position, context and new tokens)."""
    gen = torch.Generator().manual_seed(case.seed)
    hq, hkv, dk, dv = dims
    out = []
    for ctx, q in rows:
        n = ctx + q
        if case.kind == "gqa":
            k = torch.randn(n, hkv, dk, generator=gen)
            v = torch.randn(n, hkv, dv, generator=gen)
        else:  # MLA: k holds ckv | kpe, v = ckv
            k = torch.randn(n, 1, dk, generator=gen)
            v = k[..., :dv]
        out.append(Tensors(torch.randn(n, hq, dk, generator=gen).to(case.dtype), k.to(case.dtype),
                           v.to(case.dtype)))
    return out


def dims_for(case: Case, size: int) -> tuple[int, int, int, int]:
    """Total (q heads, kv heads, qk dim, v dim) over the partner group."""
    heads = case.group * (size if case.mode == "tp" else 1)
    if case.kind == "mla":
        return heads, 1, 40, 32  # latent 32 + rope 8
    kv_heads = case.kv_heads if case.mode == "sp" else 1
    return heads * kv_heads, kv_heads, 16, 16


def dense_reference(t: Tensors, ctx: int, scale: float) -> torch.Tensor:
    """Causal softmax attention of the new tokens over their row, in float64: [q, Hq, Dv]."""
    q, k, v = t.q.double(), t.k.double(), t.v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = []
    for i in range(ctx, q.shape[0]):
        scores = torch.einsum("hd,lhd->hl", q[i], k[: i + 1]) * scale
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v[: i + 1]))
    return torch.stack(out)


def run_case(case: Case, placement: ContextParallel, records: list | None = None,
             pad_rows: int = 0, pad_tokens: int = 0, pad_fill: float | None = None):
    """Run the context step and the case's step on this partner; return (outputs, references)
    for both steps as lists of [tokens, heads, Dv] tensors, restricted to this partner's heads.

    With ``pad_fill`` set, the case's step is padded to a bucket of ``pad_rows`` more rows (a
    decode step) or ``pad_tokens`` more tokens (a mixed step); the padding's queries, keys and
    values and the whole sink page hold ``pad_fill``. Outputs keep only the real tokens."""
    size = placement.size
    rows = rows_for(case, size)
    hq, hkv, dk, dv = dims_for(case, size)
    tensors = make_rows(case, rows, (hq, hkv, dk, dv))
    scale = 1 / math.sqrt(dk)
    tp_mode = case.mode == "tp" and size > 1
    heads = hq // size if tp_mode else hq
    first = placement.rank * heads if tp_mode else 0
    head_slice = slice(first, first + heads)
    geometry = AttentionGeometry(case.kind, heads, hkv, dk, dv, scale,
                                 context_q_heads=heads * size if tp_mode else heads,
                                 rope_dim=dk - dv if case.kind == "mla" else 0)
    if case.kind == "gqa":
        pool = GQAPool(1, NUM_PAGES, PAGE_SIZE, hkv, dk, placement, case.dtype)
    else:
        pool = MLAPool(1, NUM_PAGES, PAGE_SIZE, dv, dk - dv, placement, case.dtype)
    attention = ContextParallelAttention(0, TorchBackend(geometry), Exchange(placement, records))
    pages = list(range(NUM_PAGES))
    random.Random(case.seed + 1).shuffle(pages)
    tables, cursor = [], 0
    for ctx, q in rows:
        need = -(-(ctx + q) // PAGE_SIZE)
        tables.append(pages[cursor: cursor + need])
        cursor += need

    def step(spans, padded=False):  # spans: (row, start, stop) of new tokens
        q_lens, step_tables = [b - a for _, a, b in spans], [tables[r] for r, _, _ in spans]
        bucket = padding_bucket(q_lens, step_tables, len(spans) + pad_rows,
                                sum(q_lens) + pad_tokens) if padded else None
        plan = build_step_plan(q_lens, [a for _, a, _ in spans], step_tables,
                               page_size=PAGE_SIZE, sink_page=pool.sink_page,
                               placement=placement, bucket=bucket)
        attention.backend.plan(plan)
        extra = plan.positions.shape[0] - plan.num_tokens

        def cat(name):
            real = torch.cat([getattr(tensors[r], name)[a:b] for r, a, b in spans])
            return torch.cat((real, torch.full((extra, *real.shape[1:]), pad_fill or 0.0,
                                               dtype=real.dtype)))

        q = cat("q")[:, head_slice]
        if case.kind == "gqa":
            k, v = cat("k"), cat("v")
        else:
            latent = cat("k")[:, 0]
            k, v = latent[:, :dv], latent[:, dv:]
        out = attention(q, k, v, pool, plan)[: plan.num_tokens]
        ref = torch.cat([_ref_tail(tensors[r], a, b, scale) for r, a, b in spans])
        return out, ref[:, head_slice].to(torch.float32)

    context_spans = [(r, 0, ctx) for r, (ctx, _) in enumerate(rows) if ctx > 0]
    results = [step(context_spans)]
    if pad_fill is not None:
        for t in (pool.kv,) if case.kind == "gqa" else (pool.ckv, pool.kpe):
            t[:, pool.sink_page] = pad_fill
    results.append(step([(r, ctx, ctx + q) for r, (ctx, q) in enumerate(rows)],
                        padded=pad_fill is not None))
    return results


def _ref_tail(t: Tensors, start: int, stop: int, scale: float) -> torch.Tensor:
    trimmed = Tensors(t.q[:stop], t.k[:stop], t.v[:stop])
    return dense_reference(trimmed, start, scale)


def tolerance(dtype: torch.dtype) -> dict:
    """fp32: summation order only. bf16 (8-bit mantissa, ulp 2^-7 at 1): inputs are the same
    bf16 values in both paths; the placed path rounds each partial and the merged output to bf16
    (three roundings of <= half an ulp on O(1) values), so 2e-2 absolute / 1.6e-2 relative."""
    if dtype == torch.float32:
        return dict(atol=2e-5, rtol=2e-5)
    return dict(atol=2e-2, rtol=1.6e-2)
