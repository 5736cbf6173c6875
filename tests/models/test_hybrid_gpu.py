"""The hybrid families (Qwen3.5 dense and MoE, Qwen3-Next) on one GPU.

bf16: flash-linear-attention's chunked gated DeltaNet kernel (multi-token steps) and torch_cp's
decode kernel beside FlashInfer (``backend="flashinfer"``) give the unpatched Hugging Face
model's greedy tokens (on a GPU it runs fla's kernels) up to bf16 near-ties
(``gpu_models.near_tie``): eagerly, with the
two longer prompts prefilled in chunks (``CHUNK`` tokens a step, so later chunks start from the
state the earlier ones left); with decode steps replayed from CUDA graphs; and with compiled
decoder layers and steps launched ahead as well (the benchmark's engine). NaN in every free
state slot (the sink slot that padding rows use included), on the sink page and in the padding
rows' token embedding changes no token of a captured run, and an MoE hybrid starting from
transformers' experts loop runs experts a graph can hold. fp32: the torch backend's captured run
picks, at every step, a token the unpatched Hugging Face model (its torch kernels) ranks first
(within ``FP32_BOUND``), teacher-forced.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging

import pytest
import torch
from gpu_models import (
    HYBRID_MODELS,
    PROMPT_LENGTHS,
    assert_equal_but_near_ties,
    prompts,
    tokens,
)

import torch_cp
from torch_cp import compat
from torch_cp.graphs.experts import experts_modules
from torch_cp.state.kernels import fla_available

FAMILIES = list(HYBRID_MODELS)
CHUNK = 32  # max_tokens_per_step: the 40- and 70-token prompts prefill in chunks
# Rows finish at different steps, so later decode steps replay a bucket with padding rows.
NEW = [24, 12, 20, 16]
ENGINE = dict(num_pages=64, page_size=16, max_pages_per_row=8, max_rows=4,
              max_tokens_per_step=CHUNK)
# fp32, teacher-forced: how far below the unpatched model's best logit torch_cp's token may be.
# Both run transformers' torch kernels over other shapes (packed rows, other chunk bounds), and
# the float32 reassociation carried by the recurrent state reached 4e-4 on the CPU after six
# tokens (tests/models/test_hybrid.py); a stale, shifted or dropped state picks tokens the model
# ranks lower by far more (top-2 gaps on these paths are mostly > 0.1).
FP32_BOUND = 1e-2

needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="needs FlashInfer")
needs_fla = pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_available()),
    reason="needs flash-linear-attention (fla-core 0.6: fla.ops.gated_delta_rule), the gated "
           "DeltaNet kernels that backend='flashinfer' runs beside FlashInfer")
pytestmark = pytest.mark.gpu

_TRANSFORMERS_MODULES = ("qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe",
                         "qwen3_next.modeling_qwen3_next")
_KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update")


def patched(name: str, backend: str, dtype=torch.bfloat16):
    return torch_cp.patch_model(HYBRID_MODELS[name](dtype).cuda(), backend=backend)


def unpatched(name: str, dtype=torch.bfloat16):
    return HYBRID_MODELS[name](dtype).cuda()


@functools.cache
def reference(name: str) -> tuple[tuple[int, ...], ...]:
    """The unpatched model's bf16 greedy tokens, one prompt at a time.

    Not the torch reference backend's: transformers' torch gated delta rule and fla's kernels
    differ in bf16 by far more than FlashInfer and the torch attention do, and these random
    tiny models amplify it (run 45, one H200: teacher-forced over a 57-token sequence, the
    unpatched qwen3_5_moe_text's logits with fla against with the torch rule differ by up to
    4.3, and torch_cp's fla path against the unpatched model's by exactly 0). The torch
    backend is held to the unpatched model running the torch rule instead (the fp32 test)."""
    model = unpatched(name)
    with torch.inference_mode():
        out = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n,
                              do_sample=False)[0, len(p):].tolist()
               for p, n in zip(prompts(), NEW)]
    return tuple(tuple(t) for t in out)


def expected(name: str) -> list[list[int]]:
    return [list(t) for t in reference(name)]


@pytest.fixture
def fla_calls(monkeypatch):
    """Counts calls of fla's chunked kernel (multi-token steps) and of torch_cp's decode kernel
    (state/decode_kernel.py, which replaces fla's recurrent one in decode steps), and the most
    rows one chunked call packed (``cu_seqlens``)."""
    import fla.ops.gated_delta_rule as fla_gdr

    from torch_cp.state import decode_kernel

    calls = {"chunk": 0, "decode": 0, "chunk_rows": 0}

    def counted(key, fn):
        @functools.wraps(fn)  # transformers passes the keywords fn's signature names
        def wrapper(*args, **kwargs):
            calls[key] += 1
            if kwargs.get("cu_seqlens") is not None:
                calls["chunk_rows"] = max(calls["chunk_rows"], len(kwargs["cu_seqlens"]) - 1)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fla_gdr, "chunk_gated_delta_rule",
                        counted("chunk", fla_gdr.chunk_gated_delta_rule))
    monkeypatch.setattr(decode_kernel, "decode_step_in_place",
                        counted("decode", decode_kernel.decode_step_in_place))
    return calls


def padding_rows_seen(engine) -> list[int]:
    """Records, for every step planned into a captured bucket, its padding rows."""
    seen = []
    prepare = engine.runner.prepare

    def spy(q_lens, *args, **kwargs):
        plan = prepare(q_lens, *args, **kwargs)
        if plan is not None:
            seen.append(plan.bucket.rows - len(q_lens))
        return plan

    engine.runner.prepare = spy
    return seen


def poison(engine, used: set[int]) -> None:
    """NaN in every state slot but the zero slot (between runs all are free: every real row starts
    fresh, from the zero slot, never reading its own), on the sink page, and as the padding
    rows' token (an id outside ``used``) embedding, so padding rows compute NaN in every
    layer and write it to the sink slot and page."""
    embed = engine.model.get_input_embeddings().weight
    assert embed is not engine.model.get_output_embeddings().weight, "no NaN logits"
    nan_id = max(set(range(embed.shape[0])) - used)
    with torch.inference_mode():
        engine.state.conv[:, :engine.state.zero_slot] = float("nan")
        engine.state.recurrent[:, :engine.state.zero_slot] = float("nan")
        engine.pool.kv[:, engine.pool.sink_page] = float("nan")
        embed[nan_id] = float("nan")
    engine.runner.pad_token_id = nan_id


@needs_flashinfer
@needs_fla
@pytest.mark.parametrize("name", FAMILIES)
def test_fla_kernels_give_the_reference_tokens_with_prompts_in_chunks(name, fla_calls):
    assert max(PROMPT_LENGTHS) > CHUNK
    model = patched(name, "flashinfer")
    assert model.torch_cp.linear_kernels == "fla"
    engine = torch_cp.Engine(model, **ENGINE)
    got = tokens(engine.run(prompts(), NEW))
    assert fla_calls["chunk"] and fla_calls["decode"], fla_calls
    assert fla_calls["chunk_rows"] >= 2, "a multi-token step packs several rows"
    assert_equal_but_near_ties(unpatched(name), expected(name), got)


@needs_flashinfer
@needs_fla
@pytest.mark.parametrize("name", FAMILIES)
def test_captured_decode_gives_the_reference_tokens_and_nan_padding_stays_out(name, caplog):
    model = patched(name, "flashinfer")
    moe = bool(experts_modules(model))
    if moe:
        model.set_experts_implementation("eager")  # the loop a capture fails on
    with caplog.at_level(logging.WARNING, logger="torch_cp"):
        engine = torch_cp.Engine(model, **ENGINE, cuda_graphs=True)
    padding = padding_rows_seen(engine)
    clean = tokens(engine.run(prompts(), NEW))
    replayed = engine.replayed_steps
    assert replayed > 0 and max(padding) > 0, (replayed, padding)
    assert_equal_but_near_ties(unpatched(name), expected(name), clean)
    poison(engine, {t for stream in prompts() + clean for t in stream})
    dirty = tokens(engine.run(prompts(), NEW))
    assert engine.replayed_steps > replayed
    assert dirty == clean, "NaN padding (state slots, sink page, padding tokens) reached a real row"
    if moe:
        assert model.config.get_text_config()._experts_implementation == "torch_cp_fused"
        assert sum("switched to" in r.getMessage() for r in caplog.records) == 1


def torch_kernels_in_transformers(monkeypatch) -> None:
    """The unpatched models run transformers' torch kernels (the module-level names dispatch to
    fla and causal-conv1d when installed: fla's chunked kernel computes in tf32)."""
    for path in _TRANSFORMERS_MODULES:
        module = importlib.import_module(f"transformers.models.{path}")
        for fn in _KERNEL_NAMES:
            monkeypatch.setattr(module, fn, compat.unwrapped(getattr(module, fn), fn))


@torch.inference_mode()
def assert_teacher_forced(model, streams: list[list[int]], bound: float) -> None:
    """At every generated position, the unpatched ``model`` (fed the prompt and the stream so
    far) ranks the stream's token within ``bound`` of its best."""
    for prompt, stream in zip(prompts(), streams):
        ids = torch.tensor([prompt + stream], device="cuda")
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(-1, torch.tensor(stream, device="cuda")[:, None])[:, 0]
        short = logits.max(-1).values - chosen
        assert short.max().item() <= bound, (prompt, stream, short.tolist())


@pytest.mark.parametrize("name", FAMILIES)
def test_fp32_torch_backend_gives_the_unpatched_models_tokens(name, monkeypatch):
    """The reference backend itself on CUDA, its decode steps captured (transformers' torch
    kernels in the graph; MoE experts switched to batched_mm), against the unpatched model."""
    torch_kernels_in_transformers(monkeypatch)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the depthwise conv
    model = patched(name, "torch", torch.float32)
    engine = torch_cp.Engine(model, **ENGINE, cuda_graphs=True)
    got = tokens(engine.run(prompts(), NEW))
    assert engine.replayed_steps > 0
    assert_teacher_forced(unpatched(name, torch.float32), got, FP32_BOUND)


@needs_flashinfer
@needs_fla
@pytest.mark.parametrize("name", FAMILIES)
def test_captured_and_compiled_gives_the_reference_tokens(name):
    """The benchmark's engine: compiled layers (the prefill chunks too: the state ops are custom
    ops, opaque to Dynamo), CUDA graphs, steps launched ahead."""
    model = patched(name, "flashinfer")
    engine = torch_cp.Engine(model, **ENGINE, cuda_graphs=True, compile=True,
                             overlap_planning=True)
    got = tokens(engine.run(prompts(), NEW))
    assert engine.replayed_steps > 0
    assert_equal_but_near_ties(unpatched(name), expected(name), got)
