"""A step's new queries and keys through their per-head RMSNorms and RoPE, and the keys and values
into the pool, in one Triton kernel.

In a compiled decode step of a Qwen3 layer Inductor runs the query's norm and RoPE as one kernel,
the key's as another, and the pool write is a third (``write_kernel``): three launches a layer of
a few microseconds each that read almost nothing. Here one program takes one head of one token:
a query head's output goes to ``q_out``, a KV head's key to ``k_out`` and, with its value, to the
token's slot in the pool.

The arithmetic rounds where transformers' eager code rounds (``Qwen3RMSNorm``, then
``apply_rotary_pos_emb`` with ``rotate_half``): the norm in float32 rounded to the model's dtype,
times the weight, rounded; ``x * cos`` and ``rotate_half(x) * sin`` each rounded, then their sum.
A product of two bf16 values is exact in float32, so each rounding equals the eager op's; only
the mean of squares may sum in another order and the reciprocal square root round otherwise,
which moves a bf16 output by one step where the float32 value sits at a rounding boundary.
Channels past the rotary dims (partial RoPE) pass through unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from torch_cp import pdl
from torch_cp.kv.pool import rows_dense
from torch_cp.pdl import pdl_release, pdl_wait  # by name: Inductor copies them (pdl.py)


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to ``DTYPE`` (to nearest, ties to even), kept in float32. bf16 by
    its bits: Triton's interpreter truncates in ``.to(tl.bfloat16)``."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rope(y, y_partner, d, cos_ptr, sin_ptr, RD: tl.constexpr, DTYPE: tl.constexpr):
    """``y * cos + rotate_half(y) * sin`` over the first ``RD`` channels, eager's roundings."""
    half: tl.constexpr = RD // 2
    rotated = d < RD
    cos = tl.load(cos_ptr + d, mask=rotated, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + d, mask=rotated, other=0.0).to(tl.float32)
    turned = tl.where(d < half, -y_partner, y_partner)
    out = _rounded(_rounded(y * cos, DTYPE) + _rounded(turned * sin, DTYPE), DTYPE)
    return tl.where(rotated, out, y).to(DTYPE)


@triton.jit
def _normed(src_ptr, w_ptr, d, partner, eps, D: tl.constexpr, NORM: tl.constexpr,
            DTYPE: tl.constexpr):
    """One head's channels and their rotate-half partners, through the RMSNorm when ``NORM``."""
    in_head = d < D
    x = tl.load(src_ptr + d, mask=in_head, other=0.0).to(tl.float32)
    x_partner = tl.load(src_ptr + partner, mask=in_head, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(w_ptr + d, mask=in_head, other=0.0).to(tl.float32)
        w_partner = tl.load(w_ptr + partner, mask=in_head, other=0.0).to(tl.float32)
        x = _rounded(w * _rounded(x * rstd, DTYPE), DTYPE)
        x_partner = _rounded(w_partner * _rounded(x_partner * rstd, DTYPE), DTYPE)
    return x, x_partner


@triton.jit
def _norm_rope_write(q_ptr, k_ptr, v_ptr, q_sn, k_sn, v_sn, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                     cs_sn, q_out_ptr, k_out_ptr, cache_ptr, index_ptr, page, page_stride, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     RD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any load or store (torch_cp/pdl.py)
    pdl_release(PDL)
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, DP)
    in_head = d < D
    half: tl.constexpr = RD // 2
    partner = tl.where(d < half, d + half, tl.where(d < RD, d - half, d))
    dtype = q_out_ptr.dtype.element_ty
    cos_ptr += token * cs_sn
    sin_ptr += token * cs_sn
    if h < HQ:
        x, x_partner = _normed(q_ptr + token * q_sn + h * D, q_w_ptr, d, partner, eps, D, NORM,
                               dtype)
        out = _rope(x, x_partner, d, cos_ptr, sin_ptr, RD, dtype)
        tl.store(q_out_ptr + (token * HQ + h) * D + d, out, mask=in_head)
    else:
        kh = h - HQ
        x, x_partner = _normed(k_ptr + token * k_sn + kh * D, k_w_ptr, d, partner, eps, D, NORM,
                               dtype)
        out = _rope(x, x_partner, d, cos_ptr, sin_ptr, RD, dtype)
        tl.store(k_out_ptr + (token * HKV + kh) * D + d, out, mask=in_head)
        slot = tl.load(index_ptr + token).to(tl.int64)
        dst = cache_ptr + (slot // page) * page_stride + ((slot % page) * HKV + kh) * D + d
        v = tl.load(v_ptr + token * v_sn + kh * D + d, mask=in_head)
        tl.store(dst, out.to(cache_ptr.dtype.element_ty), mask=in_head)
        tl.store(dst + page * HKV * D, v.to(cache_ptr.dtype.element_ty), mask=in_head)


def norm_rope_write(q_nhd: torch.Tensor, k_nhd: torch.Tensor, v_nhd: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                    cos_nr: torch.Tensor, sin_nr: torch.Tensor, cache: torch.Tensor,
                    write_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' queries and keys normed and rotated, and their keys and values written.

    Args:
        q_nhd [N, Hq, D], k_nhd / v_nhd [N, Hkv, D]: the projections (rows may be apart, as
            views of one q/k/v projection are).
        q_weight, k_weight [D]: the per-head RMSNorms' weights, or both None for no norm; eps
            their epsilon.
        cos_nr, sin_nr [N, R]: RoPE's tables (R <= D rotated channels, even), in q's dtype.
        cache [pages, 2, page, Hkv, D] (contiguous): the layer's pool; write_index [N] flat
            slots (``page_id * page + slot``).
    Returns:
        q [N, Hq, D] and k [N, Hkv, D], normed and rotated, in q's dtype (k as written).
    """
    n, hq, dim = q_nhd.shape
    hkv = k_nhd.shape[1]
    rotary = cos_nr.shape[-1]
    q_nhd, k_nhd, v_nhd = (t if rows_dense(t) else t.contiguous() for t in (q_nhd, k_nhd, v_nhd))
    cos_nr, sin_nr = cos_nr.contiguous(), sin_nr.contiguous()
    assert rotary % 2 == 0 and rotary <= dim and cache.is_contiguous()
    assert (q_weight is None) == (k_weight is None)
    assert cache.shape[3:] == (hkv, dim) and write_index.shape == (n,)
    q_out = torch.empty(n, hq, dim, dtype=q_nhd.dtype, device=q_nhd.device)
    k_out = torch.empty(n, hkv, dim, dtype=q_nhd.dtype, device=q_nhd.device)
    if n == 0:
        return q_out, k_out
    on_pdl = pdl.active(cache)
    norm = q_weight is not None
    # Triton launches on the current device, which need not be the pool's.
    with torch.cuda.device(cache.device) if cache.is_cuda else contextlib.nullcontext():
        _norm_rope_write[(n, hq + hkv)](
            q_nhd, k_nhd, v_nhd, q_nhd.stride(0), k_nhd.stride(0), v_nhd.stride(0),
            q_weight if norm else q_nhd, k_weight if norm else k_nhd, cos_nr, sin_nr,
            cos_nr.stride(0), q_out, k_out, cache, write_index.contiguous(), cache.shape[2],
            cache.stride(0), eps, HQ=hq, HKV=hkv, D=dim, DP=triton.next_power_of_2(dim),
            RD=rotary, NORM=norm, PDL=on_pdl, num_warps=1 if dim <= 128 else 2,
            **pdl.launch_options(on_pdl))
    return q_out, k_out
