"""Overlapping steps (``Engine(overlap_planning=True)``): the scheduler foresees the next decode
step exactly when no request stops at EOS; with greedy sampling the engine launches it, fed the
running step's tokens on the device, before those reach the host. Tokens are the same as without
overlap, whether the guess holds, a request stops at EOS (its row of the step launched ahead is
dropped) or every request stops at once (the step launched ahead is drained)."""

import pytest
import torch
from driver import sampled_in_turn
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_cp.engine import Engine
from torch_cp.engine.sampling import SamplingParams
from torch_cp.engine.scheduler import Request, Scheduler
from torch_cp.kv import PageAllocator

PROMPTS = [[42], [200, 3, 150, 7, 99], list(range(1, 20)), [(7 * i) % 300 + 1 for i in range(40)]]
NEW = [12, 5, 9, 12]


def test_next_decode_rows_is_what_schedule_returns_next():
    """Foreseen exactly when the step is all decode rows and some row continues; the rows'
    pages are reserved (a row may cross into a new page), and the next ``schedule`` returns the
    foreseen rows."""
    alloc = PageAllocator(num_pages=40, page_size=4)
    scheduler = Scheduler(alloc, max_tokens_per_step=64)
    for i, (prompt, new) in enumerate(zip(PROMPTS, NEW)):
        scheduler.add(Request(i, list(prompt), new))
    foreseen = crossing = 0
    while not scheduler.done:
        rows = scheduler.schedule()
        decode = all(r.length == 1 and scheduler.running[r.request].decoding for r in rows)
        continuing = [r for r in rows if len(scheduler.running[r.request].generated) + 1
                      < scheduler.running[r.request].max_new_tokens]
        missing = sum(alloc.missing_pages(r.request, r.start + 2) for r in continuing)
        free = alloc.free_pages
        guess = scheduler.next_decode_rows(rows)
        assert (guess is not None) == (decode and bool(continuing))
        if guess is not None:
            assert all(alloc.missing_pages(r.request, r.start + 1) == 0 for r in guess)
            assert free - alloc.free_pages == missing, "exactly the pages the rows grow into"
            crossing += missing > 0
        tokens = {r.request: 1000 + r.request for r in rows if r.samples}
        scheduler.commit(rows, tokens, eos_token_ids=frozenset())
        if guess is not None:
            foreseen += 1
            assert scheduler.schedule() == guess
    assert foreseen >= 5 and crossing >= 2, "steady decode steps are foreseen, page crossings too"
    assert alloc.free_pages == 40


def test_eos_makes_the_guess_wrong_and_a_request_that_could_enter_stops_guessing():
    alloc = PageAllocator(num_pages=6, page_size=4)
    scheduler = Scheduler(alloc, max_tokens_per_step=64)
    scheduler.add(Request(0, [1, 2], 6))
    scheduler.add(Request(1, [3], 6))
    scheduler.commit(scheduler.schedule(), {0: 5, 1: 5}, frozenset())  # prefill
    rows = scheduler.schedule()
    guess = scheduler.next_decode_rows(rows)
    assert [r.request for r in guess] == [0, 1]
    scheduler.commit(rows, {0: 9, 1: 5}, eos_token_ids=frozenset({9}))  # request 0 stops
    assert scheduler.schedule() != guess
    scheduler.add(Request(2, list(range(1, 18)), 2))  # 5 pages: request 1 keeps 2 of 6, waits
    rows = scheduler.schedule()
    assert [r.index for r in scheduler.waiting] == [2]
    assert [(r.request, r.length) for r in rows] == [(1, 1)], "a plain decode step"
    steps = 0
    while (guess := scheduler.next_decode_rows(rows)) is not None:  # request 2 cannot enter
        scheduler.commit(rows, {1: 5}, frozenset())
        rows, steps = scheduler.schedule(), steps + 1
        assert rows == guess and [r.index for r in scheduler.waiting] == [2]
    # Request 1's last token is this step's: its pages would admit request 2, so no guess.
    assert steps == 3 and len(scheduler.running[1].generated) == 5
    scheduler.commit(rows, {1: 5}, frozenset())
    assert [(r.request, r.length) for r in scheduler.schedule()] == [(2, 17)]


def _drive(requests, num_pages: int, page_size: int, eos_after: dict[int, int], ahead: bool,
           max_rows: int | None = None):
    """The engine's protocol on the scheduler alone: each step's rows are the ones launched
    ahead during the previous step when there are any (``Engine._overlap``), else
    ``schedule()``; a request's token stream is fixed, EOS after ``eos_after[i]`` tokens.
    Returns each request's tokens and finish reason; checks the pages at every step."""
    alloc = PageAllocator(num_pages, page_size)
    scheduler = Scheduler(alloc, max_tokens_per_step=7, max_rows=max_rows)
    for index, (prompt, new) in enumerate(requests):
        scheduler.add(Request(index, [1] * prompt, new))
    ended, inflight = {}, None
    while not scheduler.done:
        current, inflight = inflight or scheduler.schedule(), None
        live = [r for r in current if r.request in scheduler.running]
        if ahead:
            inflight = scheduler.next_decode_rows(live)
        tokens = {r.request: 9 if len(scheduler.running[r.request].generated) + 1
                  == eos_after.get(r.request) else 5 for r in live if r.samples}
        for request, reason in scheduler.commit(live, tokens, frozenset({9})):
            ended[request.index] = (tuple(request.generated), reason)
        held = sum(len(alloc.table(i)) for i in scheduler.running)
        assert held + alloc.free_pages == num_pages, "no page lost or held twice"
        for request in scheduler.running.values():
            held = len(alloc.table(request.index))
            assert held <= alloc.pages_for(request.lifetime_tokens), "within the promise"
            assert held * page_size >= request.cached
    assert alloc.free_pages == num_pages
    return ended


