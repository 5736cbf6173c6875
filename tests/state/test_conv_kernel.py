"""torch_cp's in-place decode kernel for the causal conv (state/conv_kernel.py) against the torch
decode path of ``kernels.conv_step`` (the reference: transformers' conv update on states
gathered out of the pool and scattered back). On CUDA it runs compiled (a ``gpu`` test); without
CUDA, in Triton's interpreter (tests/conftest.py).

Rows: a resuming row, fresh rows (they read the zero slot, never their own, which holds NaN
here), and padding rows on the sink slot (NaN too). Channels not a multiple of the kernel's
block (a masked block), conv width 4 (Qwen3.5's), the input a strided view of a wider
projection, one layer of a [layers, slots, C, K - 1] pool.

- The written states are pure data movement (the window shifted by one): bit for bit the
  reference's; no other slot or layer changes; the zero slot stays zero.
- Outputs: fp32 within 1e-6 (a sum of four products in another order); bf16 within one bf16
  ulp (rtol 2**-7) compiled, where Triton rounds to nearest as torch does; within two in
  Triton's interpreter, which truncates at both roundings (the conv's sum, then SiLU).
- Through ``conv_step`` with ``kernels="fla"`` (``DECODE_CONV_KERNEL`` on) the kernel runs;
  with it off, the torch path.
"""

from __future__ import annotations

import pytest
import torch

from torch_cp.state import kernels

triton = pytest.importorskip("triton", reason="the kernel is Triton (CPU: its interpreter)")
from torch_cp.state.conv_kernel import BLOCK_C, conv_step_in_place  # noqa: E402

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
ROWS, CHANNELS, K, SLOTS, LAYERS = 5, BLOCK_C + 40, 4, 8, 2
SINK, ZERO = SLOTS, SLOTS + 1
SLOTS_B = [3, 0, 5, SINK, SINK]  # row 0 resumes, 1 and 2 are fresh, 3 and 4 are padding
FRESH_B = [False, True, True, True, True]


def case(dtype, device):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(LAYERS, SLOTS + 2, CHANNELS, K - 1, generator=g)
    pool[:, 0] = float("nan")  # row 1's own slot (fresh): never read
    pool[:, SINK] = float("nan")
    pool[:, ZERO] = 0
    wide = torch.randn(ROWS, CHANNELS + 24, generator=g)  # a projection's output
    x = wide[:, 8:8 + CHANNELS]
    weight = torch.randn(CHANNELS, K, generator=g) / 2
    return (x.to(device, dtype), weight.to(device, dtype), pool.to(device, dtype),
            torch.tensor(SLOTS_B, device=device), torch.tensor(FRESH_B, device=device))


def reference(x, weight, states, slots, fresh):
    return kernels.conv_step(x, weight, states, slots, fresh, None, True, "silu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_kernel_updates_the_pool_in_place_like_the_reference(dtype, device):
    x, weight, pool, slots, fresh = case(dtype, device)
    want_pool = pool.clone()
    want = reference(x, weight, want_pool[1], slots, fresh)
    before = pool.clone()
    got = conv_step_in_place(x, weight, pool[1], slots, fresh)
    assert got.dtype == dtype
    ulps = 1 if device == "cuda" else 2  # the interpreter truncates both roundings
    tol = (dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32
           else dict(atol=0, rtol=ulps * 2**-7))
    torch.testing.assert_close(got[:3], want[:3], **tol)  # padding rows' outputs are not used
    real = [3, 0, 5]  # the written slots of real rows: bit for bit
    assert torch.equal(pool[1, real], want_pool[1, real])
    untouched = [s for s in range(SLOTS + 2) if s not in real and s != SINK]
    torch.testing.assert_close(pool[1, untouched], before[1, untouched], atol=0, rtol=0,
                               equal_nan=True)
    assert torch.equal(pool[1, ZERO], torch.zeros_like(pool[1, ZERO]))
    torch.testing.assert_close(pool[0], before[0], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_step_takes_the_kernel_only_when_on(device, monkeypatch):
    x, weight, pool, slots, fresh = case(torch.float32, device)
    calls = []
    from torch_cp.state import conv_kernel

    real = conv_kernel.conv_step_in_place
    monkeypatch.setattr(conv_kernel, "conv_step_in_place",
                        lambda *a: calls.append(1) or real(*a))
    step = dict(qo_indptr=None, decode=True, activation="silu", kernels="fla")
    want = reference(x, weight, pool[1].clone(), slots, fresh)
    monkeypatch.setattr(kernels, "DECODE_CONV_KERNEL", False)
    kernels.conv_step(x, weight, pool[1].clone(), slots, fresh, **step)
    assert not calls
    monkeypatch.setattr(kernels, "DECODE_CONV_KERNEL", True)
    # As the model calls it: fresh rows as the plan's int64 flags (StepPlan.state_fresh).
    got = kernels.conv_step(x, weight, pool[1].clone(), slots, fresh.long(), **step)
    assert calls == [1]
    torch.testing.assert_close(got[:3], want[:3], atol=1e-6, rtol=1e-6)
