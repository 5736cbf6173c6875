"""graphs/experts.py: before a capture, MoE experts that a CUDA graph cannot hold are switched to
an implementation it can (logged once), for every MoE family; experts with no implementation to
switch to are refused with the fix named. The switch must not change what the model computes:
logits against the same model with transformers' eager experts loop."""

from __future__ import annotations

import importlib.util
import logging

import mla_models
import pytest
import torch
from driver import tiny_model
from torch import nn

import torch_cp
from torch_cp.graphs.experts import (
    PREFERRED,
    available,
    avoid_unfit_grouped_mm,
    capturable,
    capturable_experts,
    experts_modules,
    experts_problems,
    grouped_mm_fits,
)


def moe_model(family: str):
    if family in ("glm4_moe_lite", "deepseek_v3"):
        return mla_models.tiny_model(mla_models.tiny_config(family))
    return tiny_model(family)


MOE_FAMILIES = ["qwen3_moe", "glm4_moe", "glm4_moe_lite", "deepseek_v3"]
IDS = torch.tensor([[5, 7, 9, 11, 13, 3, 1, 4, 1, 5, 9, 2, 6]])


def implementations(model) -> set[str]:
    return {e.config._experts_implementation for e in experts_modules(model)}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_an_uncapturable_loop_is_switched_and_computes_the_same(family, caplog):
    model = moe_model(family)
    model.set_experts_implementation("eager")
    assert experts_modules(model) and implementations(model) == {"eager"}
    with torch.no_grad():
        want = model(IDS).logits
    with caplog.at_level(logging.WARNING, logger="torch_cp"):
        assert capturable_experts(model) == "grouped_mm"
        assert capturable_experts(model) is None  # already capturable: no change, no message
    assert implementations(model) == {"grouped_mm"}
    switched = [r for r in caplog.records if "switched to" in r.getMessage()]
    assert len(switched) == 1 and "'eager'" in switched[0].getMessage()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_unpatch_puts_back_the_experts_a_capture_switched(family):
    model = moe_model(family)
    model.set_experts_implementation("eager")
    torch_cp.patch_model(model)
    assert capturable_experts(model) == "grouped_mm"
    torch_cp.unpatch_model(model)
    assert implementations(model) == {"eager"} and model.config._experts_implementation == "eager"


def test_experts_grouped_mm_cannot_take_are_switched_at_patch_and_back_at_unpatch(caplog):
    """6 float32 intermediate channels: rows of 24 bytes, which torch's grouped GEMM refuses. A
    TP shard can make them from a model that has none (helper 106; at tp = 2:
    test_patch_multirank's qwen3_moe TP case); here one process's model has them itself."""
    model = tiny_model("qwen3_moe", moe_intermediate_size=6)
    assert not grouped_mm_fits(experts_modules(model)[0])
    assert implementations(model) == {"grouped_mm"}
    with pytest.raises(RuntimeError, match="16 bytes"):  # what it did before the switch
        model(IDS)
    model.set_experts_implementation("eager")
    want = model.generate(IDS, max_new_tokens=4, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    model.set_experts_implementation("grouped_mm")
    with caplog.at_level(logging.WARNING, logger="torch_cp"):
        torch_cp.patch_model(model)
    assert implementations(model) == {"batched_mm"}
    (message,) = [r.getMessage() for r in caplog.records if "switched to" in r.getMessage()]
    assert "16 bytes" in message and "6 intermediate" in message
    got = model.generate(IDS, max_new_tokens=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5,
                               rtol=1e-5)
    torch_cp.unpatch_model(model)
    assert implementations(model) == {"grouped_mm"}
    fitting = tiny_model("qwen3_moe")
    assert grouped_mm_fits(experts_modules(fitting)[0])
    assert avoid_unfit_grouped_mm(fitting, None) is None
    assert implementations(fitting) == {"grouped_mm"}


def test_a_capturable_choice_is_kept():
    model = moe_model("qwen3_moe")
    model.set_experts_implementation("batched_mm")
    assert capturable_experts(model) is None
    assert implementations(model) == {"batched_mm"}


def test_models_without_experts_are_left_alone():
    model = tiny_model("qwen3")
    assert experts_modules(model) == [] and capturable_experts(model) is None


def test_experts_with_their_own_loop_are_refused_with_the_fix():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4)])

    model = nn.Sequential(Block())
    problems = experts_problems(model)
    assert len(problems) == 1 and "ModuleList" in problems[0]
    assert "cuda_graphs=False" in problems[0]
    with pytest.raises(ValueError, match="cuda_graphs=False"):
        capturable_experts(model)


@pytest.mark.parametrize("name,dtype,want", [
    ("eager", torch.bfloat16, False),
    ("grouped_mm", torch.float32, True),       # on the CPU: no host loop, nothing captured
    ("batched_mm", torch.float16, True),
    ("deepgemm", torch.bfloat16, False),       # not known to capture: switched away from
    (None, torch.bfloat16, False),
])
def test_which_implementations_a_graph_can_hold(name, dtype, want):
    assert capturable(name, dtype, torch.device("cpu")) is want


@pytest.mark.parametrize("dtype,want", [(torch.bfloat16, True), (torch.float32, False),
                                        (torch.float16, False)])
def test_on_cuda_grouped_mm_is_captured_in_bf16_only(dtype, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert capturable("grouped_mm", dtype, torch.device("cuda", 0)) is want
    assert capturable("batched_mm", dtype, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert capturable("grouped_mm", torch.bfloat16, torch.device("cuda", 0)) is False


def test_fused_kernels_are_preferred_where_cuda_and_triton_are():
    assert PREFERRED == ("torch_cp_fused", "grouped_mm", "batched_mm")
    assert not available("torch_cp_fused", torch.device("cpu")), "nothing captured on the CPU"
    has_triton = importlib.util.find_spec("triton") is not None
    assert available("torch_cp_fused", torch.device("cuda", 0)) is has_triton
    assert available("grouped_mm", torch.device("cpu"))