@settings(max_examples=80, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 9)), min_size=1,
                         max_size=5),
       eos=st.lists(st.integers(1, 9), min_size=5, max_size=5), spare=st.integers(0, 6),
       max_rows=st.sampled_from([None, 1, 2, 3]))
def test_launching_ahead_ends_every_request_as_without_it(requests, eos, spare, max_rows):
    """Random prompts, lengths, EOS positions, pool sizes and row caps (some requests wait for
    pages or a row): launching ahead gives every request the tokens and finish reason it gets
    without, never loses or double-holds a page, never takes more than admission promised, and
    returns every page."""
    page_size = 4
    need = max(-(-(p + n - 1) // page_size) for p, n in requests)
    eos_after = dict(enumerate(eos))
    plain = _drive(requests, need + spare, page_size, eos_after, ahead=False, max_rows=max_rows)
    assert _drive(requests, need + spare, page_size, eos_after, True, max_rows) == plain


CASES = {
    "greedy": dict(engine=dict(num_pages=64, page_size=4), run={}),
    "eos": dict(engine=dict(num_pages=64, page_size=4), run=dict(eos=3)),
    "eos ends the run": dict(engine=dict(num_pages=64, page_size=4), run=dict(eos=0, only=0)),
    "sampling": dict(engine=dict(num_pages=64, page_size=8),
                     run=dict(sampling=SamplingParams(temperature=1.0, top_k=40, seed=3))),
    "tight pool, chunks": dict(engine=dict(num_pages=8, page_size=8, max_tokens_per_step=6),
                               run={}),
    "queue for rows": dict(engine=dict(num_pages=64, page_size=4, max_rows=2), run=dict(eos=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_planning_gives_the_same_tokens(model, case):
    spec = CASES[case]
    prompts, new = PROMPTS, NEW
    if "only" in spec["run"]:
        prompts, new = [PROMPTS[spec["run"]["only"]]], NEW[spec["run"]["only"]]
    eos = ()
    if "eos" in spec["run"]:  # a token of one request's stream, which stops it (and maybe others)
        plain = Engine(model, **spec["engine"]).run(PROMPTS, NEW)
        eos = (plain[spec["run"]["eos"]].token_ids[4],)
    sampling = spec["run"].get("sampling", SamplingParams())
    runs = {}
    for overlap in (False, True):
        engine = Engine(model, **spec["engine"], overlap_planning=overlap)
        for _ in range(2):  # a second run on the same engine: nothing left over from the first
            results = engine.run(prompts, new, sampling, eos)
            runs.setdefault(overlap, []).append(
                [(r.token_ids, r.finish_reason) for r in results])
        assert engine.allocator.free_pages == spec["engine"]["num_pages"]
        counts = (engine.planned_ahead_steps, engine.launched_ahead_steps)
        if not overlap:
            assert counts == (0, 0)
        elif sampling.greedy:
            assert counts[1] > 0 and counts[1] == counts[0], "planned ahead and launched at once"
            if case == "queue for rows":  # also while requests wait for a row (20 of 48 before)
                assert counts[1] >= 0.7 * engine.steps
        else:
            assert counts[0] > 0 and counts[1] == 0, "host sampling: planned ahead only"
    assert runs[True] == runs[False] and runs[True][0] == runs[True][1]
    if eos:
        assert any(reason == "eos" for _, reason in runs[True][0])
    if case == "eos ends the run":
        assert all(reason == "eos" for _, reason in runs[True][0])


def test_a_step_planned_ahead_survives_another_plan_of_the_shared_backend(model):
    """A sampled step is planned ahead and launched at the next ``step``; the attention backend
    is the model's, so two engines stepped in turn, or a ``model.generate`` between steps, plan
    it for their own steps in between. Each request's tokens are the ones it gets alone (helper
    109: other tokens from the fourth on, or a shape error in the backend)."""
    def engine():
        return Engine(model, num_pages=32, page_size=4, overlap_planning=True)

    first, second = PROMPTS[2], PROMPTS[1]
    alone = [sampled_in_turn([engine()], [p], 10)[0] for p in (first, second)]
    a, b = engine(), engine()
    assert sampled_in_turn([a, b], [first, second], 10) == alone
    assert a.planned_ahead_steps > 0 and b.planned_ahead_steps > 0
    c = engine()
    ids = torch.tensor([[5, 6, 7]])
    assert sampled_in_turn([c], [first], 10, lambda: model.generate(
        ids, max_new_tokens=1, do_sample=False, pad_token_id=0))[0] == alone[0]
    assert all(e.allocator.free_pages == 32 for e in (a, b, c))
