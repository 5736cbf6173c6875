"""Paged GQA decode attention in two Triton kernels: split each row's context, merge the splits.

FlashInfer's tensor-core decode, planned for a CUDA graph, always splits the KV, caps its work at
two CTAs an SM and walks each piece in sequence, so short contexts are latency-bound: 10.5 us for
one 512-token row of Qwen3-30B-A3B's layer (1 MB of KV: 0.25 us at the copy bandwidth) and 22 us
a layer at 32 x 512 inside a step (runs 77, 78; BENCHMARKS.md). Here every (token, KV head,
split) is a program: each row's context is cut into ``splits`` even pieces (whole blocks of
``BLOCK_N`` tokens, read through the page table), whose partials (running max, sum and output,
float32) a second kernel merges into the output and base-2 LSE. The number of splits depends on
the step's shape only (rows, KV heads, page-table width), so a CUDA graph replays it for any
context lengths; the pieces follow each row's length on the device. Every row gets the same
number of pieces, so one long row among short ones is read by few programs (FlashInfer's host
planner balances such a batch; ``benchmarks/decode_kernels.py``'s ``32x512+32768`` case
measures the cost).

Tokens past a row's length, padding tokens (``token_row`` -1) and the sink page are never read
(masked loads), so NaN there never reaches a real row. A token with no context gets out 0 and
LSE -inf, as FlashInfer gives.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # context tokens a program multiplies at a time
PROGRAMS_PER_SM = 4  # split programs a step aims for, per SM
# The most splits of a row: the merge reads all of a (token, head)'s partials in one program,
# which spills registers past a few hundred (helper 40, sm_90 resource usage).
MAX_SPLITS = 64
LOG2E = 1.0 / math.log(2.0)
# Triton's interpreter (3.9) multiplies bf16 tiles in tl.dot wrongly: there they go as fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _split(q_ptr, kv_ptr, table_ptr, lens_ptr, token_row_ptr, part_o_ptr, part_ml_ptr, out_ptr,
           lse_ptr, scale_log2, q_sn, q_sh, kv_sp, kv_skv, kv_ss, kv_sh, table_sr, heads_total,
           splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
           BLOCK: tl.constexpr, ONE_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr):
    # ``splits`` is a runtime value (one compile for every count); ONE_SPLIT: it is 1 and the
    # program writes the result itself.
    n = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    row = tl.load(token_row_ptr + n)
    safe_row = tl.maximum(row, 0)
    length = tl.where(row >= 0, tl.load(lens_ptr + safe_row), 0)
    blocks = tl.cdiv(length, BLOCK)
    per_split = tl.cdiv(blocks, splits) * BLOCK
    start = s * per_split
    end = tl.minimum(start + per_split, length)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + n * q_sn + (h * G + g)[:, None] * q_sh + d[None, :],
                mask=(g < G)[:, None], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for t0 in range(start, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        valid = t < end
        page = tl.load(table_ptr + safe_row * table_sr + t // PAGE, mask=valid, other=0)
        base = kv_ptr + page.to(tl.int64) * kv_sp + (t % PAGE) * kv_ss + h * kv_sh
        k = tl.load(base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(base[:, None] + kv_skv + d[None, :], mask=valid[:, None], other=0.0)
        if FP32_DOT:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
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
    heads = h * G + g
    if ONE_SPLIT:  # the split is the whole row: write the result
        seen = total > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
        tl.store(out_ptr + n * q_sn + heads[:, None] * q_sh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])
        tl.store(lse_ptr + n * heads_total + heads,
                 tl.where(seen, m + tl.log2(tl.where(seen, total, 1.0)), float("-inf")),
                 mask=g < G)
    else:
        part = (n * heads_total + heads).to(tl.int64) * splits + s  # [token, head, split]
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
        tl.store(part_ml_ptr + part * 2, m, mask=g < G)
        tl.store(part_ml_ptr + part * 2 + 1, total, mask=g < G)


@triton.jit
def _merge(part_o_ptr, part_ml_ptr, out_ptr, lse_ptr, out_sn, out_sh, heads_total, splits,
           D: tl.constexpr, SP: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    part = (n * heads_total + h).to(tl.int64) * splits + s
    in_s = s < splits
    m = tl.load(part_ml_ptr + part * 2, mask=in_s, other=float("-inf"))
    total = tl.load(part_ml_ptr + part * 2 + 1, mask=in_s, other=0.0)
    top = tl.max(m, 0)
    seen = top > float("-inf")
    weight = tl.where(total > 0, tl.exp2(m - tl.where(seen, top, 0.0)), 0.0)  # [SP]
    norm = tl.sum(weight * total, 0)
    acc = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=in_s[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(seen, norm, 1.0)
    tl.store(out_ptr + n * out_sn + h * out_sh + d, tl.where(seen, out, 0.0)
             .to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + n * heads_total + h,
             tl.where(seen, top + tl.log2(tl.where(seen, norm, 1.0)), float("-inf")))


def supported(head_dim: int, group: int) -> bool:
    """Whether the kernels take this head size (a power of two, 16 to 256) and GQA group."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and 1 <= group <= 64


