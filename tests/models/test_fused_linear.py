"""torch_cp/fused_linear.py: linears that read one input run as one GEMM over weights that share
one storage.

- ``FusedLinear`` gives each linear's output (fp32, atol 1e-6: one GEMM over the concatenated
  rows sums each output over the same inputs, in the order the GEMM picks); linears it cannot
  fuse (a subclass, a hook, another dtype, a bias on some only) run one by one, untouched.
- ``patch_model`` fuses every family's input projections and gated MLPs, and the model's
  outputs stay the unpatched model's (the model tests); ``from_pretrained`` reads the fused
  linears straight into their shared storage, so patching copies nothing.
"""

from __future__ import annotations

import mla_models
import pytest
import torch
from driver import tiny_model
from torch import nn

import torch_cp
from torch_cp import fused_linear
from torch_cp.fused_linear import (
    FusedLinear,
    fusable,
    fuse_in_projections,
    fusion_groups,
    gated_mlps,
)


def linears(bias: bool, sizes=(24, 8, 8), seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(16, n, bias=bias) for n in sizes]


@pytest.mark.parametrize("bias", [False, True])
def test_one_gemm_gives_each_linears_output(bias):
    mods = linears(bias)
    x = torch.randn(5, 16)
    want = [m(x) for m in mods]
    fused = FusedLinear(mods)
    assert fused.fused
    got = fused(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    assert all(m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
               for m in mods)
    for m, w in zip(mods, want, strict=True):  # the linears still work, over the views
        torch.testing.assert_close(m(x), w, atol=0, rtol=0)


class Scaled(nn.Linear):
    pass


def unfusable_cases():
    hooked = linears(False)
    hooked[1].register_forward_hook(lambda m, i, o: o * 2)
    mixed_dtype = linears(False)
    mixed_dtype[2].to(torch.float64)
    mixed_bias = linears(False)
    mixed_bias[0] = nn.Linear(16, 24, bias=True)
    subclass = linears(False)
    subclass[1] = Scaled(16, 8)
    return {"hook": hooked, "dtype": mixed_dtype, "bias": mixed_bias, "subclass": subclass,
            "one": linears(False)[:1]}


def test_out_of_memory_joining_the_biases_leaves_the_linears_as_they_were(monkeypatch):
    """The weights were re-pointed into their fused copy before the biases' concatenation ran
    out of memory: the linears were left sharing a storage, with no fused module to undo."""
    mods = linears(bias=True)
    before = [(m.weight, m.bias) for m in mods]
    joined = fused_linear._joined

    def failing(group, name):
        if name == "bias":
            raise torch.OutOfMemoryError("CUDA out of memory (in this test)")
        return joined(group, name)
    monkeypatch.setattr(fused_linear, "_joined", failing)
    with pytest.raises(torch.OutOfMemoryError):
        FusedLinear(mods)
    assert all(m.weight is w and m.bias is b for m, (w, b) in zip(mods, before))  # untouched
    assert len({m.weight.untyped_storage().data_ptr() for m in mods}) == len(mods)


@pytest.mark.parametrize("case", list(unfusable_cases()))
def test_linears_that_cannot_share_a_weight_run_one_by_one(case):
    mods = unfusable_cases()[case]
    assert not fusable(mods)
    ptrs = [m.weight.data_ptr() for m in mods]
    fused = FusedLinear(mods)
    assert not fused.fused and [m.weight.data_ptr() for m in mods] == ptrs
    assert fused.linears == mods
    if case == "dtype":  # no one input feeds both dtypes; the linears run as they are
        return
    x = torch.randn(3, 16)
    want = [m(x) for m in mods]
    for g, w in zip(fused(x), want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("model_type,groups", [
    ("qwen3", {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")}),
    ("deepseek_v3", {("q_a_proj", "kv_a_proj_with_mqa"), ("q_proj", "kv_a_proj_with_mqa"),
                     ("gate_proj", "up_proj")}),
    ("qwen3_5_text", {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                      ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}),
    ("qwen3_next", {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                    ("in_proj_qkvz", "in_proj_ba")}),
    ("glm4", {("q_proj", "k_proj", "v_proj")}),  # its MLP has gate_up_proj already
])
def test_every_familys_projections_and_gated_mlps_are_found(model_type, groups):
    if model_type == "deepseek_v3":
        model = mla_models.tiny_model(mla_models.tiny_config("deepseek_v3"))
    else:
        model = tiny_model(model_type)
    names = {m: n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    found = {tuple(names[m] for m in g) for g in fusion_groups(model)}
    assert found <= groups and found & groups, found
    if model_type != "glm4":
        assert gated_mlps(model)


def test_a_gated_mlp_fused_equals_its_own_forward():
    model = tiny_model("qwen3")
    mlp = model.model.layers[0].mlp
    x = torch.randn(4, model.config.hidden_size)
    want = mlp(x)
    torch_cp.patch_model(model)
    assert "cp_gate_up" in mlp._modules and mlp.cp_gate_up.fused
    torch.testing.assert_close(mlp(x), want, atol=1e-6, rtol=1e-6)


def test_no_projections_no_fusion():
    assert fuse_in_projections(nn.Linear(4, 4)) is None


def test_from_pretrained_reads_fused_linears_into_one_storage_and_patching_copies_nothing(
        tmp_path, monkeypatch):
    tiny_model("qwen3").save_pretrained(tmp_path, safe_serialization=True)
    found = []
    consecutive = fused_linear._consecutive
    monkeypatch.setattr(fused_linear, "_consecutive",
                        lambda parts: found.append(consecutive(parts)) or found[-1])
    model = torch_cp.from_pretrained(tmp_path)
    assert found and all(t is not None for t in found), "each group already in one storage"
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for fused, mods in ((attn.cp_in, (attn.q_proj, attn.k_proj, attn.v_proj)),
                        (mlp.cp_gate_up, (mlp.gate_proj, mlp.up_proj))):
        assert fused.fused
        base = fused.weight.untyped_storage().data_ptr()
        assert all(m.weight.untyped_storage().data_ptr() == base for m in mods)


def test_cast_after_patching_the_linears_still_share_the_fused_weight():
    """``model.to`` after patching converts each part apart; the linears become views of the
    converted fused weight again, so weights copied in later still reach the GEMM."""
    model = tiny_model("qwen3")
    torch_cp.patch_model(model)
    model.to(torch.float64)
    attn = model.model.layers[0].self_attn
    assert attn.cp_in.weight.dtype == attn.q_proj.weight.dtype == torch.float64
    assert attn.q_proj.weight.untyped_storage().data_ptr() == \
        attn.cp_in.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.zero_()
    x = torch.randn(2, model.config.hidden_size, dtype=torch.float64)
    assert torch.equal(attn.cp_in(x)[1], torch.zeros(2, attn.k_proj.out_features,
                                                     dtype=torch.float64))


def test_a_model_cast_after_patching_is_refused_before_any_pool(tmp_path):
    """Helper 61: the pools and the attention backend keep the dtype patching saw (a bf16 model
    got float32 pools, twice the bytes); the engine, generate and new_cache say so instead."""
    model = torch_cp.patch_model(tiny_model("qwen3")).to(torch.bfloat16)
    refused = "the model was cast to torch.bfloat16 after torch_cp.patch_model"
    with pytest.raises(ValueError, match=refused):
        torch_cp.Engine(model, num_pages=8)
    with pytest.raises(ValueError, match=refused):
        torch_cp.generate(model, [[1, 2, 3]], 2, progress=False)
    with pytest.raises(ValueError, match=refused):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)


def test_weights_assigned_after_patching_reach_the_fused_gemms():
    """``load_state_dict(assign=True)`` replaces the linears' parameters: the fused q/k/v and
    gate/up are made from the new ones (they kept running the old weights, helper 61)."""
    want = tiny_model("qwen3")
    model = torch_cp.patch_model(tiny_model("qwen3", seed=1))
    model.load_state_dict(want.state_dict(), assign=True)
    prompt = [[5, 7, 9, 11, 13, 100, 3]]
    with torch.no_grad():
        ref = want.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False)[0, 7:]
    got = torch_cp.generate(model, prompt, 8, progress=False)[0].token_ids
    assert list(got) == ref.tolist()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.data_ptr() == attn.cp_in.weight.data_ptr()
    assert torch.equal(mlp.cp_gate_up.weight[mlp.gate_proj.out_features:], mlp.up_proj.weight)
    # Assigned into one linear, or set by hand: no hook of the fused module runs; the engine
    # fuses them again when it starts (helper 62).
    new_q = torch.randn_like(attn.q_proj.weight)
    attn.q_proj.load_state_dict({"weight": new_q}, assign=True)
    mlp.up_proj.weight = nn.Parameter(torch.randn_like(mlp.up_proj.weight))
    for module, name in ((want.model.layers[0].self_attn.q_proj, new_q),
                         (want.model.layers[0].mlp.up_proj, mlp.up_proj.weight)):
        module.weight = nn.Parameter(name.detach().clone())
    with torch.no_grad():
        ref = want.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False)[0, 7:]
    assert list(torch_cp.generate(model, prompt, 8, progress=False)[0].token_ids) == ref.tolist()


def test_fused_parameters_keep_their_attributes():
    mods = linears(False)
    mods[1].weight.tp_shard = "record"
    FusedLinear(mods)
    assert mods[1].weight.tp_shard == "record" and not hasattr(mods[0].weight, "tp_shard")


@pytest.mark.parametrize("call", ["generate after a weight was replaced", "unpatch_model"])
def test_weights_fused_or_unfused_under_inference_mode_stay_writable(call):
    """``generate`` (re-fusing a replaced weight) or ``unpatch_model`` (unfusing) called under
    ``torch.inference_mode`` left inference-tensor parameters, which a later
    ``load_state_dict`` refused (helper 97). Now none is one, and the load works."""
    from torch_cp.tiny import tiny_qwen3

    model = torch_cp.patch_model(tiny_qwen3())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        if call == "unpatch_model":
            torch_cp.unpatch_model(model)
        else:
            attn.q_proj.weight = nn.Parameter(attn.q_proj.weight.detach().clone())
            torch_cp.generate(model, [[1, 2, 3]], 2, progress=False)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert not [n for n, t in tensors.items() if t.is_inference()]
    model.load_state_dict(saved)
