"""torch.compile(fullgraph=True) of a patched model: the backend kernels are custom ops, the
exchange is functional collectives, so the whole step traces as one graph; compiled logits
equal eager logits within fp32 reassociation (1e-4 on O(1-10) logits; observed ~2e-6)."""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks

import torch_cp
from torch_cp.plan import build_step_plan

PAGE = 8
TOL = dict(atol=1e-4, rtol=1e-4)


def _step(model, cache, forward, tokens, q_lens, ctx_lens, tables):
    plan = build_step_plan(q_lens, ctx_lens, tables, page_size=PAGE,
                           sink_page=cache.pool.sink_page, placement=model.torch_cp.placement)
    cache.begin_step(plan)
    ends = plan.qo_indptr_host[1:].long() - 1
    with torch.inference_mode():
        out = forward(input_ids=torch.tensor([tokens]), position_ids=plan.positions[None],
                      use_cache=False, logits_to_keep=ends, cache=cache)
    return out.logits[0]


def eager_and_compiled(model):
    """Logits of a prefill step and a decode step, eager and compiled, each on its own pool."""
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (13,), generator=g).tolist()
    steps = [(prompt, [6, 7], [0, 0], [[0], [1]]), ([5, 9], [1, 1], [6, 7], [[0], [1]])]
    results = []
    for forward in (model.forward, compiled):
        cache = torch_cp.PagedKVCache.for_model(model, num_pages=4, page_size=PAGE)
        results.append([_step(model, cache, forward, *s) for s in steps])
    return results


def test_compiled_model_equals_eager():
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), page_size=PAGE)
    eager, compiled = eager_and_compiled(model)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, **TOL)


def _on_rank(rank: int, world: int):
    mesh = torch_cp.init_mesh(tp=world, device_type="cpu")
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), context_parallel=True, mesh=mesh,
                                 page_size=PAGE)
    return eager_and_compiled(model)


@pytest.mark.slow
def test_compiled_placed_model_equals_eager_over_two_partners():
    for rank, (eager, compiled) in enumerate(run_ranks(2, _on_rank)):
        for e, c in zip(eager, compiled):
            torch.testing.assert_close(c, e, **TOL, msg=lambda m, r=rank: f"rank {r}: {m}")
