"""torch_cp's in-place kernels for the causal conv (state/conv_kernel.py) against the torch
path of ``kernels.conv_step`` (the reference: transformers' conv on states gathered out of the
pool and scattered back), for decode steps and multi-token steps. On CUDA they run compiled (a
``gpu`` test); without CUDA, in Triton's interpreter (tests/conftest.py).

Rows: a resuming row, fresh rows (they read the zero slot, never their own, which holds NaN
here), and padding rows on the sink slot (NaN too). Channels not a multiple of the kernel's
block (a masked block), conv width 4 (Qwen3.5's), the input a strided view of a wider
projection, one layer of a [layers, slots, C, K - 1] pool.

- The written states are pure data movement (the window shifted by one): bit for bit the
  reference's; no other slot or layer changes; the zero slot stays zero.
- Outputs: within ``TOLERANCE`` (fp32 1e-6; bf16 one or two ulps and a rounding of the
  products, why below).
- A multi-token step: rows of 0, 1, 2, 7 and 37 tokens (shorter and longer than the conv's
  window, one over two of the kernel's token blocks), fresh and resuming (one with no tokens),
  token padding past the rows (zeros out), conv widths 2 and 4, the input strided: the same,
  through both kernels at once.
- Through ``conv_step`` with ``kernels="fla"`` (``CONV_KERNELS`` on) the kernels run; with it
  off, the torch path.
"""

from __future__ import annotations

import pytest
import torch

from torch_cp.state import kernels

triton = pytest.importorskip("triton", reason="the kernel is Triton (CPU: its interpreter)")
from torch_cp.state.conv_kernel import (  # noqa: E402
    BLOCK_C,
    conv_rows_in_place,
    conv_step_in_place,
)

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
ROWS, CHANNELS, K, SLOTS, LAYERS = 5, BLOCK_C + 40, 4, 8, 2
SINK, ZERO = SLOTS, SLOTS + 1
SLOTS_B = [3, 0, 5, SINK, SINK]  # row 0 resumes, 1 and 2 are fresh, 3 and 4 are padding
FRESH_B = [False, True, True, True, True]


# fp32: a sum of a few products in another order. bf16 compiled: one ulp (2**-7 relative), the
# float32 sum rounded once like torch's conv1d, which may sum in another order. bf16 in Triton's
# interpreter, which truncates where torch rounds (the sum, then SiLU's result): two ulps, and
# 2**-8 absolute where SiLU of a negative sum near zero amplifies the truncated sum's error
# (3 of 8400 outputs here, by up to 0.0015).
TOLERANCE = {(torch.float32, "cpu"): dict(atol=1e-6, rtol=1e-6),
             (torch.float32, "cuda"): dict(atol=1e-6, rtol=1e-6),
             (torch.bfloat16, "cpu"): dict(atol=2**-8, rtol=2 * 2**-7),
             (torch.bfloat16, "cuda"): dict(atol=0, rtol=2**-7)}


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
    tol = TOLERANCE[dtype, device]
    torch.testing.assert_close(got[:3], want[:3], **tol)  # padding rows' outputs are not used
    real = [3, 0, 5]  # the written slots of real rows: bit for bit
    assert torch.equal(pool[1, real], want_pool[1, real])
    untouched = [s for s in range(SLOTS + 2) if s not in real and s != SINK]
    torch.testing.assert_close(pool[1, untouched], before[1, untouched], atol=0, rtol=0,
                               equal_nan=True)
    assert torch.equal(pool[1, ZERO], torch.zeros_like(pool[1, ZERO]))
    torch.testing.assert_close(pool[0], before[0], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_step_takes_the_kernels_only_when_on(device, monkeypatch):
    x, weight, pool, slots, fresh = case(torch.float32, device)
    calls = []
    from torch_cp.state import conv_kernel

    for name in ("conv_step_in_place", "conv_rows_in_place"):
        real = getattr(conv_kernel, name)
        monkeypatch.setattr(conv_kernel, name,
                            lambda *a, name=name, real=real: calls.append(name) or real(*a))
    qo = torch.arange(ROWS + 1, dtype=torch.int32)  # one token a row, as a multi-token step
    steps = [dict(qo_indptr=None, decode=True),
             dict(qo_indptr=qo.to(device), decode=False, qo_indptr_host=qo,
                  token_row=torch.arange(ROWS, device=device))]
    want = reference(x, weight, pool[1].clone(), slots, fresh)
    monkeypatch.setattr(kernels, "CONV_KERNELS", False)
    for step in steps:
        kernels.conv_step(x, weight, pool[1].clone(), slots, fresh, activation="silu",
                          kernels="fla", **step)
    assert not calls
    monkeypatch.setattr(kernels, "CONV_KERNELS", True)
    for step in steps:
        # As the model calls it: fresh rows as the plan's int64 flags (StepPlan.state_fresh).
        got = kernels.conv_step(x, weight, pool[1].clone(), slots, fresh.long(),
                                activation="silu", kernels="fla", **step)
        torch.testing.assert_close(got[:3], want[:3], atol=1e-6, rtol=1e-6)
    assert calls == ["conv_step_in_place", "conv_rows_in_place"]


ROW_LENGTHS = [7, 0, 37, 1, 2, 0]  # tokens of each row
ROW_SLOTS = [3, 0, 5, 6, 2, 4]
ROW_FRESH = [False, True, True, False, False, False]


def rows_case(dtype, device, width: int):
    """A multi-token step over ROW_LENGTHS, 3 tokens of padding past the rows, the input a
    strided view of a wider projection."""
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(SLOTS + 2, CHANNELS, width, generator=g)
    pool[0] = float("nan")  # the fresh rows' own slots: never read
    pool[5] = float("nan")
    pool[ZERO] = 0
    bounds = torch.tensor([0, *ROW_LENGTHS]).cumsum(0)
    tokens = int(bounds[-1]) + 3
    wide = torch.randn(tokens, CHANNELS + 24, generator=g)
    weight = torch.randn(CHANNELS, width + 1, generator=g) / 2
    token_row = torch.cat([torch.repeat_interleave(torch.arange(len(ROW_LENGTHS)),
                                                   torch.tensor(ROW_LENGTHS)),
                           torch.full((3,), -1)])
    return dict(x=wide[:, 8:8 + CHANNELS].to(device, dtype), weight=weight.to(device, dtype),
                pool=pool.to(device, dtype), slots=torch.tensor(ROW_SLOTS, device=device),
                fresh=torch.tensor(ROW_FRESH, device=device).long(),
                qo=bounds.to(torch.int32), token_row=token_row.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 3])  # conv kernel widths 2 and 4 (Qwen3.5's)
def test_multi_token_kernels_update_the_pool_in_place_like_the_reference(dtype, device, width):
    c = rows_case(dtype, device, width)
    want_pool = c["pool"].clone()
    want = kernels.conv_step(c["x"], c["weight"], want_pool, c["slots"], c["fresh"], c["qo"],
                             False, "silu")
    got_pool = c["pool"].clone()
    got = conv_rows_in_place(c["x"], c["weight"], got_pool, c["slots"], c["fresh"],
                             c["qo"].to(device), c["token_row"])
    torch.testing.assert_close(got, want, **TOLERANCE[dtype, device])
    assert not got[int(c["qo"][-1]):].any(), "tokens past the rows: zeros"
    torch.testing.assert_close(got_pool, want_pool, atol=0, rtol=0, equal_nan=True)
    assert not got_pool[ZERO].any()
