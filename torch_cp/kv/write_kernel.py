"""One Triton kernel that writes a step's new K and V into a GQA pool layer on the GPU.

The pool write in torch (``cache[page_ids, 0, slots] = k``, the same for v, after ``//`` and ``%``
of the flat slot index) launches four to six small kernels a layer; in a compiled and captured
Qwen3-8B decode step at batch 1 they took 0.37 ms of 6.1 (run 24, BENCHMARKS.md "Where a decode
step goes"). Here one program copies one token's K and V rows ([kv_heads * head_dim], one
head-major block each) to their slot, the page and slot computed from the flat index in place.
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
def _write_kv(k_ptr, v_ptr, cache_ptr, index_ptr, k_stride, v_stride, row, page, page_stride,
              BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any load or store (torch_cp/pdl.py)
    pdl_release(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < row
    slot = tl.load(index_ptr + token).to(tl.int64)
    dst = cache_ptr + (slot // page) * page_stride + (slot % page) * row + cols
    tl.store(dst, tl.load(k_ptr + token * k_stride + cols, mask=in_row), mask=in_row)
    tl.store(dst + page * row, tl.load(v_ptr + token * v_stride + cols, mask=in_row),
             mask=in_row)


def write_kv_rows(cache: torch.Tensor, k_nhd: torch.Tensor, v_nhd: torch.Tensor,
                  write_index: torch.Tensor) -> None:
    """``cache`` [pages, 2, page, H, D] (contiguous) gets ``k_nhd`` / ``v_nhd`` [N, H, D] (each
    token's [H, D] dense) at flat slots ``write_index`` [N] (``page_id * page + slot``)."""
    # Cast by torch (a no-op in the model's dtype), so the pool holds what indexing would write.
    k_nhd, v_nhd = k_nhd.to(cache.dtype), v_nhd.to(cache.dtype)
    assert cache.is_contiguous() and write_index.is_contiguous()
    assert write_index.shape[0] == k_nhd.shape[0] == v_nhd.shape[0]
    assert rows_dense(k_nhd) and rows_dense(v_nhd)
    tokens = write_index.shape[0]
    if tokens == 0:
        return
    page, row = cache.shape[2], cache.shape[3] * cache.shape[4]
    on_pdl = pdl.active(cache)
    block = min(triton.next_power_of_2(row), 4096)
    # Triton launches on the current device, which need not be the pool's.
    with torch.cuda.device(cache.device) if cache.is_cuda else contextlib.nullcontext():
        _write_kv[(tokens, triton.cdiv(row, block))](
            k_nhd, v_nhd, cache, write_index, k_nhd.stride(0), v_nhd.stride(0), row, page,
            cache.stride(0), BLOCK=block, PDL=on_pdl, **pdl.launch_options(on_pdl))
