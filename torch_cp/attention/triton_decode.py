"""Paged GQA decode attention in two Triton kernels: the step's context in even chunks, merged.

FlashInfer's tensor-core decode, planned for a CUDA graph, always splits the KV, caps its work at
two CTAs an SM and walks each piece in sequence, so short contexts are latency-bound: 10.5 us for
one 512-token row of Qwen3-30B-A3B's layer (1 MB of KV: 0.25 us at the copy bandwidth) and 22 us
a layer at 32 x 512 inside a step (runs 77, 78; BENCHMARKS.md).

Here the step's whole context (every token's row, through the page table) is cut into chunks of
one size, whole blocks of ``BLOCK_N`` tokens, just small enough that they fit a fixed number of
work items per KV head: ``tokens + spare`` items, the spare sized to keep every SM busy. Each
chunk is a program, found from the tokens' lengths on the device (a prefix sum), so a long row
among short ones gets many programs and the grid depends on the step's shape only: a CUDA graph
replays it for any lengths, with no planning on the host. A second kernel merges each token's
chunks (running max, sum and output in float32) into its output and base-2 LSE. (Merging in
the attend kernel instead, the last program of a token's chunks found by an atomic count, was
slower on the H200 at every size of run 91: 1.4-7.6x, best tile against best tile; it is in
fa8a115.)

Tokens past a row's length, padding tokens (``token_row`` -1) and the sink page are never read
(masked loads), so NaN there never reaches a real token. A token with no context gets out 0 and
LSE -inf, as FlashInfer gives.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from torch_cp import pdl
from torch_cp.pdl import pdl_release, pdl_wait  # by name: Inductor copies them (pdl.py)

# The tile, read at each call (so a benchmark can set another: decode_kernels --triton).
BLOCK_N = 64  # context tokens a program multiplies at a time
PROGRAMS_PER_SM = 4  # work items a step aims for, per SM
WARPS: int | None = None  # the attend kernel's warps; None: 8 from head_dim 128, else 4
STAGES: int | None = None  # its loop's pipeline stages; None: Triton's default
# Steps of at most this many tokens take ONE_TOKEN_TILE (block, warps, programs an SM, stages):
# on the H200 one 512-token row of Qwen3-30B-A3B's layer took 6.4 us against 8.0 at the tile
# above and FlashInfer's 9.6 (run 87, four layers' KV in turn). None: the tile above always.
ONE_TOKEN_TILE: tuple[int, int, int, int | None] | None = (32, 4, 1, 3)
ONE_TOKEN_STEPS = 1
MERGE_BLOCK = 16  # chunks the merge combines at a time
# The merge's warps (read at each call): at one warp it took 0.238 against 0.171 ms a
# Qwen3-30B-A3B step at one token (run 109).
MERGE_WARPS = 4
LOG2E = 1.0 / math.log(2.0)
# Triton's interpreter (3.9) multiplies bf16 tiles in tl.dot wrongly: there they go as fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _chunks(lens_ptr, token_row_ptr, tokens, spare, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Every token's context length [NP], chunk count and first chunk, and the chunk size: the
    step's context over ``spare`` items, in whole blocks (the same in every program)."""
    i = tl.arange(0, NP)
    row = tl.load(token_row_ptr + i, mask=i < tokens, other=-1)
    length = tl.where(row >= 0, tl.load(lens_ptr + tl.maximum(row, 0), mask=i < tokens, other=0),
                      0)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(tl.sum(length, 0), spare), BLOCK), 1) * BLOCK
    count = tl.cdiv(length, chunk)
    first = tl.cumsum(count, 0) - count
    return i, row, length, count, first, chunk


