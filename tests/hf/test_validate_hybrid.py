"""Invariant 6 for hybrid models (Qwen3.5, Qwen3-Next): bad configurations fail before anything
is modified or allocated, with one ValueError that names every problem.

Meshes are shape-only DeviceMeshes over a one-rank gloo world, as in tests/hf/test_validate.py.
"""

from __future__ import annotations

import pytest
import torch
from driver import HYBRID_TYPES, shape_mesh, tiny_model
from torch.distributed.device_mesh import DeviceMesh

import torch_cp
from torch_cp import runtime as runtime_module
from torch_cp.hf.validate import validate_patch
from torch_cp.state.kernels import fla_available

pytestmark = pytest.mark.usefixtures("one_rank_world", "shape_meshes_are_the_world")


def mesh(sp: int, tp: int) -> DeviceMesh:
    return shape_mesh(sp, tp)


def problems_of(model, **kwargs) -> list[str]:
    """The problems patch_model's ValueError lists, one per line."""
    with pytest.raises(ValueError) as info:
        torch_cp.patch_model(model, **kwargs)
    header, *problems = str(info.value).split("\n  - ")
    assert header == "cannot patch the model:"
    return problems


def snapshot(model):
    """What patching would change: parameters (storage and values), module classes and forwards,
    the config's layer types."""
    return ({k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()},
            [(type(m), "forward" in m.__dict__) for m in model.modules()],
            list(model.config.layer_types))


def assert_unchanged(model, before) -> None:
    params, modules, layer_types = snapshot(model)
    assert not hasattr(model, "torch_cp")
    assert params.keys() == before[0].keys()
    for name, (ptr, value) in params.items():
        assert ptr == before[0][name][0] and torch.equal(value, before[0][name][1]), name
    assert modules == before[1] and layer_types == before[2]


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_linear_heads_must_split_over_tp(model_type):
    """Full-attention heads split over tp = 2 (4 query heads, 2 KV heads), the linear ones not:
    3 key heads and 3 value heads (one value head per key head) are both named."""
    model = tiny_model(model_type, linear_num_key_heads=3, linear_num_value_heads=3)
    before = snapshot(model)
    problems = problems_of(model, mesh=mesh(1, 2))
    assert problems == [
        "3 linear-attention key heads (linear_num_key_heads) do not split evenly over tp = 2",
        "3 linear-attention value heads (linear_num_value_heads) do not split evenly over tp = 2"]
    assert_unchanged(model, before)


def test_linear_key_heads_alone():
    """The default tiny hybrid at tp = 4: its 4 query, 2 KV and 4 linear value heads split (KV
    heads replicated), its 2 linear key heads do not."""
    assert problems_of(tiny_model("qwen3_5_text"), mesh=mesh(1, 4)) == [
        "2 linear-attention key heads (linear_num_key_heads) do not split evenly over tp = 4"]


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_unknown_layer_type_is_named(model_type):
    """A layer type neither linear_attention nor full_attention, in the config the model was
    built from (transformers gives that layer an attention module)."""
    model = tiny_model(model_type, layer_types=["linear_attention", "sliding_attention",
                                                "full_attention"])
    before = snapshot(model)
    assert (f"{model_type}: layer types ['sliding_attention'] are not supported (only "
            "linear_attention, full_attention)") in problems_of(model)
    assert_unchanged(model, before)


def test_layer_types_that_disagree_with_the_modules():
    """Layer types changed after the model was built: the modules are not where they say."""
    model = tiny_model("qwen3_5_text")
    model.config.layer_types = ["linear_attention", "linear_attention", "full_attention"]
    problems = problems_of(model)
    assert len(problems) == 2
    assert "modules with layer indices 2, found [1]" in problems[0]
    assert "modules at layers 0, 1, found [0, 2]" in problems[1]


@pytest.mark.skipif(fla_available(), reason="flash-linear-attention is installed here")
def test_flashinfer_on_a_hybrid_needs_flash_linear_attention():
    problems = problems_of(tiny_model("qwen3_next"), backend="flashinfer")
    assert ("backend 'flashinfer' runs a hybrid model's linear-attention layers with "
            "flash-linear-attention's kernels, which are not installed: pip install "
            "fla-core==0.6.0 (torch_cp's gpu extra), or backend='torch'") in problems


