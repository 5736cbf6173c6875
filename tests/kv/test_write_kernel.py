"""The GPU's one-kernel pool write (kv/write_kernel.py) against torch indexing
(``write_kv_slots`` on the CPU): the same pool bit for bit (pure data movement), so no other slot
changes. Tokens on several pages and the sink page, K and V cast to the pool's dtype, V a strided
view of a packed q/k/v projection (fused_linear.py), rows wider than one block, no tokens. On
CUDA it runs compiled (a ``gpu`` test, through ``write_kv_slots``, which takes it there); without
CUDA in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from torch_cp.kv.pool import write_kv_slots

pytest.importorskip("triton", reason="the kernel is Triton (CPU: its interpreter)")
from torch_cp.kv.write_kernel import write_kv_rows  # noqa: E402

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
PAGES, PAGE = 6, 4  # the last page is the sink


def case(heads: int, dim: int, tokens: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(PAGES, 2, PAGE, heads, dim, generator=g).to(dtype)
    slots = torch.randperm((PAGES - 1) * PAGE, generator=g)[:tokens]
    sink = torch.full((2,), (PAGES - 1) * PAGE + 1)  # padding rows: both on one sink slot
    index = torch.cat([slots, sink])[:tokens]
    packed = torch.randn(len(index), 3 * heads * dim, generator=g)  # [q | k | v], v a view
    k = packed[:, heads * dim:2 * heads * dim].reshape(-1, heads, dim).contiguous()
    v = packed[:, 2 * heads * dim:].view(-1, heads, dim)
    return cache, k, v, index


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,dim,tokens,dtype", [
    (2, 16, 7, torch.float32),
    (1, 8, 3, torch.bfloat16),       # fp32 K/V cast to the pool's bf16
    (4, 2048, 5, torch.float32),     # a row of 8192: two blocks of 4096
    (2, 16, 0, torch.float32),       # no tokens
])
def test_one_kernel_writes_what_torch_indexing_writes(device, heads, dim, tokens, dtype):
    cache, k, v, index = case(heads, dim, tokens, dtype)
    assert not v.is_contiguous() or tokens == 0
    want = cache.clone()
    torch.Tensor.__setitem__(want, (index // PAGE, 0, index % PAGE), k.to(dtype))
    torch.Tensor.__setitem__(want, (index // PAGE, 1, index % PAGE), v.to(dtype))
    on = [t.to(device) for t in (cache, k, v, index)]
    if device == "cuda":
        write_kv_slots(*on)  # the kernel's path on CUDA
    else:
        write_kv_rows(*on)
    assert torch.equal(on[0].cpu(), want)


def test_torch_indexing_is_what_the_cpu_runs():
    cache, k, v, index = case(2, 16, 7, torch.float32)
    want = cache.clone()
    write_kv_rows(want, k, v, index)
    write_kv_slots(cache, k, v, index)
    assert torch.equal(cache, want)
