"""Planning the next decode step while the current one runs (``Engine(overlap_planning=True)``):
the scheduler foresees the next step exactly when no request stops at EOS, and the engine gives
the same tokens with and without it, re-planning whenever the foreseen step does not come."""

import pytest

import torch_cp
from torch_cp.engine import Engine
from torch_cp.kv import PageAllocator
from torch_cp.sampling import SamplingParams
from torch_cp.scheduler import Request, Scheduler
from torch_cp.tiny import tiny_qwen3

PROMPTS = [[42], [200, 3, 150, 7, 99], list(range(1, 20)), [(7 * i) % 300 + 1 for i in range(40)]]
NEW = [12, 5, 9, 12]


def test_next_decode_rows_is_what_schedule_returns_next():
    """Foreseen exactly when the step is all decode rows and no row needs a new page; then the
    next ``schedule`` returns the foreseen rows."""
    alloc = PageAllocator(num_pages=40, page_size=4)
    scheduler = Scheduler(alloc, max_tokens_per_step=64)
    for i, (prompt, new) in enumerate(zip(PROMPTS, NEW)):
        scheduler.add(Request(i, list(prompt), new))
    foreseen = 0
    while not scheduler.done:
        rows = scheduler.schedule()
        guess = scheduler.next_decode_rows(rows)
        decode = all(r.length == 1 and scheduler.running[r.request].decoding for r in rows)
        continuing = [r for r in rows if len(scheduler.running[r.request].generated) + 1
                      < scheduler.running[r.request].max_new_tokens]
        new_page = any(len(alloc.table(r.request)) * 4 < r.start + 2 for r in continuing)
        assert (guess is not None) == (decode and not new_page and bool(continuing))
        tokens = {r.request: 1000 + r.request for r in rows if r.samples}
        scheduler.commit(rows, tokens, eos_token_ids=frozenset())
        if guess is not None:
            foreseen += 1
            assert scheduler.schedule() == guess
    assert foreseen >= 5, "steady decode steps are foreseen"


def test_eos_makes_the_guess_wrong_and_waiting_requests_stop_guessing():
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
    assert scheduler.next_decode_rows(rows) is None


@pytest.fixture(scope="module")
def model():
    return torch_cp.patch_model(tiny_qwen3())


CASES = {
    "greedy": dict(engine=dict(num_pages=64, page_size=4), run={}),
    "eos": dict(engine=dict(num_pages=64, page_size=4), run=dict(eos=True)),
    "sampling": dict(engine=dict(num_pages=64, page_size=8),
                     run=dict(sampling=SamplingParams(temperature=1.0, top_k=40, seed=3))),
    "tight pool, chunks": dict(engine=dict(num_pages=8, page_size=8, max_tokens_per_step=6),
                               run={}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_planning_gives_the_same_tokens(model, case):
    spec = CASES[case]
    eos = ()
    if spec["run"].get("eos"):
        plain = Engine(model, **spec["engine"]).run(PROMPTS, NEW)
        eos = (plain[3].token_ids[4],)  # stops request 3 early, and maybe others
    sampling = spec["run"].get("sampling", SamplingParams())
    runs = {}
    for overlap in (False, True):
        engine = Engine(model, **spec["engine"], overlap_planning=overlap)
        results = engine.run(PROMPTS, NEW, sampling, eos)
        runs[overlap] = ([(r.token_ids, r.finish_reason) for r in results],
                         engine.planned_ahead_steps, engine.allocator.free_pages)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0 and runs[True][1] > 0, "steps launched from a plan made ahead"
    assert runs[True][2] == runs[False][2] == spec["engine"]["num_pages"]
    if eos:
        assert any(reason == "eos" for _, reason in runs[True][0])
