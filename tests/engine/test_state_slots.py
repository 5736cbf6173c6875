"""State slots of a hybrid model (engine/scheduler.py, kv/allocator.py): admission takes one per
request, ``release`` returns it with the pages (invariant 7 for state); with prefix caching, state
checkpoints (kv/state_checkpoints.py) hold the state a request starts from.

The scheduler is driven alone over a ``PageAllocator(state_slots=S)`` with random arrivals,
steps (retried smaller, or foreseen and launched ahead), EOS, aborts and ``abort_all`` (also
after a fault interrupted an abort). After
every call: no slot is held by two requests, every running request holds one and no other request
does, free + held == S (none lost), no more requests run than there are slots, and a waiting head
is kept out only by a full set of slots, rows or pages; when every request has ended, every slot
and page is back.

With a ``PrefixCachingAllocator`` (checkpoint slots after the running ones) the machine also
plays the state itself: each slot's contents are the tokens its state has consumed. Restores
copy a checkpoint into an admitted request's slot before its step, each step's rows consume
their tokens, and the checkpoint copies follow the step. Every row that does not start fresh
(from the zero slot) must find in its slot exactly the tokens before its start: a request
admitted onto a cached prefix starts from the state of that prefix, never another's; checkpoint
slots are never a running request's, and no two checkpoints share one.
"""

from __future__ import annotations

from admission import (
    EOS,
    TOKEN,
    WatchedAllocator,
    WatchedCachingAllocator,
    check_promises,
    promised,
)
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from torch_cp.engine.scheduler import Request, Scheduler
from torch_cp.kv import PageAllocator, PrefixCachingAllocator

PAGE_SIZE, NUM_PAGES = 2, 24  # a lifetime (prompt <= 8, new <= 6) takes at most 7 pages


def check_slots(alloc: PageAllocator, scheduler: Scheduler, where: str, admitted: bool) -> None:
    """The slot invariants; ``admitted``: right after ``schedule`` admitted what it could."""
    running = list(scheduler.running)
    held = [alloc.state_slot(i) for i in running]  # KeyError: a running request holds none
    assert len(set(held)) == len(held), f"{where}: a slot held twice: {held}"
    assert all(0 <= s < alloc.state_slots for s in held), f"{where}: {held}"
    assert set(alloc.live_requests) <= set(running), f"{where}: an ended request holds a slot"
    assert alloc.free_state_slots + len(held) == alloc.state_slots, f"{where}: a slot lost"
    assert len(running) <= alloc.state_slots, f"{where}: more running requests than slots"
    if isinstance(alloc, PrefixCachingAllocator):
        kept = list(alloc.checkpoints.held().values())
        assert len(set(kept)) == len(kept), f"{where}: two checkpoints in one slot: {kept}"
        assert set(kept) <= set(alloc.checkpoints.slots), f"{where}: {kept}"
    if admitted and scheduler.waiting and not alloc.free_state_slots:
        event("a request waits for a slot")
    if admitted and scheduler.waiting and alloc.free_state_slots:
        head = scheduler.waiting[0]  # a free slot: only full rows or too few pages keep it out
        rows_full = scheduler.max_rows is not None and len(running) >= scheduler.max_rows
        pages = alloc.free_pages - promised(alloc, scheduler)
        assert rows_full or scheduler._admission_pages(head) > pages, (
            f"{where}: request {head.index} waits with a free slot, row and pages")


