"""The one kernel that takes a step's new queries and keys through their RMSNorms and RoPE and
writes keys and values into the pool (kv/rotate_kernel.py), against transformers' own modules run
eagerly (``Qwen3RMSNorm``, ``apply_rotary_pos_emb``) and torch indexing into the pool.

bf16 is compared bit for bit on the CPU: the kernel rounds where the eager ops round, and a
product of two bf16 values is exact in float32, so only the order of the mean of squares may
differ, and the inputs here never meet that. On the GPU torch's rsqrt and the kernel's may differ
in the last float32 bit as well: at most 2 % of the outputs may then move by one bf16 step.
float32: 1e-5 on values of magnitude ~1-10, for the mean of squares summed in another order and
``x * cos + y * sin`` contracted (observed 1.4e-6 at most). Then a patched model with the kernel
(on the CPU in Triton's interpreter, ``pool.ROTATE_IN_INTERPRETER``) generates the unpatched
model's tokens, eagerly and in a compiled step.
"""

from __future__ import annotations

import pytest
import torch
from driver import NEW_TOKENS, PROMPTS, TOL, greedy, hf_greedy, tiny_model
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

import torch_cp
from torch_cp.kv import pool as pool_module
from torch_cp.kv.pool import GQAPool, write_kv_slots
from torch_cp.plan import build_step_plan

pytest.importorskip("triton", reason="the kernel is Triton (CPU: its interpreter)")
from torch_cp.kv.rotate_kernel import norm_rope_write  # noqa: E402

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
PAGES, PAGE, EPS = 5, 4, 1e-6  # the last page is the sink
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16_STEP = dict(atol=2 ** -4, rtol=2 ** -7)  # one bf16 step of outputs up to ~8, after RoPE


def reference(q, k, v, q_norm, k_norm, cos, sin, cache, index):
    """transformers' eager norms and RoPE (rotating the first ``cos`` dims, the rest passed
    through, as partial-RoPE models do), then torch indexing into ``cache``."""
    rotary = cos.shape[-1]
    with torch.no_grad():
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary], k[..., :rotary], cos, sin)
        q = torch.cat([q_rot, q[..., rotary:]], -1)
        k = torch.cat([k_rot, k[..., rotary:]], -1)
    write_kv_slots(cache, k, v, index)
    return q, k


def case(q_heads, kv_heads, dim, rotary, tokens, dtype, norm=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = (3 * torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=g)).to(dtype)
    q, k, v = packed.split([q_heads * dim, kv_heads * dim, kv_heads * dim], 1)  # views, rows apart
    norms = [Qwen3RMSNorm(dim, eps=EPS) for _ in range(2)] if norm else [None, None]
    for m in norms if norm else ():
        m.weight.data = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
    angles = torch.arange(tokens)[:, None] * torch.rand(rotary // 2, generator=g)[None]
    angles = torch.cat([angles, angles], -1)
    cache = torch.randn(PAGES, 2, PAGE, kv_heads, dim, generator=g).to(dtype)
    slots = torch.randperm((PAGES - 1) * PAGE, generator=g)[:tokens]
    index = torch.cat([slots[:-1], torch.tensor([(PAGES - 1) * PAGE + 2])])  # one on the sink
    return (q.view(tokens, q_heads, dim), k.view(tokens, kv_heads, dim),
            v.view(tokens, kv_heads, dim), *norms, angles.cos().to(dtype),
            angles.sin().to(dtype), cache, index)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_heads,kv_heads,dim,rotary,dtype,norm", [
    (4, 2, 16, 16, torch.bfloat16, True),    # Qwen3: the whole head rotated
    (8, 2, 32, 16, torch.bfloat16, True),    # GLM-4-MoE: half the head rotated
    (2, 1, 24, 8, torch.bfloat16, True),     # a head dim that is no power of two
    (4, 2, 16, 16, torch.float32, True),
    (4, 4, 16, 8, torch.float32, False),     # Qwen2: no q/k norms
])
def test_one_kernel_equals_the_models_norms_rope_and_the_pool_write(
        device, q_heads, kv_heads, dim, rotary, dtype, norm):
    q, k, v, q_norm, k_norm, cos, sin, cache, index = case(q_heads, kv_heads, dim, rotary, 6,
                                                           dtype, norm)
    want_cache = cache.clone()
    want_q, want_k = reference(q, k, v, q_norm, k_norm, cos, sin, want_cache, index)
    weights = [m.weight.data.to(device) if norm else None for m in (q_norm, k_norm)]
    on = [t.to(device) for t in (q, k, v, cos, sin, cache, index)]
    got_q, got_k = norm_rope_write(*on[:3], *weights, EPS, *on[3:])
    got = (got_q.cpu(), got_k.cpu(), on[5].cpu())
    for g, w in zip(got, (want_q, want_k, want_cache)):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, **FP32)
        elif device == "cpu":
            assert torch.equal(g, w)
        else:  # CUDA's rsqrt and the sum of squares in another order: a rare step of bf16
            assert (g != w).float().mean() <= 0.02
            torch.testing.assert_close(g.float(), w.float(), **BF16_STEP)


