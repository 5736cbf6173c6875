"""``pair_sums.sum_pairs``: a token's k pair outputs summed in float32 and rounded once.

- Traced (as compiled layers run it): k - 1 adds in order of float32 terms (weights multiplied
  in float32), bit for bit, so that Inductor makes one pointwise kernel of it; its graph holds
  no reduction.
- Eagerly: one reduction in float32 over the pairs times the weights in the dtype torch promotes
  them to (transformers' product), bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from torch_cp.graphs.pair_sums import sum_pairs


def in_order(out_tkh, weights_tk=None):
    out = out_tkh.float() if weights_tk is None else out_tkh.float() * weights_tk.float()[..., None]
    total = out[:, 0]
    for j in range(1, out.shape[1]):
        total = total + out[:, j]
    return total


def inputs(dtype, weighted):
    g = torch.Generator().manual_seed(0)
    out = torch.randn(5, 8, 48, generator=g).to(dtype)
    return out, (torch.rand(5, 8, generator=g).to(dtype) if weighted else None)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_sum_is_the_adds_in_order(weighted, dtype):
    out, weights = inputs(dtype, weighted)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    traced = torch.compile(sum_pairs, backend=backend, fullgraph=True)
    assert torch.equal(traced(out, torch.float32, weights), in_order(out, weights))
    assert torch.equal(traced(out, torch.bfloat16, weights),
                       in_order(out, weights).to(torch.bfloat16))
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    assert not any("sum" in op for op in ops), ops


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_sum_is_one_reduction_of_transformers_products(weighted, dtype):
    out, weights = inputs(dtype, weighted)
    terms = out if weights is None else out * weights[..., None]
    for result_dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(sum_pairs(out, result_dtype, weights),
                           terms.sum(dim=1, dtype=torch.float32).to(result_dtype))
