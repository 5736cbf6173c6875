"""Invariant 5 at P = 1 for the hybrid families (Qwen3.5 dense and MoE, Qwen3-Next: gated DeltaNet
layers around a full-attention one): a patched model generates the unpatched Hugging Face
model's greedy tokens, with close last-step logits, through the test driver's packed steps,
through the ``Engine`` (prompts prefilled in several chunks with their state carried between
them; requests queued for state slots, a later one reusing a finished request's slot) and
``torch_cp.generate``, and through ``model.generate`` on a left-padded batch; ``unpatch_model``
gives back the Hugging Face model. The state pool's bytes are what the geometry says, and after
a run every page and every state slot is free again. ``patch_model`` refuses linear-attention
heads that do not split over tp.

Tolerance: fp32, atol = rtol = 1e-3 on logits of magnitude ~1-10 (the GQA tests' 1e-4 is too
tight here). Both sides run transformers' own torch gated-delta-rule kernels, but over other
shapes: the chunked kernel over other chunk boundaries (the engine's prefill chunks, HF's whole
prompt), the recurrent one over a packed batch instead of one row. Their float32 reassociation
(~1e-6) enters the recurrent state, which carries it to every later token, and the gated RMSNorm
of the small delta-rule output and the MoE layers amplify it: observed <= 2.2e-4 after six new
tokens (Qwen3.5-MoE, packed rows). The bound is still 20x below the smallest top-2 logit gap on
these greedy paths (>= 2e-2; ``reference`` asserts > 1e-2), so a stale, shifted or dropped state
fails it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from driver import HYBRID_TYPES, NEW_TOKENS, PROMPTS, greedy, left_padded, shape_mesh, tiny_model

import torch_cp
from torch_cp.state import LinearGeometry

TOL = dict(atol=1e-3, rtol=1e-3)
MIN_GAP = 10 * TOL["atol"]
CHUNK = 16  # max_tokens_per_step: the long prompts prefill in 4 chunks
LONG_A = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(1)).tolist()
LONG_B = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(2)).tolist()
# Two rows at a time: LONG_B and the prompts after it wait for a state slot another request
# held; every later request starts from a slot holding a finished request's state.
QUEUED = [LONG_A, PROMPTS[1], LONG_B, PROMPTS[2], PROMPTS[0]]
MAX_ROWS = 2


def hybrid_model(model_type: str, **overrides):
    """``tiny_model`` with a random ``dt_bias`` per value head: Hugging Face initialises it to
    ones, so a value head's decay could be taken from another head's without any test
    noticing."""
    model = tiny_model(model_type, **overrides)
    generator = torch.Generator().manual_seed(6)  # greedy paths far from ties
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".dt_bias"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=generator))
    return model


@torch.no_grad()
def hf_reference(model, prompts, new_tokens=NEW_TOKENS):
    """The unpatched model, one prompt at a time: greedy tokens, [rows, vocab] last logits and
    the smallest top-2 logit gap over every step (how far greedy is from a tie)."""
    tokens, logits, gap = [], [], float("inf")
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(out.logits[-1][0].float())
        top2 = torch.stack(out.logits).float().topk(2, dim=-1).values
        gap = min(gap, (top2[..., 0] - top2[..., 1]).min().item())
    return tokens, torch.stack(logits), gap


@pytest.fixture(scope="module")
def reference():
    """(model type, prompts) -> the unpatched model's tokens and last logits, computed once."""
    memo = {}

    def ref(model_type, prompts):
        key = (model_type, tuple(map(tuple, prompts)))
        if key not in memo:
            tokens, logits, gap = hf_reference(hybrid_model(model_type), prompts)
            assert gap > MIN_GAP, f"{model_type}: greedy is {gap:.2g} from a tie"
            memo[key] = tokens, logits
        return memo[key]
    return ref


def assert_matches(tokens, logits, ref, what):
    assert tokens == ref[0], what
    torch.testing.assert_close(logits, ref[1], **TOL, msg=lambda m: f"{what}: {m}")


