"""Invariant 6: every patch_model check fails before anything is allocated or modified, with a
ValueError that names every problem found.

Mesh checks use shape-only DeviceMeshes (no process groups behind them) over a one-rank gloo
world: validation reads only their axis names, sizes and device type.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from driver import shape_mesh, tiny_model
from torch.distributed.device_mesh import DeviceMesh

import torch_cp
from torch_cp import models
from torch_cp.hf.validate import validate_patch
from torch_cp.mesh import AXES

pytestmark = pytest.mark.usefixtures("one_rank_world", "shape_meshes_are_the_world")


def mesh(sp: int, tp: int, names=AXES, device: str = "cpu") -> DeviceMesh:
    return shape_mesh(sp, tp, names, device)


def problems_of(model, **kwargs) -> str:
    """patch_model's ValueError for ``kwargs`` over its defaults (mode="auto")."""
    with pytest.raises(ValueError) as info:
        torch_cp.patch_model(model, **kwargs)
    return str(info.value)


def test_unsupported_model_type_lists_the_supported_ones():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4)
    message = problems_of(transformers.AutoModelForCausalLM.from_config(config))
    assert "'llama' is not supported" in message
    assert all(t in message for t in models.SUPPORTED_MODEL_TYPES)


def test_family_module_that_does_not_import(monkeypatch):
    monkeypatch.setitem(models.FAMILY_MODULES, "qwen3", "torch_cp.models.no_such_family")
    assert "torch_cp.models.no_such_family is not available" in problems_of(tiny_model("qwen3"))


def test_mla_types_map_to_the_mla_module():
    for model_type in ("glm4_moe_lite", "deepseek_v3"):
        assert models.FAMILY_MODULES[model_type] == "torch_cp.models.mla"


def test_already_patched():
    model = torch_cp.patch_model(tiny_model("qwen3"))
    assert "already patched" in problems_of(model)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(mode="dp"), "mode must be one of auto, tp, sp, got 'dp'"),
    (dict(backend="triton"), "backend must be one of auto, torch, flashinfer, got 'triton'"),
    (dict(backend="flashinfer"), "backend 'flashinfer': device cpu is not a CUDA device"),
    (dict(page_size=0), "page_size must be a positive int, got 0"),
    (dict(page_size="16"), "page_size must be a positive int, got '16'"),
    (dict(mesh="tp=2"), "mesh must be a DeviceMesh"),
    (dict(context_parallel=True), "context_parallel=True needs a mesh"),
], ids=["mode", "backend", "flashinfer-on-cpu", "page-size-0", "page-size-str", "mesh-type",
        "cp-without-mesh"])
def test_argument_problems(kwargs, expected):
    assert expected in problems_of(tiny_model("qwen3"), **kwargs)


def test_unsupported_dtype():
    assert "the model has torch.float64" in problems_of(tiny_model("qwen2").double())


def test_mesh_axis_names_and_device():
    assert "mesh axes must be named ('sp', 'tp')" in problems_of(
        tiny_model("qwen3"), mesh=mesh(1, 2, names=("dp", "tp")))
    assert "the mesh is on cuda but the model is on cpu" in problems_of(
        tiny_model("qwen3"), mesh=mesh(1, 2, device="cuda"))


def test_tp_must_split_the_heads():
    message = problems_of(tiny_model("qwen3"), mesh=mesh(1, 3))  # 4 heads, 2 KV heads
    assert "4 query heads do not split evenly over tp = 3" in message
    assert "2 KV heads do not split evenly over tp = 3" in message


def test_context_parallel_needs_ranks_sharing_a_kv_head():
    model = tiny_model("qwen3")  # 2 KV heads
    assert "needs tp > kv_heads" in problems_of(model, context_parallel=True, mesh=mesh(1, 2))
    assert "needs sp >= 2, got sp = 1" in problems_of(model, context_parallel=True,
                                                      mesh=mesh(1, 2), mode="sp")


def settings(model, mesh, **kwargs):
    args = dict(context_parallel=True, mode="auto", backend="torch", page_size=16)
    return validate_patch(model, mesh=mesh, **{**args, **kwargs})


