"""End to end on one GPU: torch_cp.generate with FlashInfer and CUDA graphs gives the reference
backend's greedy tokens (Qwen3 and an MLA model), and P processes over gloo on one GPU give the
tokens of P = 1."""

from __future__ import annotations

import importlib.util

import gpu_models
import pytest
import torch
import torch.distributed as dist
from gpu_models import (
    NEW_TOKENS,
    PROMPT_LENGTHS,
    assert_equal_but_near_ties,
    prompts,
    tokens,
)
from multirank import run_ranks

import torch_cp
from torch_cp import pdl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="needs FlashInfer"),
]


def qwen3():
    # head_dim 128 keeps FlashInfer on its prebuilt kernels; 1 KV head allows TP mode at tp = 2.
    return gpu_models.qwen3(torch.bfloat16)


MODELS = {"qwen3": qwen3, "mla": gpu_models.mla}


@pytest.mark.parametrize("name", list(MODELS))
def test_flashinfer_with_graphs_matches_the_reference_backend(name):
    reference = torch_cp.patch_model(MODELS[name]().cuda(), backend="torch")
    expected = tokens(torch_cp.generate(reference, prompts(), NEW_TOKENS, progress=False))
    fast = torch_cp.patch_model(MODELS[name]().cuda(), backend="flashinfer")
    assert fast.torch_cp.backend.name == "flashinfer"
    engine = torch_cp.Engine(fast, num_pages=64, page_size=16, cuda_graphs=True,
                             max_pages_per_row=8)
    got = tokens(engine.run(prompts(), NEW_TOKENS))
    assert engine.replayed_steps >= NEW_TOKENS - 2, "decode steps replay from CUDA graphs"
    assert got == expected
    # Step n + 1 planned into the static buffers and launched, fed step n's tokens on the
    # device, while step n replays: the same tokens.
    ahead = torch_cp.Engine(fast, num_pages=64, page_size=16, cuda_graphs=True,
                            max_pages_per_row=8, overlap_planning=True)
    assert tokens(ahead.run(prompts(), NEW_TOKENS)) == expected
    assert ahead.launched_ahead_steps >= NEW_TOKENS // 2


@pytest.mark.parametrize("kernel", ["triton", "auto"])
def test_triton_decode_replayed_gives_the_reference_backends_tokens(kernel, monkeypatch):
    """Decode steps through torch_cp's Triton kernels (``decode_kernel="triton"``; ``"auto"``:
    one-token steps only, here a prompt alone), captured and replayed, and launched ahead: the
    torch reference backend's tokens."""
    from torch_cp.attention import flashinfer_gqa, triton_decode

    reference = torch_cp.patch_model(qwen3().cuda(), backend="torch")
    monkeypatch.setattr(flashinfer_gqa, "DECODE_KERNEL", kernel)
    calls = []
    decode = triton_decode.decode
    monkeypatch.setattr(triton_decode, "decode",
                        lambda *a: calls.append(a[0].shape[0]) or decode(*a))
    fast = torch_cp.patch_model(qwen3().cuda(), backend="flashinfer")
    engine = torch_cp.Engine(fast, num_pages=64, page_size=16, cuda_graphs=True,
                             max_pages_per_row=8, overlap_planning=True)
    for batch in (prompts(), prompts()[:1]):
        expected = tokens(torch_cp.generate(reference, batch, NEW_TOKENS, progress=False))
        before = engine.replayed_steps
        # bf16 summed in another order than the reference's: streams may split at a near-tie.
        assert_equal_but_near_ties(qwen3().cuda(), expected, tokens(engine.run(batch, NEW_TOKENS)))
        assert engine.replayed_steps - before >= NEW_TOKENS - 2
    assert calls and (kernel == "triton" or set(calls) == {1}), calls


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_engine_gives_the_uncompiled_engines_tokens(name):
    """The fastest configuration (compiled layers, CUDA graphs, steps launched ahead) against the
    uncompiled graphs engine on the same bf16 model. Fusion rounds differently, so a stream may
    split, but only at a near-tie. The prompts (one eager step) run through the compiled layers
    too."""
    model = torch_cp.patch_model(MODELS[name]().cuda(), backend="flashinfer")
    kwargs = dict(num_pages=64, page_size=16, cuda_graphs=True, max_pages_per_row=8)
    plain = tokens(torch_cp.Engine(model, **kwargs).run(prompts(), NEW_TOKENS))
    engine = torch_cp.Engine(model, **kwargs, compile=True, overlap_planning=True)
    fast = tokens(engine.run(prompts(), NEW_TOKENS))
    assert engine.replayed_steps >= NEW_TOKENS - 2
    assert engine.launched_ahead_steps >= NEW_TOKENS // 2
    assert_equal_but_near_ties(MODELS[name]().cuda(), plain, fast)


