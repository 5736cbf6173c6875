"""``pair_sums.sum_pairs``: a token's k pair outputs summed in float32 and rounded once. Traced
(k - 1 adds, so that Inductor makes one pointwise kernel of it) bit for bit the float32 sum in
order, weights multiplied in float32; eagerly (one reduction, weights multiplied in the promoted
dtype as transformers does) within one rounding of the pairs' dtype of it."""

from __future__ import annotations

import pytest
import torch

from torch_cp.graphs.pair_sums import sum_pairs


def sequential(out_tkh, weights_tk=None):
    out = out_tkh.float() if weights_tk is None else out_tkh.float() * weights_tk.float()[..., None]
    total = out[:, 0]
    for j in range(1, out.shape[1]):
        total = total + out[:, j]
    return total


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_and_eager_sums_agree(weighted, dtype):
    g = torch.Generator().manual_seed(0)
    out = torch.randn(5, 8, 48, generator=g).to(dtype)
    weights = torch.rand(5, 8, generator=g).to(dtype) if weighted else None
    traced = torch.compile(sum_pairs, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    got_traced = traced(out, torch.bfloat16, weights)
    assert torch.equal(got_traced, sequential(out, weights).to(torch.bfloat16))
    # Eager: bf16 products round (2**-9 relative each, on sums of 8 terms of either sign: up to
    # 2**-6 of the largest term), then the float32 sum in torch's order, rounded to bf16.
    got_eager = sum_pairs(out, torch.bfloat16, weights)
    scale = (out.float() * (1 if weights is None else weights.float()[..., None])).abs().amax(1)
    assert ((got_eager.float() - sequential(out, weights)).abs() <= 2**-6 * scale).all()
    assert sum_pairs(out, torch.float32, weights).dtype == torch.float32