@pytest.mark.parametrize("sp, tp, mode, resolved", [
    (2, 1, "auto", "sp"), (2, 4, "auto", "sp"), (1, 4, "auto", "tp"),
    (2, 4, "tp", "tp"), (1, 4, "tp", "tp"), (4, 1, "sp", "sp"),
], ids=["sp2-auto", "sp2xtp4-auto", "tp4-auto", "sp2xtp4-tp-wins", "tp4-tp", "sp4-sp"])
def test_auto_mode_is_sp_when_the_mesh_has_sp(sp, tp, mode, resolved):
    """One KV head: both modes run on every mesh here, so the mode is the one picked."""
    model = tiny_model("qwen3", num_key_value_heads=1)
    assert settings(model, mesh(sp, tp), mode=mode).mode == resolved
    assert settings(model, mesh(sp, tp), mode=mode, context_parallel=False).mode == resolved


def test_auto_mode_without_a_mesh_is_tp():
    assert settings(tiny_model("qwen3"), None, context_parallel=False).mode == "tp"


@pytest.mark.parametrize("sp, tp, kv_heads, mode, page_size, named, hint", [
    # the case: sp = 2, tp = 1 in TP mode
    (2, 1, 2, "tp", 16, "needs tp > kv_heads",
     "SP mode would work on this mesh: mode='sp' (--mode sp on the command line)"),
    (1, 4, 1, "sp", 16, "needs sp >= 2", "TP mode would work on this mesh: mode='tp'"),
    # P = 4 in TP mode does not divide page_size 6, P = 2 in SP mode does
    (2, 4, 1, "tp", 6, "page_size 6 is not a multiple of P = 4",
     "SP mode would work on this mesh: mode='sp'"),
    (4, 2, 1, "sp", 6, "page_size 6 is not a multiple of P = 4",
     "TP mode would work on this mesh: mode='tp'"),
    # neither mode runs: no suggestion
    (4, 4, 1, "tp", 6, "page_size 6 is not a multiple of P = 4", None),
    (1, 2, 2, "sp", 16, "needs sp >= 2", None),
    (1, 2, 2, "auto", 16, "needs tp > kv_heads", None),
], ids=["tp-on-sp-mesh", "sp-on-tp-mesh", "tp-page-size", "sp-page-size", "neither-page-size",
        "neither-sp", "neither-auto"])
def test_the_error_suggests_the_other_mode_where_it_would_run(sp, tp, kv_heads, mode, page_size,
                                                              named, hint):
    model = tiny_model("qwen3", num_key_value_heads=kv_heads)
    message = problems_of(model, context_parallel=True, mesh=mesh(sp, tp), mode=mode,
                          page_size=page_size)
    assert named in message
    if hint is None:
        assert "would work" not in message
    else:
        assert hint in message
        other = hint.split("mode='")[1].split("'")[0]
        settings(model, mesh(sp, tp), mode=other, page_size=page_size)  # and it does


def test_auto_mode_says_what_it_chose():
    message = problems_of(tiny_model("qwen3"), context_parallel=True, mesh=mesh(1, 2))
    assert "(mode='auto' chose TP mode: the mesh has sp = 1)" in message


def test_page_size_must_be_a_multiple_of_p():
    model = tiny_model("qwen3", num_key_value_heads=1)
    assert "page_size 6 is not a multiple of P = 4 (TP ranks sharing a KV head)" in problems_of(
        model, context_parallel=True, mesh=mesh(1, 4), page_size=6)
    assert "page_size 6 is not a multiple of P = 4 (SP ranks)" in problems_of(
        model, context_parallel=True, mesh=mesh(4, 1), mode="sp", page_size=6)
    # tp = 4 over 2 KV heads: P = 2 partners per head, so 6 is fine and 5 is not
    two = tiny_model("qwen3")
    validate_patch(two, context_parallel=True, mesh=mesh(1, 4), mode="tp", backend="torch",
                   page_size=6)
    assert "P = 2" in problems_of(two, context_parallel=True, mesh=mesh(1, 4), page_size=5)


@pytest.mark.parametrize("model_type, overrides, expected", [
    ("qwen3", dict(intermediate_size=100), "MLP intermediate size 100 does not split"),
    ("glm", dict(intermediate_size=100), "MLP intermediate size 100 does not split"),
    ("qwen3_moe", dict(moe_intermediate_size=36), "MoE intermediate size 36 does not split"),
    ("glm4_moe", dict(moe_intermediate_size=36), "shared experts MLP intermediate size 36"),
])
def test_mlp_must_split_over_tp(model_type, overrides, expected):
    model = tiny_model(model_type, num_attention_heads=8, num_key_value_heads=1, head_dim=8,
                       **overrides)
    assert f"{expected}" in problems_of(model, mesh=mesh(1, 8))


