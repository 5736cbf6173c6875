"""Admission promises across steps (engine/scheduler.py): once admitted, a request can always
take the pages of its whole lifetime, because the free pages never fall below the pages still
promised to the running requests.

The scheduler is driven alone, with a PageAllocator, through the engine's protocol
(``tests/helpers/admission.py``: retried and foreseen steps, requests arriving while others
run, a fake token stream with EOS at chosen positions). At every step:
free pages >= the pages promised (``missing_pages(r, r.lifetime_tokens)`` summed over the running
requests), no reservation of a running request is ever refused, no request holds more than its
lifetime; at the end every page is back and every request ended as its fake stream says.
"""

from __future__ import annotations

from admission import WatchedAllocator, drive, expected_end
from hypothesis import given, settings
from hypothesis import strategies as st


def run(requests, num_pages: int, page_size: int, budget: int, max_rows: int | None, seed: int):
    """``drive`` over a plain PageAllocator; ``requests``: (prompt length, max_new_tokens, EOS
    after n tokens or 0, arrival step)."""
    with_prompts = [([1 + (i + k) % 7 for k in range(p)], new, eos, at)
                    for i, (p, new, eos, at) in enumerate(requests)]
    return drive(with_prompts, WatchedAllocator(num_pages, page_size), budget, max_rows, seed)


def test_a_tight_pool_keeps_its_promises_across_steps():
    """Hand-picked: request 0 takes 1 of its 4 lifetime pages at first, and later requests
    arrive while it grows into the other 3; one that would need them waits."""
    requests = [(3, 13, 0, 0), (4, 1, 0, 1), (5, 4, 0, 2), (9, 4, 2, 2), (2, 8, 0, 3),
                (12, 5, 0, 3), (1, 1, 0, 4)]
    for seed in range(8):
        ended = run(requests, num_pages=5, page_size=4, budget=6, max_rows=3, seed=seed)
        assert ended == {i: expected_end(new, eos) for i, (_, new, eos, _) in
                         enumerate(requests)}


@settings(max_examples=120, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 10), st.integers(0, 10),
                                   st.integers(0, 12)), min_size=1, max_size=7),
       page_size=st.sampled_from([1, 2, 4, 8]), spare=st.integers(0, 5),
       budget=st.integers(1, 20), max_rows=st.sampled_from([None, 1, 2, 3, 5]),
       seed=st.integers(0, 2**16))
def test_admission_keeps_every_promise(requests, page_size, spare, budget, max_rows, seed):
    """Random prompt lengths, max_new_tokens, EOS positions, arrival steps, pool sizes (from the
    largest lifetime up), token budgets, row caps, retries and steps launched ahead."""
    need = max(-(-(p + n - 1) // page_size) for p, n, _, _ in requests)
    ended = run(requests, need + spare, page_size, budget, max_rows, seed)
    assert ended == {i: expected_end(new, eos) for i, (_, new, eos, _) in enumerate(requests)}


def test_a_request_keeps_one_token_sequence_that_grows_with_it():
    """``Request.tokens`` was ``prompt + generated`` built on each read, and a step read it for
    every row twice: 49 ms of host work a step at 64 rows of 128k tokens (helper 94). It is now
    one list, grown as tokens are generated, and always the prompt then the generated tokens."""
    from torch_cp.engine.scheduler import Request, Scheduler
    from torch_cp.kv.allocator import PageAllocator

    prompt = [1 + k % 7 for k in range(50)]
    scheduler = Scheduler(PageAllocator(16, 4), 64)
    scheduler.add(Request(0, prompt, 6))
    request, seen = None, set()
    for token in range(100, 105):
        rows = scheduler.schedule()
        request = scheduler.running[0]
        seen.add(id(request.tokens))
        scheduler.commit(rows, {0: token}, frozenset())
        assert request.tokens == prompt + request.generated
    assert request.generated == [100, 101, 102, 103, 104] and len(seen) == 1
