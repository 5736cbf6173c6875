"""Prefix caching in the engine (``Engine(..., prefix_caching=True)``, ``generate(...,
prefix_caching=True)``): prompts sharing a prefix longer than several pages, with distinct
suffixes, give the tokens of an engine without caching and of the unpatched model, in one run and
across two runs of one engine (the cache persists), with chunked prefill and a pool tight enough
that cached pages are evicted; a later request starts after its cached prefix (fewer prompt
tokens run through the model), no step writes a cached page, and every page returns. The
scheduler's admission promises hold with caching (a hypothesis test driving the scheduler alone),
and at P = 2 and 4 (TP and SP modes, gloo) tokens with caching equal tokens without."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from admission import WatchedCachingAllocator, drive, expected_end
from caching_checks import assert_caching_changes_nothing, caching_off_and_on, first_starts
from hypothesis import given, settings
from hypothesis import strategies as st
from multirank import run_ranks

import torch_cp
from torch_cp.engine import Engine
from torch_cp.engine.scheduler import Row, writes_shared_page
from torch_cp.kv import PrefixCachingAllocator
from torch_cp.mesh import init_mesh
from torch_cp.tiny import tiny_qwen3

PAGE = 4
PREFIX = [(7 * i) % 300 + 1 for i in range(22)]  # five full pages inside every prompt[:-1]
SUFFIXES = [[200], [201, 5], [202, 6, 7], [203, 8, 9, 10, 11, 12], [204, 13]]
PROMPTS = [PREFIX + s for s in SUFFIXES]
NEW = 5
PAGES = 12  # a lifetime is 6 to 8 pages: one or two requests at a time, cached pages evicted
BUDGET = 7  # tokens a step: prompts prefill in chunks


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the unpatched model, one prompt at a time."""
    model = tiny_qwen3()
    return [tuple(model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long)
                                 )[0, len(p):].tolist()) for p in PROMPTS]


def _watch(engine):
    """Record each planned step's rows, and count the cached pages evicted (pages a reserve
    took beyond the free list)."""
    rows, evicted = [], [0]
    plan, reserve, alloc = engine.launcher.plan, engine.allocator.reserve, engine.allocator

    def planned(step_rows, tables, state_slots=None):
        rows.append(list(step_rows))
        return plan(step_rows, tables, state_slots)

    def reserved(request, num_tokens):
        free_list = alloc.free_pages - alloc.evictable_pages
        missing = alloc.missing_pages(request, num_tokens)
        ok = reserve(request, num_tokens)
        evicted[0] += ok and max(0, missing - free_list)
        return ok
    engine.launcher.plan, alloc.reserve = planned, reserved
    return rows, evicted


def _prefilled(rows) -> int:
    """Prompt tokens the steps ran (from their rows: independent of the engine's count)."""
    return sum(max(0, min(r.start + r.length, len(PROMPTS[r.request])) - r.start)
               for step in rows for r in step)


def test_caching_keeps_tokens_in_one_run_and_across_runs(model, reference):
    plain = Engine(model, PAGES, PAGE, BUDGET)
    without = [r.token_ids for r in plain.run(PROMPTS, NEW)]
    engine = Engine(model, PAGES, PAGE, BUDGET, prefix_caching=True)
    rows, evicted = _watch(engine)
    first = [r.token_ids for r in engine.run(PROMPTS, NEW)]
    first_rows, rows[:] = list(rows), []
    second = [r.token_ids for r in engine.run(PROMPTS, NEW)]
    assert without == reference
    assert first == reference, "sharing within one run"
    assert second == reference, "sharing what an earlier run cached"
    assert evicted[0] > 0, "the pool is tight enough to evict cached pages"
    assert engine.allocator.free_pages == PAGES and engine.allocator.live_requests == []
    assert engine.allocator.evictable_pages > 0, "the cache outlives the run"

    total = sum(len(p) for p in PROMPTS)
    starts1, starts2 = (first_starts(r, len(PROMPTS)) for r in (first_rows, rows))
    assert _prefilled(first_rows) == total - sum(starts1) < total
    assert _prefilled(rows) == total - sum(starts2) < _prefilled(first_rows)
    assert engine.prefilled_tokens == _prefilled(first_rows) + _prefilled(rows)
    assert engine.reused_tokens == sum(starts1) + sum(starts2)
    assert starts1[0] == 0 and all(s >= 20 for s in starts1[2:]), starts1
    assert all(s >= 20 for s in starts2), starts2  # the shared prefix: 5 pages of 4
    assert all(s % PAGE == 0 and s < len(p) for s, p in zip(starts1 + starts2, PROMPTS * 2))


