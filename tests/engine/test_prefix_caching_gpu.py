"""Prefix caching on the GPU: FlashInfer kernels and CUDA graphs (decode steps replayed), dense
Qwen3 and the hybrid Qwen3.5 (flash-linear-attention beside FlashInfer, its prefix reused from
state checkpoints).

Prompts share a prefix of five pages with distinct suffixes; the first request runs alone and
writes the prefix, the rest follow (``max_rows``), and the engine runs them twice (the cache
persists). With caching the later requests start after the cached prefix, every page and state
slot returns, and the tokens are an engine's without caching: in fp32 (torch backend, graphs)
exactly; in bf16 (FlashInfer) equal but for near-ties of the unpatched model
(``gpu_models.near_tie``), since the cached KV and the suffix's prefill come from GEMMs over other
row counts than a prefill of the whole prompt.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_models import HYBRID_MODELS, assert_equal_but_near_ties, qwen3

import torch_cp
from torch_cp.state.kernels import fla_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs FlashInfer"),
]

PAGE = 16
PREFIX = [(13 * i) % 290 + 3 for i in range(5 * PAGE + 7)]
PROMPTS = [PREFIX + [300 + i] + list(range(4 + i, 4 + 3 * i)) for i in range(6)]
NEW = 12
ENGINE = dict(num_pages=96, page_size=PAGE, max_tokens_per_step=48, max_rows=2,
              max_pages_per_row=8, cuda_graphs=True)


def build(name: str, dtype):
    model = qwen3(dtype) if name == "qwen3" else HYBRID_MODELS[name](dtype)
    return model.cuda()


def streams(model, caching: bool) -> tuple[list[list[int]], list[list[int]], torch_cp.Engine]:
    engine = torch_cp.Engine(model, **ENGINE, prefix_caching=caching)
    runs = [[list(r.token_ids) for r in engine.run(PROMPTS, NEW)] for _ in range(2)]
    assert engine.replayed_steps > 0
    assert engine.allocator.free_pages == ENGINE["num_pages"]
    assert engine.allocator.live_requests == []
    return runs[0], runs[1], engine


@pytest.mark.parametrize("name, backend, dtype", [
    ("qwen3", "torch", torch.float32),
    ("qwen3", "flashinfer", torch.bfloat16),
    pytest.param("qwen3_5_text", "flashinfer", torch.bfloat16, marks=pytest.mark.skipif(
        not fla_available(), reason="needs flash-linear-attention")),
], ids=["qwen3-fp32-torch", "qwen3-bf16-flashinfer", "qwen3_5-bf16-fla"])
def test_caching_with_graphs_gives_the_tokens_without(name, backend, dtype):
    model = torch_cp.patch_model(build(name, dtype), backend=backend, page_size=PAGE)
    plain, plain_again, _ = streams(model, caching=False)
    first, second, engine = streams(model, caching=True)
    assert plain_again == plain
    # The prefix's five pages, by every request but the two of the first run's first step.
    assert engine.reused_tokens >= (2 * len(PROMPTS) - ENGINE["max_rows"]) * 5 * PAGE
    if dtype == torch.float32:
        assert first == plain and second == plain
        return
    reference = build(name, dtype)
    assert_equal_but_near_ties(reference, plain, first, PROMPTS)
    assert_equal_but_near_ties(reference, plain, second, PROMPTS)