@pytest.mark.skipif(fla_available(), reason="flash-linear-attention is installed here")
def test_every_problem_is_named_at_once_and_nothing_changes():
    model = tiny_model("qwen3_5_moe_text", linear_num_key_heads=3, linear_num_value_heads=3)
    model.config.layer_types = ["linear_attention", "mamba", "full_attention"]
    before = snapshot(model)
    problems = problems_of(model, mesh=mesh(1, 2), backend="flashinfer", page_size=0)
    expected = [
        "page_size must be a positive int, got 0",  # not a hybrid problem
        "layer types ['mamba'] are not supported",
        "3 linear-attention key heads (linear_num_key_heads) do not split evenly over tp = 2",
        "3 linear-attention value heads (linear_num_value_heads) do not split evenly over tp = 2",
        "backend 'flashinfer': device cpu is not a CUDA device",
        "backend 'flashinfer' runs a hybrid model's linear-attention layers with "
        "flash-linear-attention's kernels, which are not installed"]
    for text in expected:
        assert sum(text in p for p in problems) == 1, text
    assert_unchanged(model, before)


def test_a_valid_hybrid_passes():
    """The same checks pass a good hybrid: tp = 2 with context parallelism over one KV head."""
    settings = validate_patch(tiny_model("qwen3_next", num_key_value_heads=1),
                              context_parallel=True, mesh=mesh(1, 2), mode="tp",
                              backend="torch", page_size=16)
    assert (settings.tp, settings.mode, settings.context_parallel) == (2, "tp", True)


@pytest.fixture(scope="module")
def hybrid():
    return torch_cp.patch_model(tiny_model("qwen3_5_text"))


@pytest.fixture
def no_allocation(monkeypatch, hybrid):
    """An Engine that would allocate its pool or state pool raises instead (a pool sized on the
    meta device, for the memory check, allocates nothing)."""
    sized = hybrid.torch_cp.new_pool

    def refuse(*args, **kwargs):
        raise AssertionError("allocated before refusing")

    def pool(*args, **kwargs):
        return (sized if "meta" in args or kwargs.get("device") == "meta" else refuse)(
            *args, **kwargs)

    monkeypatch.setattr(hybrid.torch_cp, "new_pool", pool)
    monkeypatch.setattr(runtime_module, "new_state_pool", refuse)  # the engine's new_pools


@pytest.mark.usefixtures("no_allocation")
@pytest.mark.parametrize("kwargs, reason", [
    (dict(state_checkpoints=4), "state_checkpoints: only a hybrid model (linear attention) "
     "with prefix_caching=True keeps state checkpoints"),
    (dict(mixed_buckets=[(2, 16)]), "mixed_buckets: a hybrid model's multi-token steps run the "
     "chunked gated delta rule per row from host lengths, which a CUDA graph cannot hold"),
], ids=["checkpoints-without-caching", "mixed-buckets"])
def test_engine_refuses_what_a_hybrid_cannot_run(hybrid, kwargs, reason):
    with pytest.raises(ValueError, match="invalid engine") as info:
        torch_cp.Engine(hybrid, num_pages=8, **kwargs)
    assert reason in str(info.value)


@pytest.mark.usefixtures("no_allocation")
def test_engine_names_hybrid_and_other_problems_together(hybrid):
    with pytest.raises(ValueError) as info:
        torch_cp.Engine(hybrid, num_pages=0, prefix_caching=True, state_checkpoints=-1,
                        mixed_buckets=[(2, 16)])
    message = str(info.value)
    for text in ("num_pages must be a positive int, got 0",
                 "mixed_buckets are captured shapes: they need cuda_graphs=True",
                 "state_checkpoints must be a positive int or None, got -1",
                 "mixed_buckets: a hybrid model"):
        assert text in message, text


def test_engine_takes_a_hybrid_without_them(hybrid):
    """The refusals are the hybrid's: the same model runs in an Engine without them."""
    engine = torch_cp.Engine(hybrid, num_pages=8, max_rows=2)
    assert engine.allocator.state_slots == 2 and engine.state.num_slots == 2


def test_value_heads_must_be_a_multiple_of_key_heads():
    """A value head reads key head ``j // (Hv / Hk)``: a ratio that is not whole is refused."""
    model = tiny_model("qwen3_5_text", linear_num_key_heads=2, linear_num_value_heads=3)
    with pytest.raises(ValueError, match="linear_num_value_heads 3 is not a multiple of "
                                         "linear_num_key_heads 2"):
        torch_cp.patch_model(model)