def test_prompts_admitted_together_share_their_prefix(model, reference):
    """With room for every prompt at once they were all admitted in the first step, and each
    prefilled the common prefix (helper 69). Now the others wait until the first one's prefix
    pages commit, then share them (as SGLang's in-batch prefix caching)."""
    engine = Engine(model, 64, PAGE, BUDGET, prefix_caching=True)
    rows, _ = _watch(engine)
    assert [r.token_ids for r in engine.run(PROMPTS, NEW)] == reference
    starts = first_starts(rows, len(PROMPTS))
    assert starts[0] == 0 and all(s >= 20 for s in starts[1:]), starts
    assert engine.prefilled_tokens == _prefilled(rows) == sum(map(len, PROMPTS)) - sum(starts)


def test_caching_with_steps_launched_ahead_keeps_tokens(model, reference):
    engine = Engine(model, PAGES, PAGE, BUDGET, overlap_planning=True, prefix_caching=True)
    for _ in range(2):
        assert [r.token_ids for r in engine.run(PROMPTS, NEW)] == reference
    assert engine.launched_ahead_steps > 0 and engine.reused_tokens > 0
    assert engine.allocator.free_pages == PAGES and engine.allocator.live_requests == []


def test_generate_with_prefix_caching(model, reference):
    results = torch_cp.generate(model, PROMPTS, NEW, page_size=PAGE, max_tokens_per_step=BUDGET,
                                num_pages=PAGES, progress=False, prefix_caching=True)
    assert [r.token_ids for r in results] == reference


def test_engine_refuses_a_non_bool_prefix_caching_with_the_other_problems(model):
    with pytest.raises(ValueError, match="num_pages.*prefix_caching must be True or False"):
        Engine(model, 0, PAGE, prefix_caching="yes")


def test_a_row_into_a_cached_page_is_caught():
    alloc = PrefixCachingAllocator(8, PAGE)
    prompt = list(range(1, 11))
    assert alloc.admit(0, prompt) == 0 and alloc.reserve(0, 10)
    assert alloc.register(0, prompt) == 2
    alloc.release(0)
    assert alloc.admit(1, prompt) == 8 and alloc.reserve(1, 10)
    assert not writes_shared_page(alloc, [Row(1, 8, 2, True)])
    assert writes_shared_page(alloc, [Row(1, 4, 6, True)])


def test_a_failed_reserve_after_admit_is_undone_by_release():
    alloc = PrefixCachingAllocator(4, PAGE)
    prompt = list(range(1, 11))
    alloc.admit(0, prompt)
    assert alloc.reserve(0, 10)
    alloc.register(0, prompt)
    alloc.release(0)
    before = alloc.state()
    assert alloc.admit(1, prompt) == 8
    assert not alloc.reserve(1, 20), "5 pages of a pool of 4"
    alloc.release(1)
    assert alloc.state() == before and alloc.free_pages == 4


# The scheduler alone, through the engine's protocol (tests/helpers/admission.py), with caching:
# promises are kept.
@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9), st.integers(1, 8),
                                   st.integers(0, 6)), min_size=1, max_size=7),
       page_size=st.sampled_from([1, 2, 4]), spare=st.integers(0, 4), budget=st.integers(1, 12),
       max_rows=st.sampled_from([None, 1, 2, 3]), seed=st.integers(0, 2**16))