def test_sliding_window_layers_are_refused():
    model = tiny_model("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding-window attention layers are not supported" in problems_of(model)


def test_a_sliding_window_that_no_layer_uses_is_taken():
    """``use_sliding_window`` with ``max_window_layers`` past the last layer: every layer is
    full attention (transformers' layer_types), so the model patches and keeps its tokens."""
    overrides = dict(use_sliding_window=True, sliding_window=8, max_window_layers=64)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
    want = tiny_model("qwen3", **overrides).generate(ids, max_new_tokens=4, do_sample=False)
    model = torch_cp.patch_model(tiny_model("qwen3", **overrides))
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)


def test_several_problems_are_named_together_and_nothing_changes():
    model = tiny_model("glm4_moe", num_key_value_heads=1, moe_intermediate_size=36).double()
    weights = {k: v.data_ptr() for k, v in model.state_dict().items()}
    message = problems_of(model, mesh=mesh(1, 8), mode="ring", backend="triton", page_size=0)
    expected = ["mode must be one of", "backend must be one of", "page_size must be a positive",
                "torch.float64", "4 query heads do not split evenly over tp = 8",
                "MoE intermediate size 36 does not split evenly over tp = 8"]
    for text in expected:
        assert text in message, text
    assert message.count("\n  - ") >= len(expected)
    assert not hasattr(model, "torch_cp")
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == weights
    assert not any(hasattr(m, "cp_attention") or "forward" in m.__dict__ for m in model.modules())


def test_valid_settings_resolve():
    model = tiny_model("qwen3_moe", num_key_value_heads=1)
    s = validate_patch(model, context_parallel=True, mesh=mesh(2, 4), mode="tp", backend="auto",
                       page_size=8)
    assert (s.tp, s.sp, s.mode, s.page_size, s.dtype) == (4, 2, "tp", 8, torch.float32)
    assert "qwen3_moe" in s.family.model_types


def test_model_without_config():
    with pytest.raises(ValueError, match="no config"):
        torch_cp.patch_model(torch.nn.Linear(2, 2))


def test_a_mesh_that_is_not_the_world_is_named_with_the_other_problems(monkeypatch):
    from torch_cp import mesh as mesh_module

    monkeypatch.setattr("torch_cp.hf.validate.mesh_world_problems",
                        mesh_module.mesh_world_problems)
    message = problems_of(tiny_model("qwen3", num_key_value_heads=1), context_parallel=True,
                          mesh=mesh(1, 4), page_size=6)
    assert "the mesh spans 4 ranks, not the whole world of 1" in message
    assert "page_size 6 is not a multiple of P = 4" in message


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = tiny_model("qwen3")
    assert "the model's weights are on the meta device" in problems_of(model)


def test_partner_groups_need_the_whole_world():
    # The test world has one rank; partner groups are derived collectively from the whole mesh.
    from torch_cp.mesh import partner_placement

    with pytest.raises(ValueError, match="the mesh spans 4 ranks, not the whole world of 1"):
        partner_placement(mesh(1, 4), "tp", num_kv_heads=2)


@pytest.mark.parametrize("rope, refused", [
    (dict(rope_type="dynamic", factor=2.0), True),
    (dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8,
          original_max_position_embeddings=16), True),
    (dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=16), False),
    (dict(rope_type="linear", factor=2.0), False),
], ids=["dynamic", "longrope", "yarn", "linear"])
def test_rope_that_follows_the_calls_longest_position_is_refused(rope, refused):
    """Helper 55's hunt: dynamic and longrope RoPE pick their frequencies from each forward's
    longest position, so chunked prefill and packed rows changed the tokens, silently."""
    model = tiny_model("qwen3", max_position_embeddings=64,
                       rope_parameters=dict(rope_theta=10000.0, **rope))
    if refused:
        assert f"rope_type {rope['rope_type']!r} takes its frequencies" in problems_of(model)
    else:
        torch_cp.patch_model(model)