@triton.jit
def _attend(q_ptr, kv_ptr, table_ptr, lens_ptr, token_row_ptr, part_o_ptr, part_ml_ptr,
            scale_log2, tokens, spare, items, q_sn, q_sh, kv_sp, kv_skv, kv_ss, kv_sh, table_sr,
            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
            BLOCK: tl.constexpr, NP: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # every program, before any load (torch_cp/pdl.py)
    pdl_release(PDL)
    w = tl.program_id(0)
    h = tl.program_id(1)
    i, row_i, length_i, count_i, first_i, chunk = _chunks(lens_ptr, token_row_ptr, tokens, spare,
                                                          NP, BLOCK)
    n = tl.sum((first_i + count_i <= w).to(tl.int32), 0)  # the token whose chunks hold item w
    if n < tokens:
        mine = i == n
        row = tl.sum(tl.where(mine, row_i, 0), 0)
        length = tl.sum(tl.where(mine, length_i, 0), 0)
        start = (w - tl.sum(tl.where(mine, first_i, 0), 0)) * chunk
        end = tl.minimum(start + chunk, length)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + n.to(tl.int64) * q_sn + (h * G + g)[:, None] * q_sh + d[None, :],
                    mask=(g < G)[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for t0 in range(start, end, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            valid = t < end
            page = tl.load(table_ptr + row.to(tl.int64) * table_sr + t // PAGE, mask=valid,
                           other=0)
            base = kv_ptr + page.to(tl.int64) * kv_sp + (t % PAGE) * kv_ss + h * kv_sh
            k = tl.load(base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(base[:, None] + kv_skv + d[None, :], mask=valid[:, None], other=0.0)
            if FP32_DOT:
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)),
                                input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))  # finite: every block has a valid token
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            if FP32_DOT:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        part = (h * items + w).to(tl.int64) * G + g  # [KV head, item, group member]
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
        tl.store(part_ml_ptr + part * 2, m, mask=g < G)
        tl.store(part_ml_ptr + part * 2 + 1, total, mask=g < G)


