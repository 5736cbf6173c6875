"""One-process harness: P placed partners on one device, their exchange written out plainly.

Every partner gets its own placed pool (with finite noise in every slot nothing writes), its own
step plan and backend; the context K/V are written through the placement, the step's new tokens
through ``plan.write_index``. The exchange is done in-process (not the product path): SP mode
merges every partner's partial; TP mode gathers all query heads to every partner and merges each
head's P partials. Multi-token steps merge the own-token partial last, as the module does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from buckets import padding_bucket

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.partial import Partial, merge_partials, merge_two
from torch_cp.kv.pool import GQAPool, MLAPool
from torch_cp.placement import ContextParallel
from torch_cp.plan import Bucket, StepPlan, build_step_plan

GROUP = object()  # the exchange is in-process: the partners' process group is never used


@dataclass(frozen=True)
class Shape:
    """Attention shapes of all query heads together (before any TP split)."""

    kind: str
    q_heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    rope_dim: int = 0

    @property
    def scale(self) -> float:
        return (self.head_dim if self.kind == "gqa" else 192) ** -0.5


QWEN3 = Shape("gqa", 32, 8, 128, 128)  # Qwen3-8B attention
QWEN3_TP = Shape("gqa", 4, 1, 128, 128)  # per P partners in TP mode: 1 KV head, 4 q heads each
MLA16 = Shape("mla", 16, 1, 576, 512, 64)


@dataclass(frozen=True)
class Batch:
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    page_size: int = 16
    pad_rows_to: int | None = None
    pad_tokens_to: int | None = None

    def padded(self, rows: int, tokens: int | None) -> Batch:
        return Batch(self.q_lens, self.ctx_lens, self.page_size, rows, tokens)

    def bucket(self, tables) -> Bucket | None:
        return padding_bucket(self.q_lens, tables, self.pad_rows_to, self.pad_tokens_to)


@dataclass
class StepInputs:
    """Logical (unplaced) inputs of one step; tensors on the device.

    q: [N, heads, Dk] every query head (TP mode: partner p owns heads [p*H, (p+1)*H)).
    k_new, v_new: new tokens' keys/values [N, Hkv, D] (MLA: ckv [N, R], kpe [N, rope]).
    ctx_k, ctx_v: per row, the cached tokens' keys/values (same layout as k_new, v_new).
    """

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    ctx_k: list[torch.Tensor]
    ctx_v: list[torch.Tensor]
    tables: list[list[int]]
    num_pages: int
    num_tokens: int


@dataclass
class PlacedResult:
    merged: Partial  # [N, heads, Dv] after exchange, merge and own tokens
    context: list[Partial]  # each partner's context partial, before the exchange
    plans: list[StepPlan]


def _kv_shape(shape: Shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if shape.kind == "gqa":
        return (shape.kv_heads, shape.head_dim), (shape.kv_heads, shape.head_dim_v)
    return (shape.head_dim_v,), (shape.rope_dim,)


def make_inputs(shape: Shape, batch: Batch, dtype: torch.dtype, device, seed: int = 0,
                nan_padding: bool = False) -> StepInputs:
    """Random inputs. Real rows depend only on (shape, rows, seed), not on the padding."""
    gen = torch.Generator().manual_seed(seed)
    pad_gen = torch.Generator().manual_seed(seed + 1)
    ps = batch.page_size
    need = [math.ceil((c + q) / ps) for q, c in zip(batch.q_lens, batch.ctx_lens, strict=True)]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()  # pages out of order
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    k_shape, v_shape = _kv_shape(shape)

    def rand(gen_, *size):
        return torch.randn(*size, generator=gen_).to(dtype)

    ctx_k = [rand(gen, c, *k_shape).to(device) for c in batch.ctx_lens]
    ctx_v = [rand(gen, c, *v_shape).to(device) for c in batch.ctx_lens]
    tokens = sum(batch.q_lens)
    real = [rand(gen, tokens, shape.q_heads, shape.head_dim), rand(gen, tokens, *k_shape),
            rand(gen, tokens, *v_shape)]
    plan = build_step_plan(batch.q_lens, batch.ctx_lens, tables, page_size=ps,
                           sink_page=num_pages, bucket=batch.bucket(tables))
    pad = plan.positions.shape[0] - tokens
    full = []
    for t in real:
        extra = rand(pad_gen, pad, *t.shape[1:])
        if nan_padding:
            extra.fill_(float("nan"))
        full.append(torch.cat((t, extra)).to(device))
    return StepInputs(*full, ctx_k, ctx_v, tables, num_pages, tokens)


def geometry_for(shape: Shape, size: int, mode: str) -> AttentionGeometry:
    """Per-partner geometry: TP mode splits the query heads over the P partners."""
    heads = shape.q_heads // size if mode == "tp" else shape.q_heads
    return AttentionGeometry(shape.kind, heads, shape.kv_heads, shape.head_dim, shape.head_dim_v,
                             shape.scale, context_q_heads=shape.q_heads, rope_dim=shape.rope_dim)


def _new_pool(shape: Shape, inputs: StepInputs, page_size: int, cp: ContextParallel, dtype,
              device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if shape.kind == "gqa":
        pool = GQAPool(1, inputs.num_pages, page_size, shape.kv_heads, shape.head_dim, cp,
                       dtype, device)
        tensors = (pool.kv,)
    else:
        pool = MLAPool(1, inputs.num_pages, page_size, shape.head_dim_v, shape.rope_dim, cp,
                       dtype, device)
        tensors = (pool.ckv, pool.kpe)
    for t in tensors:  # finite noise where nothing is written: reading it would show
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return pool


def _write_context(pool, inputs: StepInputs, page_size: int, cp: ContextParallel) -> None:
    """Write every row's cached tokens that this partner owns, through the placement."""
    local = cp.local_page_size(page_size)
    ks, vs, index = [], [], []
    for table, k, v in zip(inputs.tables, inputs.ctx_k, inputs.ctx_v, strict=True):
        t = torch.arange(k.shape[0])
        own = cp.owner(t) == cp.rank
        pages = torch.tensor(table, dtype=torch.int64)[t[own] // page_size]
        index.append(pages * local + cp.local_slot(t[own] % page_size))
        ks.append(k[own.to(k.device)])
        vs.append(v[own.to(v.device)])
    device = inputs.q.device
    pool.write(0, torch.cat(ks), torch.cat(vs), torch.cat(index).to(device))


def run_placed(make_backend: Callable[[AttentionGeometry], object], shape: Shape, size: int,
               mode: str, batch: Batch, inputs: StepInputs, dtype=torch.bfloat16,
               pool_seed: int = 7) -> PlacedResult:
    """Attention of one step by ``size`` placed partners, exchanged and merged in-process."""
    device = inputs.q.device
    geometry = geometry_for(shape, size, mode)
    heads = geometry.q_heads
    contexts, owns, plans = [], [], []
    for rank in range(size):
        cp = ContextParallel(size, rank, mode, GROUP if size > 1 else None)
        plan = build_step_plan(batch.q_lens, batch.ctx_lens, inputs.tables,
                               page_size=batch.page_size, sink_page=inputs.num_pages,
                               placement=cp, device=device, bucket=batch.bucket(inputs.tables))
        pool = _new_pool(shape, inputs, batch.page_size, cp, dtype, device, pool_seed + rank)
        _write_context(pool, inputs, batch.page_size, cp)
        backend = make_backend(geometry)
        if plan.bucket is not None:  # a padded step runs the bucket's graph-ready kernels
            backend.add_bucket(plan.bucket)
        backend.plan(plan)
        pool.write(0, inputs.k_new, inputs.v_new, plan.write_index)
        contexts.append(backend.run_context(inputs.q, pool.tensors, 0))
        if not plan.is_decode:
            q_own = inputs.q[:, rank * heads:(rank + 1) * heads] if mode == "tp" else inputs.q
            owns.append(backend.run_own(q_own, inputs.k_new, inputs.v_new))
        plans.append(plan)
    if mode == "tp":
        parts = []
        for p in range(size):
            h = slice(p * heads, (p + 1) * heads)
            merged = merge_partials(torch.stack([c.out[:, h] for c in contexts]),
                                    torch.stack([c.lse[:, h] for c in contexts]))
            parts.append(merge_two(merged, owns[p]) if owns else merged)
        merged = Partial(torch.cat([m.out for m in parts], 1), torch.cat([m.lse for m in parts], 1))
    else:
        merged = merge_partials(torch.stack([c.out for c in contexts]),
                                torch.stack([c.lse for c in contexts]))
        if owns:
            merged = merge_two(merged, owns[0])
    return PlacedResult(merged, contexts, plans)
