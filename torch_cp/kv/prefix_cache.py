"""Prefix caching over logical pages: full pages keyed by a hash chain over their tokens,
shared by reference count, kept after release until pool pressure evicts them (least recently
used first).

Equal keys (``page_keys.py``: a hash chain from the sequence's first token) mean equal tokens,
hence equal KV; keys are the same on every process and page ids stay logical, so every partner
holding a stripe of the same pages decides the same by construction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch_cp.kv.allocator import PageAllocator
from torch_cp.kv.page_keys import ROOT, page_key, page_keys, token_list  # noqa: F401 (re-exported)
from torch_cp.kv.state_checkpoints import StateCheckpoints


@dataclass(frozen=True)
class CacheState:
    """A snapshot for tests and partner checks: the free list in order, the evictable cached
    pages least recently used first, and every page's reference count and key (None: uncached)."""

    free: tuple[int, ...]
    evictable: tuple[int, ...]
    refcounts: tuple[int, ...]
    keys: tuple[bytes | None, ...]
    tables: tuple[tuple[object, tuple[int, ...]], ...]


class PrefixCachingAllocator(PageAllocator):
    """A ``PageAllocator`` whose full pages outlive their request as a prefix cache.

    A page is in exactly one state: free (on the free list), held (reference count >= 1: that
    many live tables hold it), or evictable (cached, count 0). ``free_pages`` counts free plus
    evictable pages, since ``reserve`` takes free pages first and then evicts the least recently
    released cached ones; it still answers False, changing nothing, when both cannot cover it.

    Use: ``admit(request, prompt)`` first (shares the longest cached prefix and returns how many
    prompt tokens need no prefill), then ``reserve`` as usual, and ``register(request, tokens)``
    after a step has written the KV of ``tokens`` so that later requests can share its full pages.
    The first ``read_only_pages(request)`` pages of a table are cached and must never be written.

    A hybrid model (``state_slots`` > 0) reuses a cached prefix only up to its deepest state
    checkpoint (``checkpoints``: ``checkpoint_slots`` slots after the running requests' ones):
    ``save_checkpoint`` names the copy that takes one, and a request admitted onto one gets a
    ``take_restores`` copy from it into its own slot.
    """

    def __init__(self, num_pages: int, page_size: int, state_slots: int = 0,
                 checkpoint_slots: int = 0):
        super().__init__(num_pages, page_size, state_slots)
        if checkpoint_slots < 0 or (checkpoint_slots and not state_slots):
            raise ValueError(f"checkpoint_slots ({checkpoint_slots}) needs state_slots > 0 and "
                             f"must be >= 0")
        self.checkpoints = StateCheckpoints(range(
            state_slots, state_slots + checkpoint_slots)) if state_slots else None
        self._restore_from: dict[object, int] = {}  # admitted onto a checkpoint: its slot
        self._restores: dict[object, tuple[int, int]] = {}  # (checkpoint slot, request slot)
        self._refs = [0] * num_pages
        self._key_of: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first
        self._keys: dict[object, list[bytes]] = {}  # each request's chain over its full pages
        self._keys_changed = 0  # counts the changes of ``_page_of``: a match's memo lasts until one
        self._memo: tuple | None = None  # the last match over a caller's keys (``_chain``)

    @property
    def free_pages(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def checkpointing(self) -> bool:
        """Whether requests reuse prefixes from state checkpoints (a hybrid model's)."""
        return self.checkpoints is not None and bool(self.checkpoints.slots)

    @property
    def evictable_pages(self) -> int:
        """Cached pages no live request holds (counted in ``free_pages``)."""
        return len(self._lru)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def lookup(self, prompt, max_cached_tokens: int | None = None,
               keys: Sequence[bytes] | None = None) -> list[int]:
        """The cached pages ``admit`` would share for ``prompt`` (changes nothing).

        Only pages wholly inside ``prompt[:-1]`` count: the prompt's last token is always
        computed (its logits pick the first new token) and it must not land in a shared page,
        so a fully cached, page-aligned prompt recomputes its last page. ``max_cached_tokens``
        caps the match further (a hybrid model reuses a prefix only where it has a state
        checkpoint). ``keys``: the prompt's ``page_keys``, when the caller keeps them (a
        waiting request is looked up every step; hashing its prompt once is enough)."""
        return self._match(token_list(prompt), max_cached_tokens, keys)[0]

    def admission_pages(self, prompt, num_tokens: int, max_cached_tokens: int | None = None,
                        keys: Sequence[bytes] | None = None,
                        shared: Sequence[int] | None = None) -> int:
        """How much ``free_pages`` drops if ``admit(prompt)`` then ``reserve(num_tokens)``
        succeed: the pages to allocate, plus the shared pages that stop being evictable.
        ``shared``: ``lookup``'s answer for these arguments, when the caller has it."""
        if shared is None:
            shared = self.lookup(prompt, max_cached_tokens, keys)
        taken = sum(1 for page in shared if self._refs[page] == 0)
        return max(0, self.pages_for(num_tokens) - len(shared)) + taken

    def admit(self, request_id, prompt, max_cached_tokens: int | None = None,
              keys: Sequence[bytes] | None = None) -> int:
        """Start ``request_id``'s table with the longest cached prefix of ``prompt``'s full
        pages (see ``lookup``) and return the number of prompt tokens cached: a multiple of
        ``page_size``, at most ``len(prompt) - 1``. Allocates nothing; ``reserve`` does."""
        if request_id in self._tables:
            raise ValueError(f"admit({request_id!r}): the request already holds pages")
        shared, keys = self._match(token_list(prompt), max_cached_tokens, keys)
        for page in shared:
            if self._refs[page] == 0:
                del self._lru[page]
            self._refs[page] += 1
        self._tables[request_id] = []
        self._extend(request_id, shared)
        self._keys[request_id] = keys
        if shared and self.checkpoints is not None:
            self._restore_from[request_id] = self.checkpoints.use(keys[-1])
        return len(shared) * self.page_size

    def shared_pages(self, prompt, keys: Sequence[bytes] | None = None) -> int:
        """How many of ``prompt``'s full pages the cache holds (as ``lookup`` counts them), a
        hybrid model's state checkpoints aside: where a chunk of the prompt should end so that
        a checkpoint is taken where its cached prefix ends."""
        return len(self._match(token_list(prompt), None, keys, checkpointed=False)[0])

    def take_state_slot(self, request_id) -> int:
        slot = super().take_state_slot(request_id)
        source = self._restore_from.pop(request_id, None)
        if source is not None:
            self._restores[request_id] = (source, slot)
        return slot

    def take_restores(self) -> list[tuple[int, int]]:
        """(checkpoint slot, request slot) copies the requests admitted since the last call
        need before their first step: each starts from the state its cached prefix left."""
        restores, self._restores = list(self._restores.values()), {}
        return restores

    def save_checkpoint(self, request_id, key: bytes) -> tuple[int, int] | None:
        """(request slot, checkpoint slot): the copy that makes ``request_id``'s state, once its
        step has run up to the end of the page keyed ``key``, the checkpoint at ``key``; None
        when one is kept already or there are no checkpoint slots. Call it after that step is
        launched and copy at once (the slot may have held the least recently used one)."""
        slot = self.checkpoints.take(key) if self.checkpoints is not None else None
        return None if slot is None else (self.state_slot(request_id), slot)

    def register(self, request_id, tokens, cached: int | None = None) -> int:
        """Cache the full pages of ``request_id`` whose KV now holds ``tokens[:cached]`` (its
        sequence so far: prompt, then generated tokens; ``cached`` None: all of them; pages
        already registered are skipped, and only the new pages' tokens are read). A page whose
        key another page already holds stays uncached (it is freed on release). Returns the
        number of read-only pages; 0, changing nothing, for a request that holds no pages (one
        released while its step was in flight)."""
        if request_id not in self._tables:
            return 0
        tokens = token_list(tokens)
        cached = len(tokens) if cached is None else min(cached, len(tokens))
        keys = self._keys.setdefault(request_id, [])
        table = self.table(request_id)
        if cached // self.page_size > len(table):
            raise ValueError(f"register({request_id!r}): {cached} tokens but the table "
                             f"holds {len(table)} pages of {self.page_size}")
        parent = keys[-1] if keys else ROOT
        for key in page_keys(tokens, self.page_size, len(keys), parent,
                             stop=cached // self.page_size):
            page = table[len(keys)]
            if key not in self._page_of:
                self._page_of[key] = page
                self._key_of[page] = key
                self._keys_changed += 1
            keys.append(key)
        return len(keys)

    def read_only_pages(self, request_id) -> int:
        """The number of leading pages of ``request_id``'s table that are full and registered
        (shared at admission or cached since): no write may land there."""
        return len(self._keys.get(request_id, []))

    def state(self) -> CacheState:
        return CacheState(tuple(self._free), tuple(self._lru), tuple(self._refs),
                          tuple(self._key_of),
                          tuple((r, tuple(t)) for r, t in self._tables.items()))

    def release(self, request_id) -> None:
        self._keys.pop(request_id, None)
        self._restore_from.pop(request_id, None)
        self._restores.pop(request_id, None)
        super().release(request_id)

    def grow(self, num_pages: int) -> None:
        """``PageAllocator.grow``, each new page uncached and unreferenced."""
        added = num_pages - self.num_pages
        super().grow(num_pages)
        self._refs += [0] * added
        self._key_of += [None] * added

    def release_all(self) -> None:
        """``PageAllocator.release_all``, the cache and the state checkpoints emptied too (a
        fault costs the cached prefixes, never a partner's agreement)."""
        super().release_all()
        self._keys.clear()
        self._restore_from.clear()
        self._restores.clear()
        self._refs = [0] * self.num_pages
        self._key_of = [None] * self.num_pages
        self._page_of.clear()
        self._keys_changed += 1
        self._lru.clear()
        if self.checkpoints is not None:
            self.checkpoints = StateCheckpoints(self.checkpoints.slots)

    def _match(self, prompt: list[int], max_cached_tokens: int | None,
               known: Sequence[bytes] | None = None, checkpointed: bool = True):
        limit = max(0, len(prompt) - 1)
        if max_cached_tokens is not None:
            limit = min(limit, max_cached_tokens)
        shared, keys = self._chain(prompt, limit // self.page_size, known)
        if checkpointed and self.checkpoints is not None:  # a hybrid starts where a state was kept
            depth = self.checkpoints.deepest(keys)
            shared, keys = shared[:depth], keys[:depth]
        return shared, keys

    def _chain(self, prompt: list[int], pages: int, known: Sequence[bytes] | None):
        """The cached pages of ``prompt``'s first ``pages`` full pages, to the first uncached
        one, and their keys. The answer over a caller's ``known`` keys is kept until the cache's
        keys change: the head of the queue is matched every step (8k pages at 128k: 1 ms)."""
        memo = self._memo
        if (known is not None and memo is not None and memo[0] is known
                and memo[1:3] == (pages, self._keys_changed)):
            return list(memo[3]), list(memo[4])
        shared, keys, parent = [], [], ROOT
        for page in range(pages):
            key = known[page] if known is not None else page_key(
                parent, prompt[page * self.page_size:(page + 1) * self.page_size])
            if key not in self._page_of:
                break
            shared.append(self._page_of[key])
            keys.append(key)
            parent = key
        if known is not None:  # ``known`` is kept alive (and ``is`` compared) by the memo
            self._memo = (known, pages, self._keys_changed, shared, keys)
        return list(shared), list(keys)

    def _take(self, count: int) -> list[int]:
        pages = [self._free.popleft() for _ in range(min(count, len(self._free)))]
        while len(pages) < count:
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of[page]]
            self._keys_changed += 1
            if self.checkpoints is not None:  # no prompt can match up to it any more
                self.checkpoints.drop(self._key_of[page])
            self._key_of[page] = None
            pages.append(page)
        for page in pages:
            self._refs[page] = 1
        return pages

    def _give_back(self, pages: list[int]) -> None:
        # The last pages of a chain are the least useful (a match needs every page before), so
        # they enter the LRU first and go first.
        freed = []
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            if self._key_of[page] is None:
                freed.append(page)
            else:
                self._lru[page] = None
        self._free.extend(reversed(freed))


def writes_shared_page(allocator, rows) -> bool:
    """Whether a row of ``rows`` would write into a cached page (read-only: another request
    may share it)."""
    return isinstance(allocator, PrefixCachingAllocator) and any(
        r.start < allocator.read_only_pages(r.request) * allocator.page_size for r in rows)
