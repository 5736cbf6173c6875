"""Admission promises across steps (engine/scheduler.py): once admitted, a request can always
take the pages of its whole lifetime, because the free pages never fall below the pages still
promised to the running requests.

The scheduler is driven alone, with a PageAllocator, through the engine's protocol: each step is
``schedule()`` (sometimes retried with fewer rows or tokens, as after a refused step), or the
rows ``next_decode_rows`` foresaw, then ``commit`` with tokens from a deterministic fake (EOS at
chosen positions). Requests arrive while others run (``add`` between steps). At every step:
free pages >= the pages promised (``missing_pages(r, r.lifetime_tokens)`` summed over the running
requests), no reservation of a running request is ever refused, no request holds more than its
lifetime; at the end every page is back and every request ended as its fake stream says.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from torch_cp.engine.scheduler import Request, Scheduler
from torch_cp.kv import PageAllocator

EOS, TOKEN = 9, 5


class WatchedAllocator(PageAllocator):
    """A PageAllocator that records every refused reservation."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages, page_size)
        self.refused: list[tuple[object, int]] = []

    def reserve(self, request_id, num_tokens: int) -> bool:
        ok = super().reserve(request_id, num_tokens)
        if not ok:
            self.refused.append((request_id, num_tokens))
        return ok


def promised(alloc: PageAllocator, scheduler: Scheduler) -> int:
    return sum(alloc.missing_pages(r.index, r.lifetime_tokens) for r in scheduler.running.values())


def check_promises(alloc: WatchedAllocator, scheduler: Scheduler, where: str) -> None:
    assert not alloc.refused, f"{where}: a promised reservation was refused: {alloc.refused}"
    assert alloc.free_pages >= promised(alloc, scheduler), (
        f"{where}: {alloc.free_pages} free pages < {promised(alloc, scheduler)} promised")
    held = sum(len(alloc.table(i)) for i in scheduler.running)
    assert held + alloc.free_pages == alloc.num_pages, f"{where}: a page lost or held twice"
    for r in scheduler.running.values():
        assert len(alloc.table(r.index)) <= alloc.pages_for(r.lifetime_tokens), where


def drive(requests, num_pages: int, page_size: int, budget: int, max_rows: int | None,
          seed: int) -> dict[int, tuple[tuple[int, ...], str]]:
    """Run ``requests`` ((prompt length, max_new_tokens, EOS after n tokens or 0, arrival
    step)) to their end, checking the promises after every call that can admit or reserve.
    ``seed`` picks, per step, whether the step is retried smaller and whether the next one is
    foreseen (launched ahead). Returns each request's tokens and finish reason."""
    rng = random.Random(seed)
    alloc = WatchedAllocator(num_pages, page_size)
    scheduler = Scheduler(alloc, max_tokens_per_step=budget, max_rows=max_rows)
    arrivals = sorted(range(len(requests)), key=lambda i: requests[i][3])
    eos_after = {i: r[2] for i, r in enumerate(requests)}
    ended, ahead, step = {}, None, 0
    while arrivals or not scheduler.done:
        while arrivals and requests[arrivals[0]][3] <= step:
            i = arrivals.pop(0)
            prompt, new = requests[i][:2]
            scheduler.add(Request(i, [1 + (i + k) % 7 for k in range(prompt)], new))
        step += 1
        assert step < 2000, "the run ends"
        if scheduler.done:
            continue
        if ahead is not None:
            rows, ahead = ahead, None
        else:
            rows = scheduler.schedule()
            check_promises(alloc, scheduler, f"step {step}: schedule")
            if rng.random() < 0.2:  # refused: retried with fewer rows or tokens, before commit
                tokens = sum(r.length for r in rows)
                rows = scheduler.schedule(max_rows=max(1, len(rows) // 2),
                                          max_tokens=max(1, tokens // 2))
                check_promises(alloc, scheduler, f"step {step}: retried")
        assert rows, "a scheduler with running requests always has a row"
        live = [r for r in rows if r.request in scheduler.running]
        if rng.random() < 0.5:
            ahead = scheduler.next_decode_rows(live)
            check_promises(alloc, scheduler, f"step {step}: foreseen")
        tokens = {}
        for r in live:
            if r.samples:
                n = len(scheduler.running[r.request].generated) + 1
                tokens[r.request] = EOS if n == eos_after[r.request] else TOKEN
        for request, reason in scheduler.commit(live, tokens, frozenset({EOS})):
            ended[request.index] = (tuple(request.generated), reason)
        if ahead is not None:
            ahead = [r for r in ahead if r.request in scheduler.running] or None
        check_promises(alloc, scheduler, f"step {step}: commit")
    assert alloc.free_pages == num_pages, "every page returns"
    assert alloc.live_requests == [], "no table left behind"
    return ended


def expected_end(new: int, eos_after: int) -> tuple[tuple[int, ...], str]:
    if 0 < eos_after <= new:
        return (TOKEN,) * (eos_after - 1) + (EOS,), "eos"
    return (TOKEN,) * new, "length"


def test_a_tight_pool_keeps_its_promises_across_steps():
    """Hand-picked: request 0 takes 1 of its 4 lifetime pages at first, and later requests
    arrive while it grows into the other 3; one that would need them waits."""
    requests = [(3, 13, 0, 0), (4, 1, 0, 1), (5, 4, 0, 2), (9, 4, 2, 2), (2, 8, 0, 3),
                (12, 5, 0, 3), (1, 1, 0, 4)]
    for seed in range(8):
        ended = drive(requests, num_pages=5, page_size=4, budget=6, max_rows=3, seed=seed)
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
    ended = drive(requests, need + spare, page_size, budget, max_rows, seed)
    assert ended == {i: expected_end(new, eos) for i, (_, new, eos, _) in enumerate(requests)}
