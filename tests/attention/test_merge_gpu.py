"""FlashInfer's merge_states as the partner merge, and its merge_state as the merge of a step's
context and own-token partials: equal to the torch merge within bf16 rounding, empty partials
weigh nothing, rows with no keys at all give out 0 and lse -inf (no NaN)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from torch_cp.attention.merge import flashinfer_merge, flashinfer_merge_two
from torch_cp.attention.partial import Partial, merge_partials, merge_two

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs FlashInfer"),
]


@pytest.mark.parametrize("partners,heads,dim", [(2, 32, 128), (4, 64, 128), (2, 32, 512),
                                                (4, 16, 512)])
@pytest.mark.parametrize("n", [1, 2, 37])  # FlashInfer picks another kernel when n <= partners
def test_merge_states_equals_the_torch_merge(partners, heads, dim, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    keyless = min(3, n - 1)  # rows with no keys on any partner
    out = torch.randn(partners, n, heads, dim, device="cuda", generator=g).bfloat16()
    lse = torch.randn(partners, n, heads, device="cuda", generator=g) * 8
    empty = torch.rand(partners, n, heads, device="cuda", generator=g) < 0.3
    empty[:, :keyless] = True  # e.g. padding rows
    lse = lse.masked_fill(empty, float("-inf"))
    out = out.masked_fill(empty[..., None], 0)
    want = merge_partials(out, lse)
    got = flashinfer_merge(out, lse)
    assert torch.isfinite(got.out).all()
    assert torch.equal(got.out[:keyless], torch.zeros_like(got.out[:keyless]))
    assert torch.isneginf(got.lse[:keyless]).all() and torch.isneginf(want.lse[:keyless]).all()
    # Both merge in float32 and round the output to bf16 once: at most an ulp apart (2^-7
    # relative on outputs of O(1)); the float32 LSEs agree to float32 rounding of O(10) values.
    torch.testing.assert_close(got.out.float(), want.out.float(), atol=2e-2, rtol=2 ** -7)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-4, rtol=1e-5)


# Heads past the kernel's launch limit (64 at D = 128, 32 at D = 512) run as blocks of fewer.
@pytest.mark.parametrize("heads,dim", [(32, 128), (128, 128), (40, 128), (16, 512), (128, 512)])
def test_merge_state_equals_the_torch_merge_of_two(heads, dim):
    g = torch.Generator(device="cuda").manual_seed(1)
    n, keyless = 300, 5

    def partial(empty_fraction: float) -> Partial:
        out = torch.randn(n, heads, dim, device="cuda", generator=g).bfloat16()
        lse = torch.randn(n, heads, device="cuda", generator=g) * 8
        empty = torch.rand(n, heads, device="cuda", generator=g) < empty_fraction
        empty[:keyless] = True
        return Partial(out.masked_fill(empty[..., None], 0), lse.masked_fill(empty, float("-inf")))

    context, own = partial(0.3), partial(0.1)  # e.g. rows with no context yet
    want = merge_two(context, own)
    got = flashinfer_merge_two(context, own)
    assert got.out.shape == (n, heads, dim) and got.out.dtype == torch.bfloat16
    assert torch.isfinite(got.out).all()
    assert torch.equal(got.out[:keyless], torch.zeros_like(got.out[:keyless]))
    assert torch.isneginf(got.lse[:keyless]).all()
    # As above: one bf16 rounding of a float32 merge on both sides.
    torch.testing.assert_close(got.out.float(), want.out.float(), atol=2e-2, rtol=2 ** -7)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-4, rtol=1e-5)