@pytest.mark.parametrize("name", list(MODELS))
def test_one_token_linears_give_cublas_tokens_at_batch_1(name, monkeypatch):
    """One prompt, so every decode step has one token and the compiled layers run their linears
    through ``torch_cp.gemv``'s kernel (the tests above decode four rows a step, which take
    cuBLAS): against the same compiled engine with the kernel off, up to near-ties."""
    from torch.profiler import ProfilerActivity, profile

    from torch_cp import gemv

    model = torch_cp.patch_model(MODELS[name]().cuda(), backend="flashinfer")
    kwargs = dict(num_pages=64, page_size=16, cuda_graphs=True, max_pages_per_row=8,
                  compile=True)
    one = prompts()[:1]
    monkeypatch.setattr(gemv, "ENABLED", False)
    cublas = tokens(torch_cp.Engine(model, **kwargs).run(one, NEW_TOKENS))
    monkeypatch.setattr(gemv, "ENABLED", True)
    engine = torch_cp.Engine(model, **kwargs)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        triton = tokens(engine.run(one, NEW_TOKENS))
        torch.cuda.synchronize()
    assert any("_gemv" in e.key for e in prof.key_averages()), "the kernel ran"
    assert_equal_but_near_ties(MODELS[name]().cuda(), cublas, triton)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_prompts_prefilled_in_chunks_give_the_whole_prompts_tokens(name, compile):
    """Chunks of 16 tokens (prompts of 17-70 tokens): every chunk after the first merges its
    context partial with its own tokens' (FlashInfer's merge_state), eagerly or through the
    compiled layers (the chunks fit no bucket), against one prefill step per prompt."""
    model = torch_cp.patch_model(MODELS[name]().cuda(), backend="flashinfer")
    kwargs = dict(num_pages=64, page_size=16, cuda_graphs=True, max_pages_per_row=8)
    whole = tokens(torch_cp.Engine(model, **kwargs).run(prompts(), NEW_TOKENS))
    engine = torch_cp.Engine(model, **kwargs, max_tokens_per_step=16, compile=compile)
    chunked = tokens(engine.run(prompts(), NEW_TOKENS))
    assert engine.steps >= sum(-(-n // 16) for n in PROMPT_LENGTHS)
    assert_equal_but_near_ties(MODELS[name]().cuda(), whole, chunked)


def qwen3_in(dtype):
    model = qwen3()
    return model.to(dtype).cuda()


def _generate_on_ranks(rank: int, world: int, mode: str, backend: str, dtype):
    torch.cuda.set_device(0)
    mesh = torch_cp.init_mesh(tp=world if mode == "tp" else 1, sp=world if mode == "sp" else 1,
                              device_type="cuda")
    model = torch_cp.patch_model(qwen3_in(dtype), context_parallel=True, mesh=mesh, mode=mode,
                                 backend=backend)
    records = []
    model.torch_cp.exchange.records = records
    out = tokens(torch_cp.generate(model, prompts(), NEW_TOKENS, progress=False))
    assert dist.get_backend() == "gloo"
    return out, [(r.op, r.shape, str(r.dtype)) for r in records]


def near_tie_gap(prompt, prefix, a: int, b: int) -> float:
    """|logit a - logit b| of the unpatched bf16 model after ``prompt + prefix``."""
    model = qwen3().cuda()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + prefix], device="cuda")).logits[0, -1].float()
    return abs(logits[a] - logits[b]).item()


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32),
                                           ("flashinfer", torch.bfloat16)], ids=["torch-fp32",
                                                                                 "flashinfer-bf16"])
@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_two_processes_on_one_gpu_match_one(mode, backend, dtype):
    """fp32: the same greedy tokens as P = 1. bf16: the same tokens up to a near-tie, i.e. where
    the streams first differ the two tokens' logits are within a few bf16 ulps (2^-7 relative
    on logits of O(1-10), so 0.1) of each other in the unpatched model."""
    single = torch_cp.patch_model(qwen3_in(dtype), backend=backend)
    expected = tokens(torch_cp.generate(single, prompts(), NEW_TOKENS, progress=False))
    per_rank = run_ranks(2, _generate_on_ranks, mode, backend, dtype)
    assert per_rank[0][0] == per_rank[1][0], "partners generate the same tokens"
    assert per_rank[0][1] and per_rank[0][1] == per_rank[1][1], "partners in lockstep"
    for prompt, want, got in zip(prompts(), expected, per_rank[0][0]):
        if dtype == torch.float32 or want == got:
            assert got == want
            continue
        d = next(i for i, (x, y) in enumerate(zip(want, got)) if x != y)
        gap = near_tie_gap(prompt, want[:d], want[d], got[d])
        assert gap < 0.1, f"tokens differ at {d} where P = 1 prefers {want[d]} by {gap:.3f}"


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_dependent_launches_give_the_tokens_without_them(name, rows, monkeypatch):
    """``torch_cp.pdl`` on (sm90): in the captured steps Inductor's kernels in the compiled
    layers start as dependent launches, and so do torch_cp's that the step runs: the one-token
    linears (one row), the Triton decode (one row, GQA) and the pool write (GQA; MLA's pool is
    written by indexing). bf16 tokens equal the same engine's without, up to near-ties."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the dependent launch needs sm90")
    model = torch_cp.patch_model(MODELS[name]().cuda(), backend="flashinfer")
    kwargs = dict(num_pages=64, page_size=16, cuda_graphs=True, max_pages_per_row=8,
                  compile=True, overlap_planning=True)
    batch = prompts()[:rows]
    monkeypatch.setattr(pdl, "ENABLED", False)  # whatever the default
    without = tokens(torch_cp.Engine(model, **kwargs).run(batch, NEW_TOKENS))
    seen = gpu_models.spy_dependent_launches(monkeypatch)
    torch._dynamo.reset()  # Inductor's kernels generated again, for the dependent launch
    engine = torch_cp.Engine(model, **kwargs)
    got = tokens(engine.run(batch, NEW_TOKENS))
    assert engine.replayed_steps >= NEW_TOKENS - 2
    expected = gpu_models.dependent_launch_kernels(rows, gqa=name == "qwen3", moe=False)
    assert True in seen["inductor"] and expected <= seen["kernels"], seen
    assert_equal_but_near_ties(MODELS[name]().cuda(), without, got)