@triton.jit
def _merge(lens_ptr, token_row_ptr, part_o_ptr, part_ml_ptr, out_ptr, lse_ptr, tokens, spare,
           items, out_sn, out_sh, heads_total, G: tl.constexpr, D: tl.constexpr,
           BLOCK: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pdl_release(PDL)
    n = tl.program_id(0)
    hq = tl.program_id(1)
    i, row_i, length_i, count_i, first_i, chunk = _chunks(lens_ptr, token_row_ptr, tokens, spare,
                                                          NP, BLOCK)
    count = tl.sum(tl.where(i == n, count_i, 0), 0)
    first = tl.sum(tl.where(i == n, first_i, 0), 0)
    d = tl.arange(0, D)
    top = tl.full([], float("-inf"), tl.float32)
    norm = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for c0 in range(0, count, SP):
        c = c0 + tl.arange(0, SP)
        in_c = c < count
        part = ((hq // G) * items + first + c).to(tl.int64) * G + hq % G
        m = tl.load(part_ml_ptr + part * 2, mask=in_c, other=float("-inf"))
        total = tl.load(part_ml_ptr + part * 2 + 1, mask=in_c, other=0.0)
        top_new = tl.maximum(top, tl.max(m, 0))  # finite: every chunk saw a token
        weight = tl.where(in_c, tl.exp2(m - top_new), 0.0)
        rescale = tl.exp2(top - top_new)
        outs = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=in_c[:, None], other=0.0)
        acc = acc * rescale + tl.sum(outs * weight[:, None], 0)
        norm = norm * rescale + tl.sum(total * weight, 0)
        top = top_new
    seen = count > 0
    out = tl.where(seen, acc / tl.where(seen, norm, 1.0), 0.0)
    tl.store(out_ptr + n.to(tl.int64) * out_sn + hq * out_sh + d, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + n.to(tl.int64) * heads_total + hq,
             tl.where(seen, top + tl.log2(tl.where(seen, norm, 1.0)), float("-inf")))


def supported(head_dim: int, group: int) -> bool:
    """Whether the kernels take this head size (a power of two, 16 to 256) and GQA group."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and 1 <= group <= 64


def tile_for(tokens: int) -> tuple[int, int | None, int, int | None]:
    """(block_n, warps, programs an SM, stages) for a step of ``tokens`` tokens, as the module's
    settings say at the time of the call."""
    if ONE_TOKEN_TILE is not None and tokens <= ONE_TOKEN_STEPS:
        return ONE_TOKEN_TILE
    return BLOCK_N, WARPS, PROGRAMS_PER_SM, STAGES


def spare_items(tokens: int, kv_heads: int, sms: int, programs_per_sm: int | None = None
                ) -> int:
    """Work items a KV head gets beyond one a token: enough for ``programs_per_sm`` programs an
    SM (default ``PROGRAMS_PER_SM``), and at least the tokens (so every token's chunks fit: see
    ``decode``)."""
    return max(tokens, -(-(programs_per_sm or PROGRAMS_PER_SM) * sms // kv_heads))


def decode(q_nhd: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor,
           lens: torch.Tensor, token_row: torch.Tensor, scale: float, spare: int,
           block_n: int | None = None, warps: int | None = None, stages: int | None = None,
           on_pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's attention over its row's context in the pool.

    Args:
        q_nhd: [N, H, D], one token a row of a decode step.
        kv_layer: [pages, 2, local_page, Hkv, D], the layer's pool (K then V).
        table: [B, width] int32 page ids of each row; lens: [B] int32 context tokens of each
            row (this partner's); token_row: [N] the row of each token, -1 for padding.
        scale: the softmax scale; spare: ``spare_items`` for the step's shape. The chunk size is
            at least the context over ``spare``, so the chunks number at most ``N + spare``
            (one partial chunk a token), the items each KV head has.
        block_n, warps, stages: the attend kernel's context tokens a tile (a power of two, 16
            up), warps and pipeline stages; by default ``BLOCK_N``, ``WARPS``, ``STAGES``.
        on_pdl: launch both kernels with the dependent launch; by default where
            ``torch_cp.pdl`` is active.
    Returns:
        out [N, H, D] in q's dtype, lse [N, H] float32 base 2 (0 and -inf without context).
    """
    n, heads, dim = q_nhd.shape
    kv_heads = kv_layer.shape[3]
    on_pdl = pdl.active(q_nhd) if on_pdl is None else on_pdl
    group = heads // kv_heads
    assert spare >= 1, "the chunk size divides the context by the spare items"
    block_n, warps, stages = block_n or BLOCK_N, warps or WARPS, stages or STAGES
    items = n + spare
    q_nhd = q_nhd.contiguous()
    out = torch.empty_like(q_nhd)
    lse = torch.empty(n, heads, dtype=torch.float32, device=q_nhd.device)
    part_o = torch.empty(kv_heads * items * group, dim, dtype=torch.float32, device=q_nhd.device)
    part_ml = torch.empty(kv_heads * items * group, 2, dtype=torch.float32, device=q_nhd.device)
    tokens_p2 = max(16, triton.next_power_of_2(n))
    _attend[(items, kv_heads)](
        q_nhd, kv_layer, table, lens, token_row, part_o, part_ml, scale * LOG2E, n, spare, items,
        q_nhd.stride(0), q_nhd.stride(1), kv_layer.stride(0), kv_layer.stride(1),
        kv_layer.stride(2), kv_layer.stride(3), table.stride(0), G=group,
        GP=max(16, triton.next_power_of_2(group)), D=dim, PAGE=kv_layer.shape[2], BLOCK=block_n,
        NP=tokens_p2, FP32_DOT=INTERPRETED or q_nhd.dtype == torch.float32, PDL=on_pdl,
        # 8 warps from head_dim 128: 164-241 registers a thread on sm_90, where 4 warps take
        # 238-254 and spill at 256 (helper 40's resource usage at BLOCK_N 64).
        num_warps=warps or (8 if dim >= 128 else 4), **({"num_stages": stages} if stages else {}),
        **pdl.launch_options(on_pdl))
    _merge[(n, heads)](
        lens, token_row, part_o, part_ml, out, lse, n, spare, items, out.stride(0),
        out.stride(1), heads, G=group, D=dim, BLOCK=block_n, NP=tokens_p2, SP=MERGE_BLOCK,
        PDL=on_pdl, num_warps=MERGE_WARPS, **pdl.launch_options(on_pdl))
    return out, lse
