"""``dense_own_mla``, the torch own-token partial the FlashInfer MLA backend runs where
FlashInfer cannot plan causal MLA exactly (head counts that do not divide its query tile, e.g.
GLM-4.7-Flash's 20): with the rows' host bounds (eager steps: each row's queries score only its
own tokens) and without (captured steps: every token, masked), against causal attention written
plainly per row in float64. fp32 chunks against float64: 1e-5 (reassociation of sums of ~20
products of magnitude ~1)."""

from __future__ import annotations

import math

import pytest
import torch

from torch_cp.attention.flashinfer_mla import dense_own_mla

LENGTHS = [3, 7, 1, 5]
PADDING = 2  # token padding after the rows, as in a mixed bucket
H, R, ROPE = 3, 8, 4


def reference(q, ckv, kpe, scale):
    """Per row, causal softmax attention in float64: out [N, H, R], lse base 2 (padding: 0,
    -inf)."""
    n = q.shape[0]
    out = torch.zeros(n, H, R, dtype=torch.float64)
    lse = torch.full((n, H), -math.inf, dtype=torch.float64)
    start = 0
    for length in LENGTHS:
        keys = torch.cat((ckv, kpe), -1)[start:start + length].double()
        for i in range(length):
            s = torch.einsum("hd,nd->hn", q[start + i].double(), keys[:i + 1]) * scale
            lse[start + i] = torch.logsumexp(s, -1) / math.log(2)
            out[start + i] = torch.softmax(s, -1) @ ckv[start:start + i + 1].double()
        start += length
    return out, lse


@pytest.mark.parametrize("max_elements", [1 << 26, 7], ids=["one-chunk", "many-chunks"])
def test_with_and_without_row_bounds_equal_plain_causal_attention(max_elements):
    torch.manual_seed(0)
    n = sum(LENGTHS) + PADDING
    q, ckv, kpe = torch.randn(n, H, R + ROPE), torch.randn(n, R), torch.randn(n, ROPE)
    q[-PADDING:], ckv[-PADDING:] = float("nan"), float("nan")  # padding never reaches a row
    rows = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    token_row = torch.cat([rows, torch.full((PADDING,), -1)])
    real = token_row >= 0
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    scale = (R + ROPE) ** -0.5
    want_out, want_lse = reference(q, ckv, kpe, scale)
    for given in (None, bounds):
        got = dense_own_mla(q, ckv, kpe, real, token_row, scale, max_elements, bounds=given)
        torch.testing.assert_close(got.out.double()[:-PADDING], want_out[:-PADDING], atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(got.lse.double(), want_lse, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.out[-PADDING:], torch.zeros(PADDING, H, R))