def run_engine(engine, prompts, new_tokens=NEW_TOKENS):
    """``engine.run`` greedily, recording each request's last logits and the state slots handed
    out at admission: (tokens per prompt, [rows, vocab] logits, slots in admission order)."""
    last, taken = {}, []
    launch, take = engine.launcher.launch, engine.allocator.take_state_slot

    def recording_launch(step, ids, sampled):
        logits = launch(step, ids, sampled)
        for b, row in zip(sampled, logits):
            last[step.key[b][0]] = row.float().clone()  # key: (request, start, length) per row
        return logits

    def recording_take(request):
        taken.append(take(request))
        return taken[-1]
    engine.launcher.launch, engine.allocator.take_state_slot = recording_launch, recording_take
    results = engine.run(prompts, new_tokens)
    assert all(r.ok for r in results), [r.error for r in results]
    return ([list(r.token_ids) for r in results],
            torch.stack([last[i] for i in range(len(prompts))]).cpu(), taken)


def geometry_of(config) -> LinearGeometry:
    """One unsplit rank's linear-attention shapes, read off the config."""
    return LinearGeometry(layers=config.layer_types.count("linear_attention"),
                          k_heads=config.linear_num_key_heads,
                          v_heads=config.linear_num_value_heads,
                          k_dim=config.linear_key_head_dim, v_dim=config.linear_value_head_dim,
                          conv_kernel=config.linear_conv_kernel_dim)


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_driver_greedy_equals_hf(model_type, reference):
    model = torch_cp.patch_model(hybrid_model(model_type), page_size=4)
    ref = reference(model_type, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        alone = greedy(model, [prompt], NEW_TOKENS)
        assert_matches(alone.tokens, alone.last_logits, (ref[0][i:i + 1], ref[1][i:i + 1]),
                       f"prompt {i} alone")
    packed = greedy(model, PROMPTS, NEW_TOKENS)
    assert_matches(packed.tokens, packed.last_logits, ref, "packed rows")


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_engine_chunked_prefill_and_reused_slots_equal_hf(model_type, reference):
    model = torch_cp.patch_model(hybrid_model(model_type), page_size=4)
    ref = reference(model_type, QUEUED)
    engine = torch_cp.Engine(model, num_pages=64, max_tokens_per_step=CHUNK, max_rows=MAX_ROWS)
    tokens, logits, taken = run_engine(engine, QUEUED)
    assert_matches(tokens, logits, ref, "engine")
    assert len(taken) == len(QUEUED) and set(taken) == set(range(MAX_ROWS)), taken
    assert engine.prefilled_tokens == sum(map(len, QUEUED))
    assert engine.steps > NEW_TOKENS + len(LONG_A) // CHUNK  # the long prompts took chunks
    # Everything returns; a second run on the same engine (every slot now dirty) still matches.
    assert engine.allocator.free_pages == engine.allocator.num_pages
    assert engine.allocator.free_state_slots == engine.allocator.state_slots == MAX_ROWS
    again, logits, _ = run_engine(engine, QUEUED[::-1])
    assert_matches(again, logits, (ref[0][::-1], ref[1].flip(0)), "second run, reversed")
    assert engine.allocator.free_state_slots == MAX_ROWS


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_generate_equals_hf(model_type, reference):
    model = torch_cp.patch_model(hybrid_model(model_type), page_size=8)
    results = torch_cp.generate(model, QUEUED, NEW_TOKENS, max_tokens_per_step=CHUNK,
                                progress=False)
    assert [list(r.token_ids) for r in results] == reference(model_type, QUEUED)[0]


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_state_bytes_follow_the_geometry(model_type):
    model = hybrid_model(model_type)
    config = model.config
    torch_cp.patch_model(model, page_size=4)
    geometry = geometry_of(config)
    assert model.torch_cp.linear == geometry
    per_layer = (4 * (2 * config.linear_num_key_heads * config.linear_key_head_dim
                      + config.linear_num_value_heads * config.linear_value_head_dim)
                 * (config.linear_conv_kernel_dim - 1)  # conv state: the last K - 1 inputs
                 + 4 * config.linear_num_value_heads * config.linear_key_head_dim
                 * config.linear_value_head_dim)  # recurrent state, float32
    assert geometry.slot_bytes(torch.float32) == 2 * per_layer  # two linear layers
    assert torch_cp.state_bytes_per_rank(model, 5) == 5 * 2 * per_layer
    assert torch_cp.state_bytes_per_rank(config, 5) == 5 * 2 * per_layer  # unpatched: tp = 1
    assert torch_cp.state_bytes_per_rank(config, 5, tp=2) == 5 * per_layer  # heads split
    with pytest.raises(ValueError, match="do not split evenly over tp = 3"):
        torch_cp.state_bytes_per_rank(config, 5, tp=3)  # what patch_model refuses, not floored
    assert torch_cp.state_bytes_per_rank(tiny_model("qwen3"), 5) == 0  # no linear attention
    for max_rows, slots in ((3, 3), (None, 64)):  # None: 64 slots
        engine = torch_cp.Engine(model, num_pages=8, max_rows=max_rows)
        assert engine.state_bytes == geometry.slot_bytes(torch.float32) * (slots + 2)  # sink, zero
        assert engine.allocator.state_slots == slots


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_model_generate_left_padded_batch_equals_hf(model_type, reference):
    model = hybrid_model(model_type)
    ref = reference(model_type, PROMPTS)
    ids, mask = left_padded(PROMPTS)
    torch_cp.patch_model(model, page_size=4)
    # 4: the short rows' first chunks hold only padding; 4 more columns of padding in front:
    # the first chunk holds no real token in any row (skipped, no state touched)
    for chunk, extra in ((None, 0), (4, 0), (4, 4)):
        padded_ids, padded_mask = F.pad(ids, (extra, 0)), F.pad(mask, (extra, 0))
        out = model.generate(padded_ids, attention_mask=padded_mask, max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, prefill_chunk_size=chunk)
        assert_matches(out.sequences[:, padded_ids.shape[1]:].tolist(), out.logits[-1].float(),
                       ref, f"model.generate, prefill_chunk_size={chunk}, {extra} more padding")


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_unpatch_restores_the_hf_model(model_type, reference):
    model = hybrid_model(model_type)
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                  pad_token_id=0)
    before = model.generate(ids, **kwargs)
    torch_cp.patch_model(model, page_size=4)
    greedy(model, PROMPTS, 2)
    torch_cp.unpatch_model(model)
    assert not any(hasattr(m, "cp_attention") or hasattr(m, "cp_state")
                   or "forward" in m.__dict__ for m in model.modules())
    assert torch.equal(model.generate(ids, **kwargs), before)
    tokens, logits, _ = hf_reference(model, PROMPTS)
    assert tokens == reference(model_type, PROMPTS)[0]
    torch.testing.assert_close(logits, reference(model_type, PROMPTS)[1], atol=0, rtol=0)


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
@pytest.mark.parametrize("tp, heads, named", [
    (2, dict(linear_num_key_heads=1, linear_num_value_heads=2), ["linear_num_key_heads"]),
    (4, dict(linear_num_key_heads=2, linear_num_value_heads=6),
     ["linear_num_key_heads", "linear_num_value_heads"]),
])
def test_linear_heads_that_do_not_split_are_refused(model_type, tp, heads, named,
                                                    one_rank_world):
    model = hybrid_model(model_type, num_key_value_heads=1, **heads)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = shape_mesh(1, tp)
    with pytest.raises(ValueError) as info:
        torch_cp.patch_model(model, context_parallel=True, mesh=mesh, mode="tp")
    message = str(info.value)
    for name in named:
        assert f"({name}) do not split evenly over tp = {tp}" in message, message
    assert message.count("do not split evenly") == len(named), message
    assert not hasattr(model, "torch_cp")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