def test_admission_with_caching_keeps_every_promise(requests, page_size, spare, budget,
                                                    max_rows, seed):
    """Requests (family of shared prefix, suffix length, max_new_tokens, arrival step); EOS
    after a number of tokens derived from the request; retries and foreseen steps at random.
    Shared pages are held as often as their reference counts say and never written."""
    families = [[1 + (f * 5 + k) % 11 for k in range(9)] for f in range(3)]
    prompts = [families[f][:3 + n % 7] + [20 + i] * (n // 3) for i, (f, n, _, _) in
               enumerate(requests)]
    runs = [(p, new, (i + n) % 7, at) for i, (p, (_, n, new, at)) in
            enumerate(zip(prompts, requests))]
    need = max(-(-(len(p) + r[2] - 1) // page_size) for p, r in zip(prompts, requests))
    alloc = WatchedCachingAllocator(need + spare, page_size)
    ended = drive(runs, alloc, budget, max_rows, seed)
    assert ended == {i: expected_end(new, eos) for i, (_, new, eos, _) in enumerate(runs)}


# P = 2 and P = 4 over gloo ranks, TP mode and SP mode in one spawn each (every partner of the
# tiny model's one KV head: P = world).
MESHES = {"tp": lambda world: dict(tp=world, sp=1), "sp": lambda world: dict(tp=1, sp=world)}


def _ranks(rank: int, world_size: int):
    out = {}
    for mode, sizes_of in MESHES.items():
        sizes = sizes_of(world_size)
        mesh = init_mesh(**sizes, device_type="cpu")
        model = torch_cp.patch_model(tiny_qwen3(), context_parallel=True, mesh=mesh, mode=mode,
                                     page_size=PAGE)
        out[mode] = caching_off_and_on(model, PROMPTS, NEW, PAGES, PAGE, BUDGET)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("partners", [2, 4])
def test_tokens_with_caching_equal_tokens_without_at_p(reference, partners):
    assert_caching_changes_nothing(run_ranks(partners, _ranks), MESHES, reference, PAGES)


def test_weights_loaded_since_empty_the_cache_and_the_reset_is_public():
    """A cached page holds KV of the weights of its time: after ``load_state_dict`` of other
    weights the same engine reused it and gave other tokens than a fresh engine's (helper 110).
    Now a run, or an idle serving step, empties the cache first; ``reset_prefix_cache``
    empties it by hand, and refuses (False) while a request is queued or running."""
    def greedy(model, prompt):
        return tuple(model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long)
                                    )[0, len(prompt):].tolist())
    old, new = tiny_qwen3(seed=0), tiny_qwen3(seed=1)
    prompt = PROMPTS[0]
    want_old, want_new = greedy(old, prompt), greedy(new, prompt)
    assert want_old != want_new
    model = torch_cp.patch_model(tiny_qwen3(seed=0))
    engine = Engine(model, 64, PAGE, BUDGET, prefix_caching=True)
    assert engine.run([prompt], NEW)[0].token_ids == want_old
    model.load_state_dict(new.state_dict())
    assert engine.run([prompt], NEW)[0].token_ids == want_new
    assert engine.reused_tokens == 0, "nothing of the old weights' KV reused"
    assert engine.run([prompt], NEW)[0].token_ids == want_new
    assert engine.reused_tokens >= 20, "the new weights' KV is cached and reused"

    model.load_state_dict(old.state_dict())  # the serving API: emptied at an idle step
    rid = engine.submit(prompt, NEW)
    tokens = [t for out in engine.stream() for t in out.token_ids if out.request_id == rid]
    assert tuple(tokens) == want_old
    replaced = weakref.ref(model.model.layers[0].mlp.down_proj.weight)
    model.load_state_dict(new.state_dict(), assign=True)  # replaced, not written
    rid = engine.submit(prompt, NEW)
    tokens = [t for out in engine.stream() for t in out.token_ids if out.request_id == rid]
    assert tuple(tokens) == want_new
    gc.collect()
    assert replaced() is None, "the engine keeps no replaced weight alive"
    engine.submit(prompt, NEW)
    engine.step()
    held = engine.allocator.state()
    assert engine.reset_prefix_cache() is False and engine.allocator.state() == held
    list(engine.stream())
    assert engine.allocator.evictable_pages > 0
    assert engine.reset_prefix_cache() is True and engine.allocator.evictable_pages == 0
    assert engine.allocator.free_pages == 64


def _loaded_on_rank0_and_broadcast(rank: int, world_size: int):
    """SP mode (the whole model on every rank): a run caches the prompt; rank 0 alone loads
    other weights and broadcasts them, which bumps no version counter on rank 1."""
    import torch.distributed as dist

    mesh = init_mesh(tp=1, sp=world_size, device_type="cpu")
    model = torch_cp.patch_model(tiny_qwen3(seed=0), context_parallel=True, mesh=mesh,
                                 mode="sp", page_size=PAGE)
    engine = Engine(model, 64, PAGE, BUDGET, prefix_caching=True)
    first = engine.run([PROMPTS[0]], NEW)[0].token_ids
    if rank == 0:
        model.load_state_dict(tiny_qwen3(seed=1).state_dict())
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)
    second = engine.run([PROMPTS[0]], NEW)[0].token_ids
    return first, second, engine.reused_tokens


@pytest.mark.slow
def test_weights_loaded_on_one_rank_and_broadcast_empty_every_ranks_cache(reference):
    """The run's gather empties the cache on every rank where any rank's weights changed (a
    comparison of the ranks' views refused every later run, naming an argument the user never
    passed: helper 111)."""
    new = tiny_qwen3(seed=1)
    want = tuple(new.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW, do_sample=False,
                              attention_mask=torch.ones(1, len(PROMPTS[0]), dtype=torch.long)
                              )[0, len(PROMPTS[0]):].tolist())
    for first, second, reused in run_ranks(2, _loaded_on_rank0_and_broadcast):
        assert (first, second, reused) == (reference[0], want, 0)
