"""PageAllocator: growth, "not now", release, and identical decisions on every partner."""

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from torch_cp.kv import PageAllocator, PrefixCachingAllocator

NUM_PAGES, PAGE_SIZE = 12, 4
REQUESTS = st.sampled_from(["a", "b", "c", 7, 8])


class Partners(RuleBasedStateMachine):
    """Two partners' allocators get the same calls; a third ("shadow") gets only the reserves
    that succeeded, so it tracks what an allocator must look like if a refusal changes nothing."""

    def __init__(self):
        super().__init__()
        self.partners = [PageAllocator(NUM_PAGES, PAGE_SIZE) for _ in range(2)]
        self.shadow = PageAllocator(NUM_PAGES, PAGE_SIZE)
        self.refusals = 0

    @rule(request=REQUESTS, tokens=st.integers(0, NUM_PAGES * PAGE_SIZE + 3))
    def reserve(self, request, tokens):
        before = [list(a.table(request)) for a in self.partners]
        free_before = self.partners[0].free_pages
        needed = math.ceil(tokens / PAGE_SIZE)
        missing = max(0, needed - len(before[0]))
        answers = [a.missing_pages(request, tokens) for a in self.partners]
        results = [a.reserve(request, tokens) for a in self.partners]
        assert answers == [missing, missing]
        assert results[0] == results[1] == (missing <= free_before)
        table = self.partners[0].table(request)
        if results[0]:
            assert self.shadow.reserve(request, tokens)
            assert table[: len(before[0])] == before[0]  # growth never moves a page
            assert len(table) == max(needed, len(before[0]))
            assert self.partners[0].free_pages == free_before - missing
            assert len(table) * PAGE_SIZE >= tokens
        else:
            self.refusals += 1
            assert table == before[0]
            assert self.partners[0].free_pages == free_before

    @rule(request=REQUESTS)
    def release(self, request):
        held = len(self.partners[0].table(request))
        free_before = self.partners[0].free_pages
        for a in (*self.partners, self.shadow):
            a.release(request)
        assert self.partners[0].table(request) == []
        assert self.partners[0].free_pages == free_before + held

    @precondition(lambda self: self.partners[0].live_requests)
    @rule()
    def release_all(self):
        for request in self.partners[0].live_requests:
            self.release(request)
        assert self.partners[0].free_pages == NUM_PAGES
        assert self.partners[0].live_requests == []

    @invariant()
    def partners_and_shadow_agree(self):
        first = self.partners[0]
        for other in (self.partners[1], self.shadow):
            assert other.free_pages == first.free_pages
            assert sorted(map(str, other.live_requests)) == sorted(map(str, first.live_requests))
            for request in first.live_requests:
                assert other.table(request) == first.table(request)

    @invariant()
    def table_tensor_mirrors_table(self):
        a = self.partners[0]
        for request in [*a.live_requests, "never-reserved"]:
            assert a.table_tensor(request).tolist() == a.table(request)

    @invariant()
    def every_page_is_free_or_held_by_one_request(self):
        a = self.partners[0]
        held = [p for r in a.live_requests for p in a.table(r)]
        assert len(held) == len(set(held))
        assert all(0 <= p < NUM_PAGES for p in held)
        assert len(held) + a.free_pages == NUM_PAGES


TestPartners = Partners.TestCase
TestPartners.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_release_returns_every_page_and_they_serve_again():
    a = PageAllocator(NUM_PAGES, PAGE_SIZE)
    assert a.reserve("x", 5) and a.reserve("y", 13) and a.reserve("x", 9)
    assert a.free_pages == NUM_PAGES - 7
    assert not a.reserve("z", NUM_PAGES * PAGE_SIZE)
    a.release("x")
    a.release("y")
    a.release("unknown")  # a no-op
    assert a.free_pages == NUM_PAGES and a.live_requests == []
    assert a.reserve("z", NUM_PAGES * PAGE_SIZE)
    assert sorted(a.table("z")) == list(range(NUM_PAGES))


def test_refusal_leaves_later_decisions_unchanged():
    """A refused reserve must not leak pages or reorder the free list: the allocator that saw it
    hands out the same pages afterwards as one that never did."""
    a, b = PageAllocator(6, 2), PageAllocator(6, 2)
    for alloc in (a, b):
        assert alloc.reserve(1, 5)
    assert not a.reserve(2, 20)
    assert not a.reserve(1, 20)
    for alloc in (a, b):
        alloc.release(1)
        assert alloc.reserve(3, 7)
    assert a.table(3) == b.table(3) and a.table(2) == [] and a.free_pages == b.free_pages


@pytest.mark.parametrize("kind", [PageAllocator, PrefixCachingAllocator])
def test_a_grown_allocator_keeps_its_tables_and_hands_out_the_new_pages(kind):
    """``grow`` (a generate cache given back for a longer turn): the new pages serve, the
    tables stay (a caching allocator's page counts grow with them: helper 84)."""
    a = kind(4, 2)
    assert a.reserve("x", 5) and not a.reserve("y", 4)  # x holds 3 pages, 1 is free
    table = list(a.table("x"))
    a.grow(7)
    assert a.table("x") == table and a.free_pages == 4
    assert a.reserve("y", 8) and sorted(a.table("y")) == [3, 4, 5, 6]
    a.release("x")
    a.release("y")
    assert a.free_pages == 7
    a.release_all()
    assert a.free_pages == 7 and a.reserve("z", 14)


@pytest.mark.parametrize("pages,size", [(0, 4), (4, 0), (-1, -1)])
def test_bad_geometry_is_refused(pages, size):
    with pytest.raises(ValueError, match="num_pages >= 1, page_size >= 1"):
        PageAllocator(pages, size)


def test_release_all_leaves_a_new_allocators_state_whatever_an_interrupt_left():
    """Pages taken but never put in a table, a slot taken but never recorded, a live request:
    ``release_all`` (the engine's fault handling) frees all of it, in a new allocator's order,
    so every partner is alike again whatever line an interrupt cut on each."""
    a = PageAllocator(6, 2, state_slots=3)
    assert a.reserve("x", 3)
    a.take_state_slot("x")
    a._take(2)  # popped, never in a table
    a._free_slots.popleft()  # taken, never recorded
    a.release_all()
    assert a.live_requests == [] and list(a._free) == list(range(6))
    assert list(a._free_slots) == [0, 1, 2] and a.table_tensor("x").numel() == 0
    assert a.reserve("y", 5) and a.table("y") == [0, 1, 2]
