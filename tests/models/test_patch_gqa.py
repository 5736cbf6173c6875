"""Invariant 5 at P = 1 for every GQA family: a patched model generates the same greedy tokens
as the unpatched Hugging Face model (``model.generate(do_sample=False)``), one prompt at a time
and packed into one multi-row step, and its last-step logits are close.

Tolerance: fp32, atol = rtol = 1e-4 on logits of magnitude ~1-10. The patched model runs the same
projections, norms and RoPE (the family's own Hugging Face function) and differs only in how
attention sums (dense gather over pages, base-2 LSE, exact partial merge) versus sdpa: float32
reassociation, observed <= 3e-6. The bound is far below the smallest top-2 logit gap of these
models (> 1e-3), so a wrong position, head, norm or page would fail it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from buckets import padding_bucket
from driver import (
    CONFIGS,
    HYBRID_TYPES,
    NEW_TOKENS,
    PROMPTS,
    TOL,
    cache_kwarg,
    greedy,
    hf_greedy,
    tiny_config,
    tiny_model,
)
from torch import nn

import torch_cp
from torch_cp.models import SUPPORTED_MODEL_TYPES
from torch_cp.plan import build_step_plan

FAMILIES = sorted(set(CONFIGS) - set(HYBRID_TYPES))  # hybrids: tests/models/test_hybrid.py


def assert_matches(result, ref_tokens, ref_logits, what=""):
    assert result.tokens == ref_tokens, what
    torch.testing.assert_close(result.last_logits, ref_logits, **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_patched_greedy_equals_hf(model_type):
    model = tiny_model(model_type)
    ref_tokens, ref_logits = hf_greedy(model)
    torch_cp.patch_model(model, page_size=4)
    for i, prompt in enumerate(PROMPTS):
        alone = greedy(model, [prompt], NEW_TOKENS)
        assert_matches(alone, ref_tokens[i:i + 1], ref_logits[i:i + 1], f"prompt {i} alone")
    assert_matches(greedy(model, PROMPTS, NEW_TOKENS), ref_tokens, ref_logits, "packed rows")


def test_eager_attention_implementation():
    """The mask transformers builds for eager attention is ignored (and sized to one key)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config("glm4"), attn_implementation="eager").eval()
    ref_tokens, ref_logits = hf_greedy(model)
    torch_cp.patch_model(model, page_size=4)
    assert_matches(greedy(model, PROMPTS, NEW_TOKENS), ref_tokens, ref_logits, "eager")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm"])
