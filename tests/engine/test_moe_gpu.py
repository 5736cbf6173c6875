"""Every MoE family on one GPU with CUDA graphs and compiled layers (the fastest engine) gives the
reference backend's greedy tokens, starting from transformers' experts loop, which no graph can
hold: the engine switches the experts before its capture and says so once.

In bf16 the reference runs the experts implementation the engine switches to (uncaptured,
torch attention), so a split measures torch_cp's step (attention, graphs, compile), not another
experts kernel's bf16 rounding amplified by these tiny random models; each implementation's own
exactness is measured apart (tests/graphs/test_fused_experts.py, benchmarks/experts.py). In fp32,
where rounding cannot move a token, the reference runs transformers' experts loop: the switched
experts end to end against the loop."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from gpu_models import (
    MOE_MODELS,
    NEW_TOKENS,
    assert_equal_but_near_ties,
    dependent_launch_kernels,
    prompts,
    spy_dependent_launches,
    tokens,
)

import torch_cp
from torch_cp import pdl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="needs FlashInfer"),
]


@pytest.mark.parametrize("backend,dtype,implementation,reference_experts", [
    ("flashinfer", torch.bfloat16, "torch_cp_fused", "torch_cp_fused"),
    # prefill: batched_mm (grouped_mm copies from the host in fp32)
    ("torch", torch.float32, "torch_cp_fused", "eager"),
])
@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_moe_captured_and_compiled_gives_the_reference_tokens(name, backend, dtype,
                                                              implementation, reference_experts,
                                                              caplog):
    build = MOE_MODELS[name]
    reference = torch_cp.patch_model(build(dtype).cuda(), backend="torch")
    reference.set_experts_implementation(reference_experts)
    expected = tokens(torch_cp.generate(reference, prompts(), NEW_TOKENS, progress=False))
    model = torch_cp.patch_model(build(dtype).cuda(), backend=backend)
    model.set_experts_implementation("eager")  # the loop a capture fails on
    with caplog.at_level(logging.WARNING, logger="torch_cp"):
        engine = torch_cp.Engine(model, num_pages=64, page_size=16, cuda_graphs=True,
                                 compile=True, overlap_planning=True, max_pages_per_row=8)
        got = tokens(engine.run(prompts(), NEW_TOKENS))
        again = torch_cp.Engine(model, num_pages=64, page_size=16, cuda_graphs=True,
                                max_pages_per_row=8)
        plain = tokens(again.run(prompts(), NEW_TOKENS))
    assert model.config.get_text_config()._experts_implementation == implementation
    assert sum("switched to" in r.getMessage() for r in caplog.records) == 1
    assert engine.replayed_steps >= NEW_TOKENS - 2 and again.replayed_steps >= NEW_TOKENS - 2
    unpatched = build(dtype).cuda()
    unpatched.set_experts_implementation(reference_experts)
    assert_equal_but_near_ties(unpatched, expected, got)
    assert_equal_but_near_ties(unpatched, expected, plain)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe_lite"])
def test_dependent_launches_give_the_tokens_without_them(name, rows, monkeypatch):
    """``torch_cp.pdl`` on (sm90): in the captured steps the router and the fused experts start
    as dependent launches, with the one-token linears (one row), the Triton decode (one row) and
    the pool write of the GQA model, and Inductor's kernels in the compiled layers; bf16 tokens
    equal the same engine's without, up to near-ties (the same kernels, so in practice equal)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the dependent launch needs sm90")
    build = MOE_MODELS[name]
    model = torch_cp.patch_model(build(torch.bfloat16).cuda(), backend="flashinfer")
    model.set_experts_implementation("torch_cp_fused")
    kwargs = dict(num_pages=64, page_size=16, cuda_graphs=True, compile=True,
                  overlap_planning=True, max_pages_per_row=8)
    batch = prompts()[:rows]
    monkeypatch.setattr(pdl, "ENABLED", False)  # whatever the default
    without = tokens(torch_cp.Engine(model, **kwargs).run(batch, NEW_TOKENS))
    seen = spy_dependent_launches(monkeypatch)
    torch._dynamo.reset()  # Inductor's kernels generated again, for the dependent launch
    engine = torch_cp.Engine(model, **kwargs)
    got = tokens(engine.run(batch, NEW_TOKENS))
    assert engine.replayed_steps >= NEW_TOKENS - 2
    expected = dependent_launch_kernels(rows, gqa=name == "qwen3_moe", moe=True)
    assert True in seen["inductor"] and expected <= seen["kernels"], seen
    assert_equal_but_near_ties(build(torch.bfloat16).cuda(), without, got)
