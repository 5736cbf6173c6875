"""PrefixCachingAllocator: sharing by hash chain, reference counts, LRU eviction under pressure,
nothing lost, and identical decisions on every partner (and in every process)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from torch_cp.kv import PrefixCachingAllocator, page_key, page_keys

NUM_PAGES, PAGE_SIZE = 6, 2
KV = Path(__file__).resolve().parents[2] / "torch_cp" / "kv"
TOKENS = st.integers(0, 2)  # 9 possible pages: equal pages under different prefixes are common


def chain_key(context: tuple) -> bytes:
    """The key a full page whose KV saw ``context`` (every token from the first) must have,
    written out independently of the module."""
    key = b""
    for start in range(0, len(context), PAGE_SIZE):
        data = b"".join(t.to_bytes(8, "little", signed=True)
                        for t in context[start:start + PAGE_SIZE])
        key = hashlib.blake2b(key + data, digest_size=16).digest()
    return key


class Cache(RuleBasedStateMachine):
    """Two partners get the same calls. The test plays the engine: it admits prompts built from
    earlier sequences (so prefixes repeat), writes the KV of its requests' tokens step by step
    (``shadow[page]``: the tokens from the sequence's first up to the page's last written slot,
    i.e. what that page's KV depends on), registers written pages, and releases requests. A
    model of the LRU order predicts every eviction."""

    def __init__(self):
        super().__init__()
        self.partners = [PrefixCachingAllocator(NUM_PAGES, PAGE_SIZE) for _ in range(2)]
        self.a = self.partners[0]
        self.requests: dict[int, list] = {}  # id -> [tokens so far, tokens written]
        self.shadow: dict[int, tuple] = {}
        self.lru: list[int] = []
        self.sequences: list[tuple] = [()]
        self.next_id = 0

    def cached(self) -> dict[tuple, int]:
        keys = self.a.state().keys
        return {self.shadow[p]: p for p in range(NUM_PAGES) if keys[p] is not None}

    @rule(data=st.data())
    def admit(self, data):
        stem = data.draw(st.sampled_from(self.sequences))
        stem = stem[:data.draw(st.integers(0, len(stem)))]
        prompt = list(stem) + data.draw(st.lists(TOKENS, min_size=0 if stem else 1, max_size=8))
        cached = self.cached()
        expected = []
        while (len(expected) + 1) * PAGE_SIZE <= len(prompt) - 1:  # never the last token
            page = cached.get(tuple(prompt[:(len(expected) + 1) * PAGE_SIZE]))
            if page is None:
                break
            expected.append(page)
        refs = self.a.state().refcounts
        assert self.a.lookup(prompt) == expected
        assert self.a.admission_pages(prompt, len(prompt)) == (
            self.a.pages_for(len(prompt)) - len(expected) + sum(refs[p] == 0 for p in expected))
        free = self.a.free_pages
        rid, self.next_id = self.next_id, self.next_id + 1
        assert [a.admit(rid, torch.tensor(prompt)) for a in self.partners] == [
            len(expected) * PAGE_SIZE] * 2
        assert self.a.table(rid) == expected
        assert self.a.free_pages == free - sum(refs[p] == 0 for p in expected)
        self.lru = [p for p in self.lru if p not in expected]
        event(f"admit shares {min(len(expected), 2)} pages (2: 2 or more)")
        self.requests[rid] = [prompt, len(expected) * PAGE_SIZE]
        self.sequences.append(tuple(prompt))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), chunk=st.integers(1, 6), register=st.booleans())
    def step(self, data, chunk, register):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        tokens, written = self.requests[rid]
        if written == len(tokens):  # decoding: the step makes one more token
            tokens.append(data.draw(TOKENS))
        end = min(len(tokens), written + chunk)
        before = self.a.state()
        missing = self.a.missing_pages(rid, end)
        if not all([a.reserve(rid, end) for a in self.partners]):
            assert missing > len(before.free) + len(before.evictable)
            assert self.a.state() == before  # "not now" changes nothing
            event("reserve refused")
            return
        from_free = min(missing, len(before.free))
        evicted, self.lru = self.lru[:missing - from_free], self.lru[missing - from_free:]
        table = self.a.table(rid)
        assert table[len(table) - missing:] == list(before.free[:from_free]) + evicted
        event(f"reserve evicts {min(len(evicted), 2)} pages (2: 2 or more)")
        for page in evicted:
            assert before.refcounts[page] == 0 and self.a.state().keys[page] is None
        read_only = self.a.read_only_pages(rid)
        for position in range(written, end):  # the step writes the KV of these tokens
            index = position // PAGE_SIZE
            page = table[index]
            assert index >= read_only and self.a.refcount(page) == 1
            assert self.a.state().keys[page] is None, "a write lands in a cached page"
            self.shadow[page] = tuple(tokens[:position + 1])
        self.requests[rid][1] = end
        self.sequences.append(tuple(tokens[:end]))
        if register:  # as the engine does after each step
            self.register(data, rid)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def register(self, data, rid=None):
        if rid is None:
            rid = data.draw(st.sampled_from(sorted(self.requests)))
        tokens, written = self.requests[rid]
        cached, old = self.cached(), self.a.read_only_pages(rid)
        # Partner 1 takes the whole sequence and the count cached, as the scheduler passes it
        # (a slice of a long sequence cost each page's registration its whole context).
        assert [self.partners[0].register(rid, tokens[:written]),
                self.partners[1].register(rid, list(tokens), written)] == [
            written // PAGE_SIZE] * 2
        keys = self.a.state().keys
        for page in self.a.table(rid)[old:written // PAGE_SIZE]:
            content = self.shadow[page]
            assert (keys[page] is None) == (content in cached)  # a duplicate stays uncached
            event("duplicate page" if content in cached else "page cached")
            cached.setdefault(content, page)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        before, table = self.a.state(), self.a.table(rid)
        for a in self.partners:
            a.release(rid)
        last = [p for p in table if before.refcounts[p] == 1]
        self.lru += [p for p in reversed(last) if before.keys[p] is not None]
        freed = [p for p in last if before.keys[p] is None]
        assert self.a.state().free == before.free + tuple(freed)
        for page in freed:
            del self.shadow[page]
        del self.requests[rid]

    @invariant()
    def partners_agree(self):
        assert self.partners[0].state() == self.partners[1].state()

    @invariant()
    def nothing_lost_nothing_shared_wrongly(self):
        state = self.a.state()
        holders = [0] * NUM_PAGES
        for _, table in state.tables:
            assert len(set(table)) == len(table)
            for page in table:
                holders[page] += 1
        assert list(state.refcounts) == holders  # hence never negative
        held = [p for p in range(NUM_PAGES) if holders[p]]
        assert sorted(state.free + state.evictable + tuple(held)) == list(range(NUM_PAGES))
        assert list(state.evictable) == self.lru
        assert self.a.free_pages == len(state.free) + len(state.evictable)
        for page in range(NUM_PAGES):
            key = state.keys[page]
            if page in state.free:
                assert key is None
            elif key is None:
                assert holders[page] == 1, "an uncached page has one owner"
            else:
                assert len(self.shadow[page]) % PAGE_SIZE == 0 and key == chain_key(
                    self.shadow[page]), "a cached key names the page's whole context"
        contents = [self.shadow[p] for p in range(NUM_PAGES) if state.keys[p] is not None]
        assert len(set(contents)) == len(contents), "one cached page per content"

    @invariant()
    def a_match_over_kept_keys_is_the_hashed_match(self):
        """The first prompt's keys, kept as the scheduler keeps a waiting request's: matched
        over them after every rule (a memo, until the cache's keys change), as hashed anew."""
        if len(self.sequences) > 1:
            prompt = list(self.sequences[1])
            self.kept = getattr(self, "kept", None) or page_keys(prompt, PAGE_SIZE)
            assert self.a.lookup(prompt, keys=self.kept) == self.a.lookup(prompt)

    @invariant()
    def read_only_pages_hold_the_prefix(self):
        for rid, (tokens, written) in self.requests.items():
            table = self.a.table(rid)
            assert self.a.read_only_pages(rid) * PAGE_SIZE <= written
            for index in range(self.a.read_only_pages(rid)):
                assert self.shadow[table[index]] == tuple(tokens[:(index + 1) * PAGE_SIZE])


Cache.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestCache = Cache.TestCase


def filled(allocator, rid, prompt):
    """Admit, reserve and register ``prompt`` as the engine would after its prefill."""
    cached = allocator.admit(rid, prompt)
    assert allocator.reserve(rid, len(prompt))
    allocator.register(rid, prompt)
    return cached


def test_a_fully_cached_prompt_still_computes_its_last_page():
    a = PrefixCachingAllocator(8, 4)
    prompt = list(range(8))
    assert filled(a, "x", prompt) == 0
    assert filled(a, "y", prompt) == 4  # page-aligned: the last page (and token) is recomputed
    assert a.table("y")[0] == a.table("x")[0] and a.table("y")[1] != a.table("x")[1]
    assert a.read_only_pages("y") == 2 and a.refcount(a.table("x")[0]) == 2
    assert a.admit("z", prompt + [9]) == 8
    assert a.admit("w", prompt[:1]) == 0 and a.admit("v", prompt + [9], max_cached_tokens=7) == 4


def test_pressure_evicts_least_recently_released_and_refuses_without_change():
    a = PrefixCachingAllocator(4, 2)
    filled(a, "x", [1, 2, 3, 4, 5])  # pages 0, 1 cached; page 2 holds the partial last page
    a.release("x")
    assert a.free_pages == 4 and a.evictable_pages == 2 and a.state().evictable == (1, 0)
    assert filled(a, "y", [1, 2, 3, 4, 9]) == 4
    a.release("y")
    assert a.state().evictable == (1, 0)  # shared again, released again: (1, 0) most recent
    assert a.reserve("z", 6) and a.table("z") == [2, 3, 1]  # free first, then the LRU page
    assert a.state().keys[1] is None and a.lookup([1, 2, 3, 4, 5]) == [0]
    before = a.state()
    assert not a.reserve("z", 10) and a.state() == before
    a.release("z")
    assert a.free_pages == a.num_pages  # the engine's "every page returns" still holds


def test_a_hybrid_reuses_up_to_a_checkpoint_and_an_evicted_page_takes_its_checkpoint():
    a = PrefixCachingAllocator(4, 2, state_slots=1, checkpoint_slots=2)
    prompt = [1, 2, 3, 4, 5]
    a.admit("x", prompt)
    slot = a.take_state_slot("x")
    assert a.reserve("x", 5)
    a.register("x", prompt)
    keys = [a.state().keys[p] for p in a.table("x")[:2]]
    assert a.lookup(prompt) == [], "two pages cached, no checkpoint: nothing to start from"
    assert a.save_checkpoint("x", keys[0]) == (slot, 1)  # the slot after the running one
    assert a.save_checkpoint("x", keys[0]) is None  # kept already
    a.release("x")
    assert len(a.lookup(prompt)) == 1
    assert a.admit("y", prompt) == 2, "up to the checkpoint after page 0, not page 1"
    assert a.take_state_slot("y") == 0 and a.take_restores() == [(1, 0)]
    assert a.take_restores() == []
    a.release("y")
    assert a.reserve("z", 8)  # every page: the cached ones evicted, their checkpoint with them
    assert len(a.checkpoints) == 0


def test_register_needs_the_pages_and_admit_a_new_request():
    a = PrefixCachingAllocator(4, 2)
    a.reserve("x", 3)
    with pytest.raises(ValueError, match="holds 2 pages"):
        a.register("x", [1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="already holds"):
        a.admit("x", [1, 2, 3])
    assert a.register("x", [1, 2, 3]) == 1  # a request reserved without admit caches too
    before = a.state()
    assert a.register("gone", [1, 2, 3]) == 0 and a.state() == before  # released in flight


SCRIPT = """
a = P(6, 2)
for rid, prompt in [("x", [1, 2, 3, 4, 5]), ("y", [1, 2, 3, 4, 6]), ("z", [7, 8, 9])]:
    a.admit(rid, prompt); a.reserve(rid, len(prompt)); a.register(rid, prompt)
a.release("x"); a.release("z"); a.reserve("w", 8)
result = repr(a.state())
"""
# The package's __init__ imports transformers (seconds): the subprocess loads the kv modules alone.
ALONE = f"""
import sys, types
for name, path in (("torch_cp", {str(KV.parent)!r}), ("torch_cp.kv", {str(KV)!r})):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [path]
from torch_cp.kv.prefix_cache import PrefixCachingAllocator as P
"""


def test_keys_are_the_same_in_every_process():
    """Partners are separate processes: a key (or a decision) must not depend on Python's
    per-process hash salt."""
    assert page_key(b"", [1, 2]).hex() == "f59df9f51bfcb52f7ae49756810ec78b"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", ALONE + SCRIPT + "print(result)"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    here = {"P": PrefixCachingAllocator}
    exec(SCRIPT, here)
    assert out == here["result"]


def test_a_page_computed_twice_is_cached_once():
    a = PrefixCachingAllocator(6, 2)
    for rid in "xy":  # both admitted before either registers: both compute page 0
        assert a.admit(rid, [1, 2, 3]) == 0 and a.reserve(rid, 3)
    assert [a.register(rid, [1, 2, 3]) for rid in "xy"] == [1, 1]
    x, y = a.table("x")[0], a.table("y")[0]
    assert a.state().keys[x] is not None and a.state().keys[y] is None
    assert a.read_only_pages("y") == 1  # full, so never written again, cached or not
    a.release("y")
    assert y in a.state().free and a.lookup([1, 2, 3]) == [x]


def test_keys_kept_by_the_caller_match_exactly_as_hashing_does():
    """The scheduler hashes a waiting prompt once and passes its ``page_keys``: lookups,
    admission charges and admits must equal those that hash the prompt themselves."""
    from torch_cp.kv.prefix_cache import page_keys

    alloc = PrefixCachingAllocator(num_pages=16, page_size=4)
    cached = list(range(3, 17))  # 14 tokens: pages 0-2 full
    assert alloc.admit("a", cached) == 0 and alloc.reserve("a", len(cached))
    alloc.register("a", cached)
    alloc.release("a")
    for prompt in (cached, cached[:9], cached[:8] + [99, 98, 97, 96, 95], [1, 2, 3, 4, 5], [7]):
        keys = page_keys(prompt, 4)
        assert alloc.lookup(prompt, keys=keys) == alloc.lookup(prompt)
        assert (alloc.admission_pages(prompt, 20, keys=keys)
                == alloc.admission_pages(prompt, 20))
    assert alloc.admit("b", cached[:9], keys=page_keys(cached[:9], 4)) == 8


class CountingDict(dict):
    def __init__(self, *args):
        super().__init__(*args)
        self.probes = 0

    def __contains__(self, key):
        self.probes += 1
        return super().__contains__(key)


def test_a_waiting_request_is_matched_once_until_the_cache_changes():
    """The head of the queue is asked each step, twice with overlap planning (``schedule``,
    ``next_decode_rows``): its chain is walked once (8k pages at 128k took 1 ms a walk), and
    again after an eviction or registration changes what it matches."""
    from torch_cp.engine.scheduler import Request, Scheduler

    prompt = list(range(1, 42))  # 10 full pages of 4 (the last token: never cached)
    alloc = PrefixCachingAllocator(num_pages=16, page_size=4)
    scheduler = Scheduler(alloc, max_tokens_per_step=64)
    scheduler.add(Request(0, prompt, 8))  # 12 pages: leaves 4
    rows = scheduler.schedule()
    scheduler.commit(rows, {0: 5}, frozenset())
    scheduler.add(Request(1, prompt[:40] + [7], 20))  # shares 10 pages, needs 5 more: waits
    alloc._page_of = CountingDict(alloc._page_of)
    for _ in range(2):  # a third would fill page 10: a new key, a new walk
        rows = scheduler.schedule()
        assert scheduler.next_decode_rows(rows) is not None and scheduler.waiting
        scheduler.commit(rows, {0: 5}, frozenset())
    assert alloc._page_of.probes == 10, "one walk over the 10 cached pages"
    keys = scheduler.waiting[0].prompt_keys
    assert len(alloc.lookup(prompt, keys=keys)) == 10
    alloc.release(0)  # its 10 cached pages evictable, then evicted by a request's reserve
    assert alloc.admit("other", [9] * 41) == 0 and alloc.reserve("other", 16 * 4)
    assert alloc.lookup(prompt, keys=keys) == alloc.lookup(prompt) == []
    alloc.release("other")
    assert alloc.admit("again", prompt) == 0 and alloc.reserve("again", 41)
    alloc.register("again", prompt)
    assert alloc.lookup(prompt, keys=keys) == alloc.lookup(prompt) == alloc.table("again")[:10]
    alloc.release_all()  # the cache emptied
    assert alloc.lookup(prompt, keys=keys) == []


def test_an_interrupt_anywhere_in_the_allocator_leaves_a_new_allocators_state():
    """A KeyboardInterrupt may land between any two lines of ``admit``, ``reserve`` (evicting)
    or ``release``, on each partner at another line. For each line in turn: interrupt there,
    then do what the engine's fault handling does (``release_all``): the state equals a new
    allocator's (every page free and uncached, no count, every state slot free: the same on
    every partner), and the allocator serves the same prompts again."""
    import functools
    import os
    import sys

    kv_dir = os.path.dirname(PrefixCachingAllocator.__init__.__code__.co_filename)

    def scenario(a):
        filled(a, "x", [1, 2, 3, 4, 5])  # pages 0, 1 cached on release, page 2 freed
        a.release("x")
        filled(a, "y", [1, 2, 7, 8, 9, 10, 11])  # shares page 0, evicts page 1
        a.take_state_slot("y")
        a.release("y")

    def completes(action, at: int) -> bool:
        """Run ``action`` with a KeyboardInterrupt at its ``at``-th line in kv/; whether it
        ran to its end."""
        seen = [0]

        def tracer(frame, event, arg):
            if not frame.f_code.co_filename.startswith(kv_dir):
                return None

            def line(frame, event, arg):
                if event == "line":
                    seen[0] += 1
                    if seen[0] == at:
                        raise KeyboardInterrupt
                return line
            return line

        sys.settrace(tracer)
        try:
            action()
            return True
        except KeyboardInterrupt:
            return False
        finally:
            sys.settrace(None)

    lines = 1
    while True:
        a = PrefixCachingAllocator(4, 2, state_slots=2)
        done = completes(functools.partial(scenario, a), lines)
        a.release_all()
        assert a.state() == PrefixCachingAllocator(4, 2, state_slots=2).state(), lines
        assert a.free_state_slots == 2 and a.lookup([1, 2, 3]) == [], lines
        scenario(a)  # usable: the same prompts again
        if done:
            break
        lines += 1
    assert lines > 50, "the interrupts walked every line of the scenario"
