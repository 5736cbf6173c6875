"""The EMPTY_LSE convention of FlashInfer's merges (attention/merge.py), on the CPU.

``_kernel_lse`` and ``_empty_as_inf`` are plain torch around the kernels; only the GPU tests run
the kernels. Here the kernels' merge is re-implemented from its definition (FlashInfer's
merge_state / merge_states: ``m = max_s lse_s``, ``w_s = exp2(lse_s - m)``,
``out = sum_s w_s v_s / sum_s w_s``, ``lse = m + log2(sum_s w_s)``) and fed what the helpers make
of the LSEs: an empty partial (lse -inf) must weigh exactly 0, a row whose partials are all
empty must merge to out 0, lse -inf with no NaN, and the result must equal ``merge_partials``.
"""

from __future__ import annotations

import pytest
import torch

from torch_cp.attention.merge import EMPTY_LSE, _empty_as_inf, _kernel_lse
from torch_cp.attention.partial import merge_partials

INF = float("inf")


def kernel_merge(v_snhd: torch.Tensor, s_snh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's merge of S states written from its definition, in float32, on whatever
    LSEs it is given (no special case for -inf: the kernels have none)."""
    m = s_snh.amax(0)
    w = torch.exp2(s_snh - m)
    total = w.sum(0)
    out = (w.unsqueeze(-1) * v_snhd.float()).sum(0) / total.unsqueeze(-1)
    return out, m + torch.log2(total)


def flashinfer_way(out_snhd, lse_snh):
    """What ``merge_states`` does around the kernel: LSEs through ``_kernel_lse``, the merged
    LSE through ``_empty_as_inf``; out rounded to the partials' dtype as the kernel writes it."""
    out, lse = kernel_merge(out_snhd, _kernel_lse(lse_snh))
    return out.to(out_snhd.dtype), _empty_as_inf(lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_lse_maps_no_keys_to_empty_lse_and_keeps_the_rest(dtype):
    lse = torch.tensor([[-INF, 0.0, 3.5], [-120.0, -INF, 47.25]], dtype=dtype)
    got = _kernel_lse(lse)
    assert got.dtype == torch.float32 and got.shape == lse.shape
    empty = torch.isneginf(lse)
    assert torch.isfinite(got).all(), "no -inf reaches the kernel"
    assert (got[empty] == EMPTY_LSE).all()
    assert torch.equal(got[~empty], lse[~empty].float()), "finite values unchanged"


def test_empty_lse_weighs_zero_beside_any_real_lse_in_float32():
    real = torch.tensor([-1e4, -300.0, -1.0, 0.0, 1.0, 300.0, 1e4])
    assert (torch.exp2(torch.tensor(EMPTY_LSE) - real) == 0).all()
    assert (real > EMPTY_LSE / 2).all(), "_empty_as_inf keeps every real lse"


def test_empty_as_inf_undoes_kernel_lse_exactly_where_every_partial_was_empty():
    """A merged lse of EMPTY_LSE (plus at most log2(S) the kernel adds) is -inf again; real
    lses, however negative, come back unchanged."""
    merged = torch.tensor([EMPTY_LSE, EMPTY_LSE + 3.0, -1e4, -2.5, 0.0, 88.0])
    got = _empty_as_inf(merged)
    assert torch.isneginf(got[:2]).all()
    assert torch.equal(got[2:], merged[2:])
    lse = torch.tensor([-INF, -7.0, 0.0, 12.5])
    assert torch.equal(_empty_as_inf(_kernel_lse(lse)), lse), "round trip"


@pytest.mark.parametrize("partials", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_merge_the_flashinfer_way_equals_merge_partials(partials, dtype):
    """Random partials, some empty, and rows where every partial is empty (e.g. padding rows):
    the kernel's math on the helpers' LSEs gives 0 weight to empty partials, no NaN, out 0 and
    lse -inf where no partial had keys, and otherwise ``merge_partials``' result."""
    g = torch.Generator().manual_seed(partials)
    n, heads, dim, keyless = 9, 3, 8, 2
    out = torch.randn(partials, n, heads, dim, generator=g).to(dtype)
    lse = torch.randn(partials, n, heads, generator=g) * 8
    empty = torch.rand(partials, n, heads, generator=g) < 0.4
    empty[:, :keyless] = True
    empty[0, keyless:, 0] = False  # some row of each head has keys
    lse = lse.masked_fill(empty, -INF)
    out = out.masked_fill(empty[..., None], 0)

    got_out, got_lse = flashinfer_way(out, lse)
    want = merge_partials(out, lse)
    assert not torch.isnan(got_out).any() and not torch.isnan(got_lse).any()
    assert torch.equal(got_out[:keyless], torch.zeros_like(got_out[:keyless]))
    assert torch.isneginf(got_lse[:keyless]).all()
    assert torch.equal(torch.isneginf(got_lse), empty.all(0))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(got_out.float(), want.out.float(), **tol)
    torch.testing.assert_close(got_lse, want.lse, rtol=1e-5, atol=1e-5)


def test_empty_partials_weigh_exactly_nothing():
    """Adding empty partials (out filled with garbage, as a kernel may leave it) to a real one
    changes neither its out nor its lse, bit for bit."""
    g = torch.Generator().manual_seed(7)
    real_out, real_lse = torch.randn(1, 5, 2, 4, generator=g), torch.randn(1, 5, 2, generator=g)
    garbage = torch.full((3, 5, 2, 4), 1e6)
    out = torch.cat((garbage[:1], real_out, garbage[1:]))
    lse = torch.cat((torch.full((1, 5, 2), -INF), real_lse, torch.full((2, 5, 2), -INF)))
    got_out, got_lse = flashinfer_way(out, lse)
    assert torch.equal(got_out, real_out[0])
    assert torch.equal(got_lse, real_lse[0])


def test_without_the_clamp_the_kernel_math_is_nan_where_every_partial_is_empty():
    """Why the clamp exists: the kernel's max of all -inf is -inf, and -inf - -inf is NaN."""
    out, lse = torch.zeros(2, 1, 1, 4), torch.full((2, 1, 1), -INF)
    raw_out, raw_lse = kernel_merge(out, lse)
    assert torch.isnan(raw_out).all() and torch.isnan(raw_lse).all()
    got_out, got_lse = flashinfer_way(out, lse)
    assert torch.equal(got_out, torch.zeros(1, 1, 4)) and torch.isneginf(got_lse).all()
