"""``benchmarks.floor``'s step of linears alone: the torch_cp kernels it times compute the chain
it describes (checked against the same chain in plain torch), and the bytes it counts against
the copy bandwidth are those of the weights the step reads (against the model's own
parameters)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from benchmarks import models
from benchmarks.floor import Chain, Shape, reference_experts


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
@torch.inference_mode()
def test_the_kernels_compute_the_chain_plain_torch_computes(name):
    # float32, so the only difference is the order of the sums (the benchmark's bf16 would add
    # each linear's rounding, carried through the layers)
    chain = Chain(Shape.of(models.config_for(name, smoke=True)), torch.device("cpu"),
                  torch.float32)
    want = chain.step(linear=F.linear, experts=reference_experts)
    got = chain.step()  # Triton's interpreter on the CPU (tests/conftest.py)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.05 and got.shape == (1, chain.shape.vocab)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_the_bytes_counted_are_those_a_step_of_the_model_reads(name):
    shape = Shape.of(models.config_for(name, smoke=True))
    chain = Chain(shape, torch.device("cpu"))
    held = sum(t.numel() * t.element_size() for layer in chain.layers for t in
               (v for v in layer.values() if isinstance(v, torch.Tensor)))
    held += sum(t.numel() * t.element_size() for layer in chain.layers if "experts" in layer
                for t in vars(layer["experts"]).values())
    assert shape.bytes_read() == held + chain.lm_head.numel() * chain.lm_head.element_size()
    # ... and the model's: its weights less the embedding table and the norms, of the experts
    # only top_k a layer (one token's).
    model = models.build(name, torch.device("cpu"), torch.bfloat16, smoke=True)
    experts = models.experts_of(model)
    norms = sum(p.numel() * 2 for n, p in model.named_parameters() if "norm" in n)
    routed = shape.top_k * shape.layers * models.expert_bytes(experts[0]) if experts else 0
    assert shape.bytes_read() == models.weight_bytes_read(model, routed_bytes=routed) - norms
