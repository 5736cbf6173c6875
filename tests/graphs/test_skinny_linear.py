"""The skinny linear (graphs/skinny_linear.py) against ``F.linear`` in float64: x [T, K] of 1-64
rows against [N, K] weights, one reduction piece and split ones, with and without a bias, at
output sizes no tile divides. Without CUDA the kernels run in Triton's interpreter
(tests/conftest.py), in float32 (there bf16 tiles multiply as float32, as on the GPU they
accumulate).

Tolerances: fp32 inputs, atol 1e-4 on outputs of about 1 (sums of 128-256 products in
another order); bf16 inputs, each output within one bf16 ulp of its float64 product: the kernel
accumulates in float32 and casts once (to nearest on the GPU, within half an ulp; Triton's
interpreter casts by truncation, within one).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels are Triton (CPU: its interpreter)")
from torch_cp.graphs import skinny_linear as sl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(tokens: int, n_out: int, k_len: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k_len, generator=g) / k_len ** 0.5
    w = torch.randn(n_out, k_len, generator=g)
    b = torch.randn(n_out, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return cast(x), cast(w), cast(b)


@pytest.mark.parametrize("tiles", [sl.SkinnyTiles(rows=16, cols=64),
                                   sl.SkinnyTiles(rows=32, cols=64, split=2),
                                   sl.SkinnyTiles(rows=16, cols=128, split=4, warps=8)],
                         ids=["one_piece", "split2", "split4"])
@pytest.mark.parametrize("tokens,n_out,bias", [(1, 40, False), (5, 72, True), (33, 24, True)])
def test_matches_float64_linear(tiles, tokens, n_out, bias):
    x, w, b = _case(tokens, n_out, 512, torch.float32, bias)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = sl.linear(x, w, b, tiles=tiles)
    assert got.dtype == x.dtype and got.shape == (tokens, n_out)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


def test_bf16_within_one_ulp_and_leading_dims_kept():
    x, w, b = _case(12, 48, 256, torch.bfloat16, True, seed=1)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = sl.linear(x.view(3, 4, 256), w, b)
    assert got.shape == (3, 4, 48) and got.dtype == torch.bfloat16
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs())) - 7)
    excess = ((got.reshape(12, 48).double() - want).abs() / ulp).max().item()
    assert excess <= 1.0, excess


def test_no_tokens():
    x, w, _ = _case(1, 16, 64, torch.float32, False)
    assert sl.linear(x[:0], w).shape == (0, 16)


@pytest.mark.parametrize("tokens,n_out,k_len,want", [
    (32, 5120, 2048, sl.SkinnyTiles(rows=32, cols=128)),            # q/k/v: 160 programs
    (32, 2048, 4096, sl.SkinnyTiles(rows=16, cols=128)),            # o: 128 programs
    (1, 128, 2048, sl.SkinnyTiles(rows=16, cols=128, split=4)),     # a router: 8 x 16 rows
    (64, 151936, 2048, sl.SkinnyTiles(rows=64, cols=128)),          # an LM head
    (8, 96, 192, sl.SkinnyTiles(rows=16, cols=64)),                 # K too short to split
])
def test_pick_tiles(tokens, n_out, k_len, want):
    assert sl.pick_tiles(tokens, n_out, k_len, sms=132) == want


def test_fits_and_refusals():
    w = torch.empty(8, 128)
    assert not sl.fits(torch.empty(1, 128), w)  # CPU
    with pytest.raises(ValueError, match="rows 24 is not a power of two"):
        sl.SkinnyTiles(rows=24, cols=64)
    with pytest.raises(ValueError, match="split 0"):
        sl.SkinnyTiles(rows=16, cols=64, split=0)
    x, w, _ = _case(2, 16, 192, torch.float32, False)
    with pytest.raises(ValueError, match="not a multiple of cols x split"):
        sl.linear(x, w, tiles=sl.SkinnyTiles(rows=16, cols=64, split=2))