def test_checkpoint_roundtrip(model_type, tmp_path):
    """save_pretrained (safetensors) -> from_pretrained -> patch gives the original's tokens."""
    model = tiny_model(model_type, seed=1)
    ref_tokens, ref_logits = hf_greedy(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    torch_cp.patch_model(loaded.eval(), page_size=16)
    assert_matches(greedy(loaded, PROMPTS, NEW_TOKENS), ref_tokens, ref_logits, "loaded")


def storage_bytes(model) -> int:
    """Bytes of the distinct storages under the model's parameters and buffers."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def test_patch_uses_the_models_own_weights():
    """Patching copies no weight: the linears that read one input share one storage
    (fused_linear.py), the rest keep theirs, the values and the bytes held are the same; unpatching
    gives the fused linears their own storage back and the linears their own forwards."""
    model = tiny_model("qwen3")
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    held = storage_bytes(model)
    torch_cp.patch_model(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr or k.split(".")[-2] in fused, k
        torch.testing.assert_close(after[k], value, atol=0, rtol=0)
    assert storage_bytes(model) == held
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == \
        attn.cp_in.weight.untyped_storage().data_ptr() == \
        attn.v_proj.weight.untyped_storage().data_ptr()
    mlp = model.model.layers[0].mlp
    assert "forward" in attn.o_proj.__dict__ and "forward" in mlp.down_proj.__dict__  # gemv.py
    assert "forward" not in model.lm_head.__dict__
    torch_cp.unpatch_model(model)
    assert attn.q_proj.weight.untyped_storage().nbytes() == attn.q_proj.weight.nbytes
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear)
    for k, (_, value) in before.items():
        torch.testing.assert_close(model.state_dict()[k], value, atol=0, rtol=0)


def test_padded_input_with_token_index_equals_packed():
    """A right-padded [B, S] input with ``plan.token_index`` gives the packed step's logits at
    every real token (how model.generate feeds padded rows), also in a plan padded to a bucket
    of more tokens."""
    model = tiny_model("glm4_moe")
    torch_cp.patch_model(model, page_size=4)
    prompts = PROMPTS[:2]
    lens = [len(p) for p in prompts]
    width = max(lens)

    def prefill(input_ids, position_ids, token_index, pad_tokens_to=None):
        cache = torch_cp.PagedKVCache.for_model(model, num_pages=8)
        tables = [[0, 1, 2], [3, 4, 5, 6, 7]]
        plan = build_step_plan(lens, [0, 0], tables, page_size=4,
                               sink_page=cache.pool.sink_page, token_index=token_index,
                               bucket=padding_bucket(lens, tables, tokens_to=pad_tokens_to))
        cache.begin_step(plan)
        out = model(input_ids=input_ids, position_ids=position_ids, **{cache_kwarg(model): cache})
        return out.logits.reshape(-1, out.logits.shape[-1])

    packed = prefill(torch.tensor([sum(prompts, [])]), torch.cat(
        [torch.arange(n) for n in lens])[None], None)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    index = torch.cat([b * width + torch.arange(n) for b, n in enumerate(lens)])
    positions = torch.arange(width).expand(len(prompts), width)
    for bucket in (None, sum(lens) + 3):
        padded = prefill(ids, positions, index, bucket)
        torch.testing.assert_close(padded[index], packed, **TOL)


def test_patch_twice_raises_and_unpatch_restores():
    model = tiny_model("qwen3")
    ref_tokens, ref_logits = hf_greedy(model, PROMPTS[:1])
    torch_cp.patch_model(model, page_size=4)
    with pytest.raises(ValueError, match="already patched"):
        torch_cp.patch_model(model, page_size=4)
    torch_cp.unpatch_model(model)
    assert not hasattr(model, "torch_cp")
    assert not any(hasattr(m, "cp_attention") or "forward" in m.__dict__ for m in model.modules())
    assert not model._forward_pre_hooks and "_prepare_cache_for_generation" not in model.__dict__
    tokens, logits = hf_greedy(model, PROMPTS[:1])
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not patched"):
        torch_cp.unpatch_model(model)
    assert copy.deepcopy(model) is not model  # unpatched: an ordinary model
    torch_cp.patch_model(model, page_size=4)  # patchable again
    # A copy would keep calling the original's patched modules (closures over them).
    with pytest.raises(ValueError, match="cannot be deep-copied.*before torch_cp.patch_model"):
        copy.deepcopy(model)
    assert_matches(greedy(model, PROMPTS[:1], NEW_TOKENS), ref_tokens, ref_logits, "repatched")


@pytest.mark.parametrize("failing", ["fuse_gate_up", "kernel_routers"])
def test_a_patch_that_fails_partway_leaves_the_model_as_it_was(monkeypatch, failing):
    """Out of memory while fusing the MLPs' weights (the third-to-last part of patching), or
    at the very end: every forward and fused weight is put back (the values bit for bit; the
    fused linears' parameters are new objects, as after ``unpatch_model``), and the model
    patches again (before, it was left half patched and refused or misbehaved)."""
    model = tiny_model("qwen3_moe" if failing == "kernel_routers" else "qwen3")
    ref_tokens, ref_logits = hf_greedy(model, PROMPTS[:1])
    before = {name: p.clone() for name, p in model.named_parameters()}

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (in this test)")
    monkeypatch.setattr(f"torch_cp.hf.patch.{failing}", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="in this test"):
        torch_cp.patch_model(model, page_size=4)
    monkeypatch.undo()
    assert not hasattr(model, "torch_cp")
    assert not any(name.startswith("cp_") or "forward" in m.__dict__
                   for m in model.modules() for name in (*m.__dict__, *m._modules))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    tokens, logits = hf_greedy(model, PROMPTS[:1])
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=0, rtol=0)
    assert_matches(greedy(torch_cp.patch_model(model, page_size=4), PROMPTS[:1], NEW_TOKENS),
                   ref_tokens, ref_logits, "patched after the failure")


def test_forward_without_paged_cache_is_a_clear_error():
    model = torch_cp.patch_model(tiny_model("qwen2"))
    with pytest.raises(TypeError, match="PagedKVCache"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_cache_refuses_a_plan_it_cannot_serve():
    model = torch_cp.patch_model(tiny_model("qwen3"), page_size=4)
    cache = torch_cp.PagedKVCache.for_model(model, num_pages=2)
    with pytest.raises(RuntimeError, match="begin_step"):
        model(input_ids=torch.tensor([[1, 2]]), **{cache_kwarg(model): cache})
    other_page = build_step_plan([2], [0], [[0]], page_size=8, sink_page=cache.pool.sink_page)
    with pytest.raises(ValueError, match="page_size 8.*does not match the pool"):
        cache.begin_step(other_page)
    with pytest.raises(RuntimeError, match="update"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)


def test_unsupported_model_type_lists_supported_types():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as info:
        torch_cp.patch_model(model)
    assert "'llama' is not supported" in str(info.value)
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(info.value)
