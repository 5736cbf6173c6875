"""Linears of decode-sized steps (a few tokens): each weight read once, by tiles of its rows.

A decode step's projections are GEMMs of 1 to 64 rows against a weight of megabytes: bound by
reading the weight, yet cuBLAS reads them at a fraction of the copy bandwidth on the H200: at 32
tokens of Qwen3-30B-A3B, q/k/v (20 MB) in 8.0 us and o (17 MB, split over K with a second
reduce kernel) in 9.5 us, where the copy bandwidth gives 4.9 and 3.9 (run 87). Here a program
owns ``rows`` output channels and multiplies every token with them over the whole reduction
(``tl.dot``, float32 accumulators), the grid sized to keep every SM streaming; where the
weight has too few rows for that, the reduction is split into ``split`` pieces whose float32
partials a second kernel sums in a fixed order (deterministic, as the one-piece path is).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_TOKENS = 64  # rows of x a call may have to take the kernel (above: F.linear)
# Triton's interpreter (3.9) multiplies bf16 tiles in tl.dot wrongly: there they go as fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class SkinnyTiles:
    """A launch: ``rows`` weight rows (output channels) a program, ``cols`` of the reduction a
    step (powers of two from 16), the reduction in ``split`` pieces, warps and pipeline
    stages (None: Triton's default)."""

    rows: int
    cols: int
    split: int = 1
    warps: int = 4
    stages: int | None = None

    def __post_init__(self):
        problems = [f"{name} {value} is not a power of two >= 16" for name, value in
                    (("rows", self.rows), ("cols", self.cols))
                    if value < 16 or value & (value - 1)]
        problems += [f"{name} {value} is not >= 1" for name, value in
                     (("split", self.split), ("warps", self.warps), ("stages", self.stages or 1))
                     if value < 1]
        if problems:
            raise ValueError("SkinnyTiles: " + "; ".join(problems))


@triton.jit
def _skinny(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, tokens, n_out, k_len, k_piece, x_st, w_sn,
            out_st, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, FP32_DOT: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    piece = tl.program_id(1)
    t = tl.arange(0, BM)
    in_t, in_n = t < tokens, n < n_out
    x_rows = x_ptr + t[:, None].to(tl.int64) * x_st
    w_rows = w_ptr + n[:, None].to(tl.int64) * w_sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(piece * k_piece, tl.minimum((piece + 1) * k_piece, k_len), BK):
        k = k0 + tl.arange(0, BK)  # k_len and k_piece are multiples of BK (see linear)
        x = tl.load(x_rows + k[None, :], mask=in_t[:, None], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=in_n[:, None], other=0.0)
        if FP32_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    mask = in_t[:, None] & in_n[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=in_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + t[:, None] * out_st + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(part_ptr + (piece * tokens + t[:, None]) * n_out + n[None, :], acc, mask=mask)


@triton.jit
def _sum_pieces(part_ptr, b_ptr, out_ptr, tokens, n_out, out_st, HAS_BIAS: tl.constexpr,
                SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < tokens * n_out
    acc = tl.load(part_ptr + i, mask=inside, other=0.0)
    for piece in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + piece * tokens * n_out + i, mask=inside, other=0.0)
    n = i % n_out
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i // n_out) * out_st + n, acc.to(out_ptr.dtype.element_ty), mask=inside)


@functools.cache
def _sms(device: torch.device) -> int:
    """The device's SMs (Triton's interpreter on the CPU: as many as an H200's)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else 132


def pick_tiles(tokens: int, n_out: int, k_len: int, sms: int) -> SkinnyTiles:
    """Tiles for ``tokens`` rows against an [n_out, k_len] weight on ``sms`` SMs: the widest
    rows that still give every SM a program, the reduction split where even 16 rows do not."""
    cols = 128 if k_len % 128 == 0 else 64
    rows = 16
    for wider in (32, 64):
        if triton.cdiv(n_out, wider) >= sms:
            rows = wider
    split = 1
    while (triton.cdiv(n_out, rows) * split * 2 <= sms and k_len % (cols * split * 2) == 0
           and k_len // (split * 2) >= 4 * cols):
        split *= 2
    return SkinnyTiles(rows=rows, cols=cols, split=split, warps=4)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes x [..., K] against ``weight`` [N, K]: CUDA, one 16-bit dtype,
    K a multiple of 64, at most ``MAX_TOKENS`` rows."""
    return (x.is_cuda and weight.is_cuda and weight.dim() == 2 and weight.stride(1) == 1
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[-1] == weight.shape[1] and weight.shape[1] % 64 == 0
            and x.numel() <= MAX_TOKENS * weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] of at most ``MAX_TOKENS`` rows (``fits``):
    [..., N] in x's dtype, summed in float32. ``tiles``: as given, else ``pick_tiles``."""
    k_len = weight.shape[1]
    x_tk = x.reshape(-1, k_len)
    if x_tk.stride(-1) != 1:
        x_tk = x_tk.contiguous()
    tokens, n_out = x_tk.shape[0], weight.shape[0]
    out = torch.empty(tokens, n_out, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out.view(*x.shape[:-1], n_out)
    t = tiles or pick_tiles(tokens, n_out, k_len, _sms(x.device))
    if k_len % (t.cols * t.split):
        raise ValueError(f"skinny_linear: K {k_len} is not a multiple of cols x split "
                         f"{t.cols} x {t.split}")
    part = (torch.empty(t.split, tokens, n_out, dtype=torch.float32, device=x.device)
            if t.split > 1 else out)
    has_bias = bias is not None
    launch = dict(num_warps=t.warps, **({} if t.stages is None else dict(num_stages=t.stages)))
    _skinny[(triton.cdiv(n_out, t.rows), t.split)](
        x_tk, weight, bias if has_bias else out, out, part, tokens, n_out, k_len,
        k_len // t.split, x_tk.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=has_bias,
        SPLIT=t.split, BM=max(16, triton.next_power_of_2(tokens)), BN=t.rows, BK=t.cols,
        FP32_DOT=INTERPRETED, **launch)
    if t.split > 1:
        block = 1024
        _sum_pieces[(triton.cdiv(tokens * n_out, block),)](
            part, bias if has_bias else out, out, tokens, n_out, out.stride(0),
            HAS_BIAS=has_bias, SPLIT=t.split, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], n_out)