class Slots(RuleBasedStateMachine):
    """Plays the engine: requests arrive, steps are scheduled (sometimes retried smaller, as
    after a refused step, or the next one foreseen and launched ahead) and committed with a fake
    token stream that stops some requests at EOS; requests are aborted one at a time or all at
    once (a failed step)."""

    def __init__(self):
        super().__init__()
        self.alloc: WatchedAllocator | None = None
        self.scheduler: Scheduler | None = None
        self.next_index = 0
        self.ahead = None
        self.contents: dict[int, tuple[int, ...]] = {}  # slot -> the tokens its state consumed

    @initialize(slots=st.integers(1, 4), budget=st.integers(1, 12),
                max_rows=st.sampled_from([None, 1, 2, 3, 6]), checkpoints=st.integers(0, 3))
    def start(self, slots, budget, max_rows, checkpoints):
        self.alloc = (WatchedCachingAllocator(NUM_PAGES, PAGE_SIZE, slots, checkpoints)
                      if checkpoints else WatchedAllocator(NUM_PAGES, PAGE_SIZE, slots))
        self.scheduler = Scheduler(self.alloc, max_tokens_per_step=budget, max_rows=max_rows)

    def run_rows(self, rows) -> None:
        """The state side of a step: restores, the rows' tokens, then checkpoint copies."""
        s, a = self.scheduler, self.alloc
        if isinstance(a, PrefixCachingAllocator):
            for source, slot in a.take_restores():
                assert source in a.checkpoints.slots and slot < a.state_slots, (source, slot)
                self.contents[slot] = self.contents[source]
                event("a request admitted onto a checkpoint")
        for r in rows:
            tokens, slot = tuple(s.running[r.request].tokens), a.state_slot(r.request)
            if r.start:
                assert self.contents.get(slot) == tokens[:r.start], (
                    f"request {r.request} resumes at {r.start} from another state")
            self.contents[slot] = tokens[:r.start + r.length]
        for request, key in s.checkpoint_keys(rows):
            copy = a.save_checkpoint(request, key)
            if copy is not None:
                source, slot = copy
                assert slot in a.checkpoints.slots and source == a.state_slot(request)
                self.contents[slot] = self.contents[source]
                event("a checkpoint taken")

    @rule(requests=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 6)), min_size=1,
                            max_size=3))
    def arrive(self, requests):
        for prompt, new in requests:
            i, self.next_index = self.next_index, self.next_index + 1
            self.scheduler.add(Request(i, [1 + (i % 3 + k) % 7 for k in range(prompt)], new))

    @rule(retry=st.booleans(), foresee=st.booleans(), data=st.data())
    def step(self, retry, foresee, data):
        s = self.scheduler
        if s.done:  # rules stay enabled: hypothesis gives up on machines mostly filtered out
            return
        if self.ahead is not None:
            rows, self.ahead = self.ahead, None
        else:
            rows = s.schedule()
            self.check("schedule", admitted=True)
            if retry:
                rows = s.schedule(max_rows=max(1, len(rows) // 2),
                                  max_tokens=max(1, sum(r.length for r in rows) // 2))
                self.check("retried", admitted=True)
        assert rows, "a scheduler with requests always has a row"
        rows = [r for r in rows if r.request in s.running]
        if foresee:
            self.ahead = s.next_decode_rows(rows)
            self.check("foreseen")
        self.run_rows(rows)
        eos = st.sampled_from([False, False, False, True])
        tokens = {r.request: EOS if data.draw(eos, label=f"EOS for {r.request}") else TOKEN
                  for r in rows if r.samples}
        s.commit(rows, tokens, frozenset({EOS}))
        if self.ahead is not None:  # a row of a request that stopped at EOS is dropped
            self.ahead = [r for r in self.ahead if r.request in s.running] or None

    @rule(data=st.data())
    def abort(self, data):
        if not self.scheduler.running:
            return
        self.scheduler.abort(data.draw(st.sampled_from(sorted(self.scheduler.running))))
        if self.ahead is not None:
            self.ahead = [r for r in self.ahead if r.request in self.scheduler.running] or None

    @rule()
    def abort_all(self):
        event(f"abort_all with {min(len(self.scheduler.running), 3)} running (3: 3 or more)")
        self.scheduler.abort_all()
        self.ahead = None
        assert self.alloc.free_state_slots == self.alloc.state_slots
        assert self.alloc.free_pages == self.alloc.num_pages

    @rule(data=st.data())
    def interrupted_abort(self, data):
        """A fault between ``abort``'s pop and its release (engine fault handling), then the
        engine's ``abort_all``: the half-aborted request's slot comes back too."""
        if not self.scheduler.running:
            return
        self.scheduler.running.pop(data.draw(st.sampled_from(sorted(self.scheduler.running))))
        self.abort_all()

    def check(self, where: str, admitted: bool = False) -> None:
        check_promises(self.alloc, self.scheduler, where)
        check_slots(self.alloc, self.scheduler, where, admitted)

    @invariant()
    def slots_are_whole(self):
        self.check("after the rule")

    def teardown(self):
        """Run what is left to its end (no EOS): every slot and page comes back."""
        s = self.scheduler
        self.ahead = None
        for _ in range(500):
            if s.done:
                break
            rows = s.schedule()
            self.check("draining", admitted=True)
            self.run_rows(rows)
            s.commit(rows, {r.request: TOKEN for r in rows if r.samples}, frozenset({EOS}))
        assert s.done, "the requests end"
        assert self.alloc.free_state_slots == self.alloc.state_slots, "every slot returns"
        assert self.alloc.free_pages == self.alloc.num_pages, "every page returns"
        assert self.alloc.live_requests == []


Slots.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSlots = Slots.TestCase


def test_a_finished_requests_slot_goes_to_the_next():
    """Two slots, three requests: the third waits for a slot (pages and rows are plenty) and
    gets the one the first request held when it ends at EOS; the second keeps its own."""
    alloc = PageAllocator(NUM_PAGES, PAGE_SIZE, state_slots=2)
    scheduler = Scheduler(alloc, max_tokens_per_step=64)
    for i in range(3):
        scheduler.add(Request(i, [3, 4, 5], max_new_tokens=4))
    rows = scheduler.schedule()
    assert [r.request for r in rows] == [0, 1] and [r.index for r in scheduler.waiting] == [2]
    first, second = alloc.state_slot(0), alloc.state_slot(1)
    assert {first, second} == {0, 1} and alloc.free_state_slots == 0
    finished = scheduler.commit(rows, {0: EOS, 1: TOKEN}, frozenset({EOS}))
    assert [(r.index, why) for r, why in finished] == [(0, "eos")]
    assert alloc.free_state_slots == 1
    rows = scheduler.schedule()
    assert sorted(r.request for r in rows) == [1, 2]
    assert alloc.state_slot(2) == first and alloc.state_slot(1) == second
    assert alloc.free_state_slots == 0
    scheduler.abort_all()
    assert alloc.free_state_slots == 2 and alloc.free_pages == NUM_PAGES
