"""The engine through its captured buckets against the same engine run eagerly, on the CPU
(``cpu_graphs.EagerReplayRunner``: the real runner's static plans and inputs, its replay an
eager forward over them that sees the capture step's host values, as a graph does). Every step
a bucket fits reuses that bucket's static buffers, padding rows and table columns of earlier
steps included, with and without prefix caching and steps launched ahead, for a dense GQA, a
hybrid and an MLA model, and through the serving API with an abort, a stop token and a late
submission. float32: tokens equal; log-probabilities within
1e-4 (a padded step's GEMMs are larger than the eager step's, so their sums may associate
differently: about 1e-6 here)."""

from __future__ import annotations

import pytest
import torch
from cpu_graphs import with_eager_buckets
from driver import sampled_in_turn
from mla_models import tiny_config, tiny_model

import torch_cp
from torch_cp.engine import Engine
from torch_cp.graphs import default_buckets

PAGE = 4
NEWS = [6, 14, 4, 10, 12, 3, 8]


def _prompts(vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (37, 3, 18, 9, 2, 25)]
    return prompts + [prompts[0][:20] + [5, 6, 7]]  # shares four pages with the first


def _engines(model, mixed=((4, 16),), **kwargs) -> tuple[Engine, Engine]:
    """(eager, through buckets of up to 8 decode rows and the ``mixed`` ones), each a fresh
    pool. A hybrid model gets none mixed, as ``Engine`` refuses them for it."""
    eager = Engine(model, 200, PAGE, 16, **kwargs)
    buckets = Engine(model, 200, PAGE, 16, **kwargs)
    with_eager_buckets(buckets, default_buckets(8, 16, mixed=mixed))
    return eager, buckets


def _assert_same(want, have) -> None:
    assert [r.token_ids for r in want] == [r.token_ids for r in have]
    for a, b in zip(want, have):
        if a.logprobs is not None:
            torch.testing.assert_close(torch.tensor([x[0] for x in b.logprobs]),
                                       torch.tensor([x[0] for x in a.logprobs]),
                                       rtol=0, atol=1e-4)


@pytest.mark.parametrize("caching, overlap", [(False, False), (True, True)])
def test_bucket_steps_give_the_eager_tokens(caching, overlap):
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), page_size=PAGE)
    eager, buckets = _engines(model, prefix_caching=caching, overlap_planning=overlap)
    want = eager.run(_prompts(), NEWS, logprobs=2)
    have = buckets.run(_prompts(), NEWS, logprobs=2)
    assert buckets.replayed_steps >= 10 and eager.replayed_steps == 0
    _assert_same(want, have)
    _assert_same(want, buckets.run(_prompts(), NEWS, logprobs=2))  # the buffers of a run before
    assert buckets.allocator.free_pages == eager.allocator.free_pages


@pytest.mark.parametrize("family", ["qwen3_5", "glm4_moe_lite"])
def test_hybrid_and_mla_bucket_steps_give_the_eager_tokens(family):
    if family == "qwen3_5":  # state slots through the static plan; checkpoints with caching
        model, vocab, mixed = torch_cp.tiny_qwen3_5(), 300, ()
    else:
        model, vocab, mixed = tiny_model(tiny_config(family)), 127, ((4, 16),)
    model = torch_cp.patch_model(model, page_size=PAGE)
    eager, buckets = _engines(model, mixed, prefix_caching=True, max_rows=8)
    want = eager.run(_prompts(vocab), NEWS)
    have = buckets.run(_prompts(vocab), NEWS)
    assert buckets.replayed_steps >= (10 if mixed else 6)  # decode steps alone: 7
    _assert_same(want, have)


def _serve(engine: Engine, prompts: list[list[int]]) -> dict:
    stop = prompts[0][3]
    ids = [engine.submit(p, n, stop_token_ids=[stop], logprobs=1) for p, n in zip(prompts, NEWS)]
    out = {i: [] for i in ids}
    for step in range(10**4):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out[o.request_id].append((o.token_ids, o.finish_reason))
        if step == 2:
            engine.abort(ids[1])
        if step == 4:
            out[engine.submit(prompts[0][:17] + [9], 7)] = []
    raise AssertionError("the engine never finished")


def test_serving_through_buckets_gives_the_eager_outputs():
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), page_size=PAGE)
    eager, buckets = _engines(model, prefix_caching=True, overlap_planning=True)
    want, have = _serve(eager, _prompts()), _serve(buckets, _prompts())
    assert buckets.replayed_steps >= 10
    assert [[t for t, _ in v] for v in want.values()] == [[t for t, _ in v]
                                                          for v in have.values()]
    assert [v[-1][1] for v in want.values()] == [v[-1][1] for v in have.values()]
    assert "abort" in [v[-1][1] for v in have.values()]


def test_bucket_engines_stepped_in_turn_keep_their_own_plans():
    """Two engines through buckets on one model, sampling with steps planned ahead, stepped in
    turn: each step's launch plans the model's backend again for its own cache (a graph replay
    runs no Python: the stand-in replay plans nothing either). Each request's tokens are the
    ones it gets alone (helper 111: no test covered a launch's claim for a bucket step)."""
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), page_size=PAGE)

    def engine():
        e = Engine(model, 200, PAGE, 16, overlap_planning=True)
        with_eager_buckets(e, default_buckets(8, 16, mixed=((4, 16),)))
        return e

    prompts = _prompts()[:2]
    alone = [sampled_in_turn([engine()], [p], 12)[0] for p in prompts]
    pair = [engine(), engine()]
    assert sampled_in_turn(pair, prompts, 12) == alone
    assert all(e.replayed_steps >= 8 and e.planned_ahead_steps > 0 for e in pair)