def test_no_tokens_write_nothing():
    q, k, v, q_norm, k_norm, cos, sin, cache, index = case(2, 1, 16, 16, 1, torch.float32)
    before = cache.clone()
    got_q, got_k = norm_rope_write(q[:0], k[:0], v[:0], q_norm.weight.data, k_norm.weight.data,
                                   EPS, cos[:0], sin[:0], cache, index[:0])
    assert got_q.shape == (0, 2, 16) and got_k.shape == (0, 1, 16)
    assert torch.equal(cache, before)


@pytest.fixture
def rotating(monkeypatch):
    """The kernel on (whatever the default) and on the CPU pool (Triton's interpreter), every
    call counted."""
    monkeypatch.setattr(pool_module, "ROTATE_IN_ONE_KERNEL", True)
    monkeypatch.setattr(pool_module, "ROTATE_IN_INTERPRETER", True)
    calls = []
    original = GQAPool.rotate_and_write

    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GQAPool, "rotate_and_write", counted)
    return calls


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "qwen2"])  # qwen3: compiled below
def test_a_patched_model_through_the_kernel_generates_the_unpatched_tokens(rotating, model_type):
    overrides = {"use_qk_norm": True} if model_type == "glm4_moe" else {}
    model = tiny_model(model_type, **overrides)
    ref_tokens, ref_logits = hf_greedy(model)
    torch_cp.patch_model(model, page_size=4)
    result = greedy(model, PROMPTS, NEW_TOKENS)
    assert result.tokens == ref_tokens
    torch.testing.assert_close(result.last_logits, ref_logits, **TOL)
    assert set(rotating) == set(range(model.config.num_hidden_layers))


def test_a_kernel_module_that_cannot_import_leaves_the_models_own_path(rotating, monkeypatch):
    """Triton installed but the kernel's module failing to import: the model's norms, RoPE and
    indexing write, not a call of None (helper 108's find)."""
    import sys

    monkeypatch.setitem(sys.modules, "torch_cp.kv.rotate_kernel", None)  # import raises
    monkeypatch.setattr(pool_module, "_kernel", pool_module._kernel.__wrapped__)  # no cache
    model = tiny_model("qwen3_moe")
    ref_tokens, _ = hf_greedy(model, PROMPTS[:1], 3)
    torch_cp.patch_model(model, page_size=4)
    assert greedy(model, PROMPTS[:1], 3).tokens == ref_tokens
    assert rotating == []


def test_glm_rotates_interleaved_pairs_so_it_keeps_the_models_rope(rotating):
    model = torch_cp.patch_model(tiny_model("glm"), page_size=4)
    greedy(model, PROMPTS[:1], 2)
    assert rotating == []