def splits_for(tokens: int, kv_heads: int, max_context: int, sms: int) -> int:
    """Splits a row's context is cut into: enough programs for ``PROGRAMS_PER_SM`` an SM, no
    more than the blocks of the longest context the step's page table can hold, nor than
    ``MAX_SPLITS``."""
    wanted = -(-PROGRAMS_PER_SM * sms // max(1, tokens * kv_heads))
    return max(1, min(wanted, -(-max_context // BLOCK_N), MAX_SPLITS))


def decode(q_nhd: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor,
           lens: torch.Tensor, token_row: torch.Tensor, scale: float, splits: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's attention over its row's context in the pool, split ``splits`` ways.

    Args:
        q_nhd: [N, H, D], one token a row of a decode step.
        kv_layer: [pages, 2, local_page, Hkv, D], the layer's pool (K then V).
        table: [B, width] int32 page ids of each row; lens: [B] int32 context tokens of each
            row (this partner's); token_row: [N] the row of each token, -1 for padding.
        scale: the softmax scale; splits: ``splits_for`` the step's shape.
    Returns:
        out [N, H, D] in q's dtype, lse [N, H] float32 base 2 (0 and -inf without context).
    """
    n, heads, dim = q_nhd.shape
    kv_heads = kv_layer.shape[3]
    group = heads // kv_heads
    q_nhd = q_nhd.contiguous()
    out = torch.empty_like(q_nhd)
    lse = torch.empty(n, heads, dtype=torch.float32, device=q_nhd.device)
    if splits > 1:
        part_o = torch.empty(n * heads * splits, dim, dtype=torch.float32, device=q_nhd.device)
        part_ml = torch.empty(n * heads * splits, 2, dtype=torch.float32, device=q_nhd.device)
    else:
        part_o = part_ml = out  # unused
    fp32_dot = INTERPRETED or q_nhd.dtype == torch.float32
    _split[(n, kv_heads, splits)](
        q_nhd, kv_layer, table, lens, token_row, part_o, part_ml, out, lse, scale * LOG2E,
        q_nhd.stride(0), q_nhd.stride(1), kv_layer.stride(0), kv_layer.stride(1),
        kv_layer.stride(2), kv_layer.stride(3), table.stride(0), heads, splits, G=group,
        GP=max(16, triton.next_power_of_2(group)), D=dim, PAGE=kv_layer.shape[2], BLOCK=BLOCK_N,
        ONE_SPLIT=splits == 1, FP32_DOT=fp32_dot,
        # 8 warps from head_dim 128: 164-241 registers a thread on sm_90, where 4 warps take
        # 238-254 and spill at 256 (helper 40's resource usage; not timed yet).
        num_warps=8 if dim >= 128 else 4)
    if splits > 1:
        _merge[(n, heads)](part_o, part_ml, out, lse, out.stride(0), out.stride(1), heads, splits,
                           D=dim, SP=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out, lse
