"""The scheduler driven alone through the engine's protocol, checking its admission promises
after every call that can admit or reserve (tests/engine/test_admission.py, and with a prefix
cache tests/engine/test_prefix_caching.py).

Each step is ``schedule()`` (sometimes retried with fewer rows or tokens, as after a refused
step), or the rows ``next_decode_rows`` foresaw, then ``commit`` with tokens from a deterministic
fake (EOS at chosen positions). Requests arrive while others run (``add`` between steps).
"""

from __future__ import annotations

import random
from collections import Counter

from torch_cp.engine.scheduler import Request, Scheduler, writes_shared_page
from torch_cp.kv import PageAllocator, PrefixCachingAllocator

EOS, TOKEN = 9, 5


class _Watched:
    """Records every refused reservation."""

    def __init__(self, num_pages: int, page_size: int, state_slots: int = 0, *extra):
        super().__init__(num_pages, page_size, state_slots, *extra)
        self.refused: list[tuple[object, int]] = []

    def reserve(self, request_id, num_tokens: int) -> bool:
        ok = super().reserve(request_id, num_tokens)
        if not ok:
            self.refused.append((request_id, num_tokens))
        return ok


class WatchedAllocator(_Watched, PageAllocator):
    pass


class WatchedCachingAllocator(_Watched, PrefixCachingAllocator):
    pass


def promised(alloc: PageAllocator, scheduler: Scheduler) -> int:
    return sum(alloc.missing_pages(r.index, r.lifetime_tokens) for r in scheduler.running.values())


def check_promises(alloc, scheduler: Scheduler, where: str) -> None:
    """No promised reservation refused, free pages >= promised, every page free or held (a page
    held by several tables only where a prefix cache shares it, as many times as its count), no
    request past its lifetime."""
    assert not alloc.refused, f"{where}: a promised reservation was refused: {alloc.refused}"
    assert alloc.free_pages >= promised(alloc, scheduler), (
        f"{where}: {alloc.free_pages} free pages < {promised(alloc, scheduler)} promised")
    holders = Counter(p for i in scheduler.running for p in alloc.table(i))
    for page, n in holders.items():
        shared = alloc.refcount(page) if isinstance(alloc, PrefixCachingAllocator) else 1
        assert n == shared, f"{where}: page {page} held {n} times"
    assert len(holders) + alloc.free_pages == alloc.num_pages, f"{where}: a page lost"
    for r in scheduler.running.values():
        assert len(alloc.table(r.index)) <= alloc.pages_for(r.lifetime_tokens), where


def drive(requests, alloc, budget: int, max_rows: int | None,
          seed: int) -> dict[int, tuple[tuple[int, ...], str]]:
    """Run ``requests`` ((prompt token ids, max_new_tokens, EOS after n tokens or 0, arrival
    step)) to their end over ``alloc`` (a ``WatchedAllocator`` or ``WatchedCachingAllocator``),
    checking the promises after every call that can admit or reserve and that no step writes a
    shared page. ``seed`` picks, per step, whether the step is retried smaller and whether the
    next one is foreseen (launched ahead). Returns each request's tokens and finish reason."""
    rng = random.Random(seed)
    scheduler = Scheduler(alloc, max_tokens_per_step=budget, max_rows=max_rows)
    arrivals = sorted(range(len(requests)), key=lambda i: requests[i][3])
    eos_after = {i: r[2] for i, r in enumerate(requests)}
    ended, ahead, step = {}, None, 0
    while arrivals or not scheduler.done:
        while arrivals and requests[arrivals[0]][3] <= step:
            i = arrivals.pop(0)
            scheduler.add(Request(i, list(requests[i][0]), requests[i][1]))
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
        assert not writes_shared_page(alloc, rows), f"step {step}: a cached page written"
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
    assert alloc.free_pages == alloc.num_pages, "every page returns"
    assert alloc.live_requests == [], "no table left behind"
    return ended


def expected_end(new: int, eos_after: int) -> tuple[tuple[int, ...], str]:
    """What ``drive``'s fake stream gives a request of ``new`` tokens with EOS after
    ``eos_after`` (0: none)."""
    if 0 < eos_after <= new:
        return (TOKEN,) * (eos_after - 1) + (EOS,), "eos"
    return (TOKEN,) * new, "length"
