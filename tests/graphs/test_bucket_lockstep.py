"""Invariant 3 for captured buckets, checked eagerly on CPU: a bucket's step issues the same
collectives (op, shape, dtype, order) on every partner and whatever real rows fill it, so the
collectives a graph captured from an all-padding step replay in lockstep; and a padded step's
real rows give the logits of the unpadded step."""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks

import torch_cp
from torch_cp.compat import cache_kwarg
from torch_cp.plan import Bucket, build_step_plan

pytestmark = pytest.mark.slow  # spawns gloo ranks

PAGE = 8
WIDTH = 8  # page-table width of the buckets
BUCKETS = [Bucket(4, 4, 4 * WIDTH), Bucket(4, 32, 4 * WIDTH)]
TOL = dict(atol=1e-4, rtol=1e-4)  # fp32: padding changes only the summation order


def _logits(model, cache, token_ids, q_lens, ctx_lens, tables, bucket=None):
    plan = build_step_plan(q_lens, ctx_lens, tables, page_size=PAGE,
                           sink_page=cache.pool.sink_page, placement=model.torch_cp.placement,
                           bucket=bucket)
    cache.begin_step(plan)
    ids = torch.zeros(1, plan.positions.shape[0], dtype=torch.long)
    ids[0, : len(token_ids)] = torch.tensor(token_ids, dtype=torch.long)
    ends = plan.qo_indptr_host[1: len(q_lens) + 1].long() - 1
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=plan.positions[None], use_cache=False,
                    logits_to_keep=ends, **{cache_kwarg(model): cache})
    return out.logits[0]


def _on_rank(rank: int, world: int, mode: str):
    mesh = torch_cp.init_mesh(tp=world if mode == "tp" else 1, sp=world if mode == "sp" else 1,
                              device_type="cpu")
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), context_parallel=True, mesh=mesh,
                                 mode=mode, page_size=PAGE)
    records = model.torch_cp.exchange.records = []
    cache = torch_cp.PagedKVCache.for_model(model, num_pages=32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 19, 2)]
    tables = [list(range(i * WIDTH, (i + 1) * WIDTH)) for i in range(3)]
    _logits(model, cache, sum(prompts, []), [7, 19, 2], [0, 0, 0], tables)
    out = {}
    for bucket in BUCKETS:
        steps = [([], [], [], [])]  # the all-padding step a capture runs
        if bucket.decode:
            steps += [([5, 6, 7], [1, 1, 1], [7, 19, 2], tables), ([8], [1], [8], tables[:1])]
        else:
            steps += [([5, 6, 7, 8, 9], [2, 3], [7, 19], tables[:2]),
                      ([1] * 20, [20], [2], tables[2:])]
        per_step, padded, plain = [], [], []
        for step in steps:
            del records[:]
            logits = _logits(model, cache, *step, bucket=bucket)
            per_step.append([(r.op, r.shape, str(r.dtype)) for r in records])
            if step[1]:
                padded.append(logits)
                plain.append(_logits(model, cache, *step))  # rewrites the same K/V
        out[bucket] = per_step, padded, plain
    return out


@pytest.fixture(scope="module", params=["tp", "sp"])
def ranks(request):
    return run_ranks(2, _on_rank, request.param)


@pytest.mark.parametrize("bucket", BUCKETS, ids=str)
def test_bucket_collectives_match_across_partners_and_contents(ranks, bucket):
    first = ranks[0][bucket][0]
    assert first[0], "a placed step exchanges partials"
    for rank, result in enumerate(ranks):
        per_step = result[bucket][0]
        assert per_step == first, f"rank {rank} differs from rank 0"
        for step in per_step[1:]:
            assert step == per_step[0], "a bucket's collectives depend on its real rows"


@pytest.mark.parametrize("bucket", BUCKETS, ids=str)
def test_padded_bucket_step_equals_unpadded(ranks, bucket):
    for result in ranks:
        _, padded, plain = result[bucket]
        for p, q in zip(padded, plain):
            torch.testing.assert_close(p, q, **TOL)