def prefill_then_decode(model, forward) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The logits of a two-row prefill step, then of a decode step, on a fresh pool; the pool."""
    cache = torch_cp.PagedKVCache.for_model(model, num_pages=4, page_size=8)
    logits = []
    for tokens, q_lens, ctx_lens in [(list(range(3, 16)), [6, 7], [0, 0]),
                                     ([5, 9], [1, 1], [6, 7])]:
        plan = build_step_plan(q_lens, ctx_lens, [[0], [1]], page_size=8,
                               sink_page=cache.pool.sink_page, placement=model.torch_cp.placement)
        cache.begin_step(plan)
        with torch.inference_mode():
            out = forward(input_ids=torch.tensor([tokens]), position_ids=plan.positions[None],
                          use_cache=False, logits_to_keep=plan.qo_indptr_host[1:].long() - 1,
                          cache=cache)
        logits.append(out.logits[0])
    return logits, cache.pool.kv.clone()


@pytest.mark.slow
def test_a_compiled_step_through_the_kernel_equals_the_models_own_eager_step(
        monkeypatch, rotating):
    """Compiled (``fullgraph``) with the kernel, its op mutating the pool, against eager with the
    model's own norms and RoPE: a prefill step's and a decode step's logits, and the pools."""
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), page_size=8)
    monkeypatch.setattr(pool_module, "ROTATE_IN_ONE_KERNEL", False)
    eager, eager_pool = prefill_then_decode(model, model.forward)
    assert rotating == []
    monkeypatch.setattr(pool_module, "ROTATE_IN_ONE_KERNEL", True)
    torch._dynamo.reset()
    compiled, compiled_pool = prefill_then_decode(model, torch.compile(model.forward,
                                                                       fullgraph=True))
    assert set(rotating) == set(range(model.config.num_hidden_layers))  # the op ran
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, **TOL)
    torch.testing.assert_close(compiled_pool, eager_pool, **FP32)


@pytest.mark.gpu
@pytest.mark.parametrize("model_name,rows", [("qwen3", 1), ("qwen3", 3), ("qwen3_moe", 1),
                                             ("glm4_moe", 3)])
def test_captured_compiled_steps_through_the_kernel_give_the_tokens_without_it(
        monkeypatch, model_name, rows):
    """bf16 on the GPU, FlashInfer, CUDA graphs (three rows pad a bucket of four) and compiled
    layers: the engine's tokens with the kernel equal its tokens with the models' own norms,
    RoPE and pool write, up to near-ties of the unpatched model; the kernel ran."""
    import gpu_models
    from gpu_models import NEW_TOKENS as GPU_NEW_TOKENS
    from gpu_models import assert_equal_but_near_ties, prompts, tokens
    from torch.profiler import ProfilerActivity, profile

    pytest.importorskip("flashinfer")
    make = getattr(gpu_models, model_name)
    model = torch_cp.patch_model(make(torch.bfloat16).cuda(), backend="flashinfer")
    kwargs = dict(num_pages=64, page_size=16, cuda_graphs=True, max_pages_per_row=8,
                  compile=True)
    batch = prompts()[:rows]
    monkeypatch.setattr(pool_module, "ROTATE_IN_ONE_KERNEL", False)
    without = tokens(torch_cp.Engine(model, **kwargs).run(batch, GPU_NEW_TOKENS))
    monkeypatch.setattr(pool_module, "ROTATE_IN_ONE_KERNEL", True)
    torch._dynamo.reset()
    engine = torch_cp.Engine(model, **kwargs)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = tokens(engine.run(batch, GPU_NEW_TOKENS))
        torch.cuda.synchronize()
    assert engine.replayed_steps >= GPU_NEW_TOKENS - 2
    assert any("_norm_rope_write" in e.key for e in prof.key_averages()), "the kernel ran"
    assert_equal_but_near_ties(make(torch.bfloat16).cuda(), without, got, batch)
