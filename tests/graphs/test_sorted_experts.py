"""``sorted_experts`` (graphs/sorted_experts.py), the prefill-sized MoE path: transformers'
grouped GEMMs with torch_cp's sum of a token's pairs.

- Eagerly it is transformers' ``grouped_mm`` experts bit for bit, for every MoE family, fp32 and
  bf16, no tokens too (the same sort, GEMMs and gate; the weights multiplied in the promoted
  dtype and the pairs summed in float32 as transformers does, the gather moved before the
  product).
- Dynamo traces it whole (compiled layers use fullgraph) and runs the same computation.
- Experts whose class has a gate of its own are not taken (``fits``).
"""

from __future__ import annotations

import pytest
import torch
from gpu_models import MOE_MODELS
from transformers.integrations import moe

from torch_cp.graphs.experts import experts_modules

pytest.importorskip("triton", reason="registered beside the Triton kernels")
from torch_cp.graphs import fused_experts as fe  # noqa: E402
from torch_cp.graphs import sorted_experts as se  # noqa: E402


def routed(experts, tokens: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=g)
    ids = torch.randint(0, experts.down_proj.shape[0], (tokens, 2), generator=g)
    return x.to(dtype), ids, torch.rand(tokens, 2, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MOE_MODELS))
@pytest.mark.parametrize("tokens", [40, 0])
def test_eagerly_transformers_grouped_mm_bit_for_bit(name, dtype, tokens):
    experts = experts_modules(MOE_MODELS[name](dtype))[0]
    assert fe.fits(experts)
    args = routed(experts, tokens, dtype)
    assert torch.equal(se.sorted_experts(experts, *args),
                       moe.grouped_mm_experts_forward(experts, *args))


def test_traced_whole():
    experts = experts_modules(MOE_MODELS["qwen3_moe"](torch.float32))[0]
    args = routed(experts, 40, torch.float32)
    torch._dynamo.reset()
    traced = torch.compile(se.sorted_experts, fullgraph=True, backend="eager")
    # Traced, the pairs are summed in order in float32 (pair_sums): within float32 rounding.
    torch.testing.assert_close(traced(experts, *args), se.sorted_experts(experts, *args),
                               atol=1e-5, rtol=1e-5)


def test_a_class_with_its_own_gate_is_not_taken():
    experts = experts_modules(MOE_MODELS["qwen3_moe"](torch.float32))[0]

    class OwnGate(type(experts)):
        def _apply_gate(self, gate_up_out):
            return gate_up_out[..., : gate_up_out.shape[-1] // 2]

    experts.__class__ = OwnGate
    assert not fe.fits(experts)
