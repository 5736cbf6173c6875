"""The private PyTorch and transformers hooks of ``torch_cp.compat`` still exist, with the shape
torch_cp relies on. A failure here means the installed release moved one: fix compat.py, not the
callers."""

from __future__ import annotations

import inspect

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from transformers.generation.utils import GenerationMixin

from torch_cp import compat


def test_module_call_runs_the_compiled_call_when_set():
    calls = []

    class Probe(nn.Module):
        def forward(self, x):
            calls.append("eager")
            return x

    probe = Probe()
    assert hasattr(probe, compat.COMPILED_CALL), f"nn.Module has no {compat.COMPILED_CALL}"
    assert callable(getattr(probe, "_call_impl", None)), "nn.Module has no _call_impl"
    compat.set_compiled_call(probe, lambda *args, **kwargs: "compiled")
    assert probe(torch.zeros(1)) == "compiled", f"nn.Module.__call__ ignores {compat.COMPILED_CALL}"
    compat.set_compiled_call(probe, None)
    probe(torch.zeros(1))
    assert calls == ["eager"]


def test_dynamo_options_exist():
    config = torch._dynamo.config
    for name in compat.DYNAMO_OPTIONS:
        assert hasattr(config, name), f"torch._dynamo.config has no {name}"
    with compat.dynamo_layer_options(recompile_limit=17):
        assert config.allow_unspec_int_on_nn_module is True and config.recompile_limit == 17


def test_inductor_pdl_setting_exists_and_is_scoped():
    import torch._inductor.config as inductor_config

    section, leaf = compat.INDUCTOR_PDL.split(".")
    owner = getattr(inductor_config, section)
    assert hasattr(owner, leaf), f"torch._inductor.config has no {compat.INDUCTOR_PDL}"
    before = getattr(owner, leaf)
    with compat.inductor_pdl(True):
        assert getattr(owner, leaf) is True
    with compat.inductor_pdl(False):
        assert getattr(owner, leaf) == before
    assert getattr(owner, leaf) == before


def test_inductor_pdl_waits_before_every_access_within_the_block():
    """Where Inductor's kernel waits is decided by ``TritonKernel._handle_pdl_before_access``
    from the scheduler's ``previous_node`` (none: wait); within the block each call sees none."""
    import inspect

    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.scheduler import Scheduler

    original = TritonKernel.__dict__[compat.INDUCTOR_PDL_ACCESS]
    assert "previous_node" in inspect.getsource(original)
    assert "self.previous_node" in inspect.getsource(Scheduler)
    with compat.inductor_pdl(True):
        patched = TritonKernel.__dict__[compat.INDUCTOR_PDL_ACCESS]
        assert patched is not original
        assert torch.compiler.config.cache_key_tag.endswith("torch_cp-pdl-wait-first")
        with compat.inductor_pdl(True):  # nested: the same patch, not one around it
            assert TritonKernel.__dict__[compat.INDUCTOR_PDL_ACCESS] is patched
        assert TritonKernel.__dict__[compat.INDUCTOR_PDL_ACCESS] is patched
    with compat.inductor_pdl(False):
        assert TritonKernel.__dict__[compat.INDUCTOR_PDL_ACCESS] is original
    assert TritonKernel.__dict__[compat.INDUCTOR_PDL_ACCESS] is original


def test_functional_collectives_exist():
    for fn in (compat.all_gather, compat.all_to_all_single, compat.all_reduce,
               compat.wait_tensor):
        assert callable(fn)
    assert compat.all_gather in (getattr(funcol, "all_gather_single", None),
                                 getattr(funcol, "all_gather_tensor", None))


def test_generate_builds_its_cache_through_the_hook_torch_cp_overrides():
    hook = getattr(GenerationMixin, compat.PREPARE_CACHE, None)
    assert hook is not None, f"GenerationMixin has no {compat.PREPARE_CACHE}"
    params = list(inspect.signature(hook).parameters)[1:]
    assert params == list(compat.PREPARE_CACHE_PARAMS), params
    source = inspect.getsource(GenerationMixin)
    assert f"self.{compat.PREPARE_CACHE}(" in source, "generate() no longer calls the hook"


def test_moe_experts_dispatch_on_the_config_attribute_torch_cp_switches():
    """``graphs/experts.py`` reads and sets ``config._experts_implementation`` (compat's
    ``experts_implementation``); a release that renames it must fail here, naming it."""
    from driver import tiny_model

    model = tiny_model("qwen3_moe")
    experts = [m.experts for m in model.modules() if hasattr(m, "experts")]
    assert experts, "qwen3_moe has MoE blocks"
    assert compat.experts_implementation(experts[0]) is not None, \
        "config._experts_implementation moved"
    compat.set_experts_implementation(model, experts, "batched_mm")
    assert {compat.experts_implementation(e) for e in experts} == {"batched_mm"}


def test_the_reference_gated_delta_rules_are_transformers_torch_functions():
    """``compat.torch_gated_delta_rules`` unwraps the decorator that sends the module-level
    names to flash-linear-attention when it is installed: the reference must stay torch."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    chunk, recurrent = compat.torch_gated_delta_rules()
    for fn, name in ((chunk, "torch_chunk_gated_delta_rule"),
                     (recurrent, "torch_recurrent_gated_delta_rule")):
        assert fn.__module__ == m.__name__ and fn.__name__ == name, fn
        assert not hasattr(fn, "__wrapped__"), f"{name} is still wrapped"
    assert compat.activation("silu")(torch.tensor([0.0])).item() == 0.0


def test_eager_gloo_collectives_take_the_classic_path(one_rank_world, monkeypatch):
    """Over gloo outside tracing no functional collective runs (two CI crashes inside them);
    results as the functional ones give them: gathered and exchanged along dim 0, summed out of
    place."""
    import torch.distributed as dist

    def functional(*args, **kwargs):
        raise AssertionError("a functional collective ran eagerly over gloo")
    for name in ("all_gather", "all_to_all_single", "all_reduce", "wait_tensor"):
        monkeypatch.setattr(compat, name, functional)
    x = torch.arange(6.0).view(3, 2)
    group = dist.group.WORLD
    assert torch.equal(compat.gather_dim0(x, group), x)
    assert torch.equal(compat.all_to_all_dim0(x, group), x)
    total = compat.sum_over(x, group)
    assert torch.equal(total, x) and total.data_ptr() != x.data_ptr()


def test_grouped_linear_multiplies_each_experts_rows_by_its_weight():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g)  # grouped_mm wants strides of 16-byte multiples
    weight = torch.randn(3, 4, 8, generator=g)  # [experts, out, in]
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)  # rows 0-1 expert 0, 2-4 expert 2
    want = torch.cat((x[:2] @ weight[0].T, x[2:] @ weight[2].T))
    torch.testing.assert_close(compat.grouped_linear(x, weight, offsets), want)


def test_experts_modules_gate_by_default_unless_their_class_defines_a_gate():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=2)
    assert compat.has_default_gate(Qwen3MoeExperts(config))

    class OwnGate(Qwen3MoeExperts):
        def _apply_gate(self, gate_up_out):
            return gate_up_out[..., : gate_up_out.shape[-1] // 2]

    assert not compat.has_default_gate(OwnGate(config))
