"""Continuous batching over logical lengths: which rows run in the next step.

The scheduler sees only prompts, generated tokens and logical page counts, never a rank's own KV
lengths, so every rank that runs it with the same inputs makes the same decisions (lockstep).

Admission is by free pages (and, for a hybrid model, a free state slot). A request is admitted
when the pool's free pages, less the pages already promised to admitted requests for their
remaining growth, cover its whole lifetime (prompt + max_new_tokens - 1 cached tokens), and
while fewer than ``max_rows`` requests run (so every running request has a row in every step the
token budget allows). Pages are then taken as rows grow, so an admitted request can always run
to its end and nothing ever needs preempting; a request that does not fit waits (first come,
first served) and none is dropped.

With a ``PrefixCachingAllocator`` a request is admitted through ``admit``: its table starts with
the cached pages of its prompt's longest cached prefix, it starts with those tokens ``cached``
(only the rest is prefilled), and its admission is charged ``admission_pages`` (the pages it
allocates plus the shared pages that stop being evictable), so the same promise holds. After a
step commits, the full pages it wrote are registered for later requests to share; a waiting
request whose prefix a running request is still prefilling waits for those pages (admitted at
once, it would prefill them too).

A hybrid model's requests reuse a cached prefix only up to a state checkpoint (``kv/
state_checkpoints.py``). Its prompts' prefill chunks end at page boundaries, at the prompt's
last page boundary a later prompt could share and where its cached prefix ends, so that a
checkpoint is taken at each chunk end (``checkpoint_keys``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from torch_cp.engine.checkpoint_chunks import checkpoint_end, checkpoint_keys
from torch_cp.engine.requests import Request  # noqa: F401 (imported from here too)
from torch_cp.kv.allocator import PageAllocator
from torch_cp.kv.prefix_cache import (  # noqa: F401 (writes_shared_page: imported from here)
    PrefixCachingAllocator,
    page_keys,
    writes_shared_page,
)


@dataclass(frozen=True)
class Row:
    """One row of a step: ``length`` new tokens of request ``request`` after ``start`` cached ones.

    ``samples``: the row ends at the request's last known token, so its logits give a new token
    (a prefill chunk that stops short of the prompt's end samples nothing).
    """

    request: int
    start: int
    length: int
    samples: bool


class Scheduler:
    """Picks each step's rows: decode rows first, then prefill chunks, within a token budget.

    Args:
        allocator: the pool's logical page allocator (request index = allocation id).
        max_tokens_per_step: token budget of a step; a longer prompt is prefilled in chunks
            (extend rows).
        max_rows: most rows a step may have, and most requests running at once (``None``: no
            limit).
    """

    def __init__(self, allocator: PageAllocator, max_tokens_per_step: int,
                 max_rows: int | None = None):
        problems = []
        if max_tokens_per_step < 1:
            problems.append(f"max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        if max_rows is not None and max_rows < 1:
            problems.append(f"max_rows must be >= 1 or None, got {max_rows}")
        if problems:
            raise ValueError("invalid scheduler: " + "; ".join(problems))
        self.allocator = allocator
        self.max_tokens_per_step = max_tokens_per_step
        self.max_rows = max_rows
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # in admission order
        self.caching = isinstance(allocator, PrefixCachingAllocator)
        self.checkpointing = self.caching and allocator.checkpointing
        self.reused_tokens = 0  # prompt tokens admitted with their KV already cached

    def fits_ever(self, request: Request) -> bool:
        """Whether the empty pool could hold the request's whole lifetime."""
        return self.allocator.pages_for(request.lifetime_tokens) <= self.allocator.num_pages

    def add(self, request: Request) -> None:
        if not self.fits_ever(request):
            raise ValueError(f"request {request.index} needs {request.lifetime_tokens} tokens, "
                             f"more than the pool's {self.allocator.num_pages} pages can hold")
        self.waiting.append(request)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _promised_pages(self) -> int:
        a = self.allocator
        return sum(a.missing_pages(r.index, r.lifetime_tokens) for r in self.running.values())

    def _head_fits(self, available_pages: int) -> bool:
        """Whether the head of the queue fits (first come, first served: no request overtakes
        it): a free row, and its whole lifetime within ``available_pages`` (free pages less
        those promised)."""
        if not self.waiting or (self.max_rows is not None and len(self.running) >= self.max_rows):
            return False
        if self.allocator.state_slots and not self.allocator.free_state_slots:
            return False  # a hybrid model's running requests hold every state slot
        request = self.waiting[0]
        # Looked up once a step (a 128k prompt's chain is 8k pages): both checks read it.
        shared = (self.allocator.lookup(request.prompt, keys=self._keys(request))
                  if self.caching else None)
        return (self._admission_pages(request, shared) <= available_pages
                and not (self.caching and self._waits_for_prefix(request, len(shared))))

    def _waits_for_prefix(self, request: Request, cached: int) -> bool:
        """With prefix caching, whether ``request``, whose prompt has ``cached`` pages in the
        cache, waits for a running request still prefilling later pages of its prompt's
        prefix: admitted now it would prefill them too; once they commit it shares them (as
        SGLang's in-batch prefix caching). Not a hybrid model's (its requests share only at
        state checkpoints)."""
        if self.checkpointing:
            return False
        keys, page = self._keys(request), self.allocator.page_size
        shareable = (len(request.prompt) - 1) // page  # lookup's limit: the last token computed
        for other in self.running.values():
            if not other.decoding:
                common = next((i for i, (a, b) in enumerate(zip(keys, self._keys(other)))
                               if a != b), min(len(keys), len(other.prompt) // page))
                if min(common, shareable) > cached:
                    return True
        return False

    def _admission_pages(self, request: Request, shared: list[int] | None = None) -> int:
        """How much admitting ``request`` lowers free pages less promised pages (``shared``:
        its prompt's cached pages, ``lookup``'s answer, when the caller has it)."""
        if self.caching:
            return self.allocator.admission_pages(request.prompt, request.lifetime_tokens,
                                                  keys=self._keys(request), shared=shared)
        return self.allocator.pages_for(request.lifetime_tokens)

    def _keys(self, request: Request) -> list[bytes]:
        """The prompt's page keys, hashed once (the head of the queue is looked up each step)."""
        if request.prompt_keys is None:
            request.prompt_keys = page_keys(request.prompt, self.allocator.page_size)
        return request.prompt_keys

    def _admit(self) -> None:
        a = self.allocator
        available = a.free_pages - self._promised_pages()
        while self._head_fits(available):
            request = self.waiting.popleft()
            free = a.free_pages
            if self.caching:  # shares the cached prefix: only the rest is prefilled
                request.cached = a.admit(request.index, request.prompt,
                                         keys=self._keys(request))
                self.reused_tokens += request.cached
                if self.checkpointing:
                    request.cached_prefix_end = a.shared_pages(
                        request.prompt, self._keys(request)) * a.page_size
            if a.state_slots:
                a.take_state_slot(request.index)
            self.running[request.index] = request
            available -= free - a.free_pages + a.missing_pages(request.index,
                                                                 request.lifetime_tokens)

    def schedule(self, max_rows: int | None = None, max_tokens: int | None = None) -> list[Row]:
        """The next step's rows (empty only when nothing is left to run).

        Reserves the rows' pages; ``commit`` records what the step did. Calling ``schedule``
        again before ``commit`` (a refused step retried smaller) is allowed.
        """
        self._admit()
        caps = [c for c in (max_rows, self.max_rows) if c is not None]
        row_cap = min(caps) if caps else len(self.running)
        budget = min(self.max_tokens_per_step, max_tokens or self.max_tokens_per_step)
        ordered = sorted(self.running.values(), key=lambda r: not r.decoding)  # stable
        rows = []
        for request in ordered:
            if len(rows) >= row_cap or budget < 1:
                break
            n = min(request.pending, budget)
            assert n >= 1, "a running request always has a token to feed"
            end = request.cached + n
            if self.checkpointing and not request.decoding:
                end = checkpoint_end(request, end, self.allocator.page_size)
            rows.append(Row(request.index, request.cached, end - request.cached,
                            samples=end == len(request.tokens)))
            reserved = self.allocator.reserve(request.index, end)
            assert reserved, "admission promised these pages"
            budget -= end - request.cached
        return rows

    def checkpoint_keys(self, rows: list[Row]) -> list[tuple[int, bytes]]:
        """(request, page key) of the rows of a hybrid model's step that end a prompt's page:
        where the step leaves a state worth keeping as a checkpoint."""
        if not self.checkpointing:
            return []
        return checkpoint_keys(rows, self.running, self.allocator.page_size, self._keys)

    def next_decode_rows(self, rows: list[Row]) -> list[Row] | None:
        """What ``schedule`` will return after ``rows`` commit, if no request stops at an EOS
        token: every row decodes one more token, less the requests that reach max_new_tokens.
        Like ``schedule`` it reserves the rows' pages (within the lifetime admission promised;
        a request that stops at EOS returns them). ``None`` where the next step is not certain
        enough to plan ahead for: a waiting request that could be admitted once ``rows``
        commit, or rows that are not decode rows or leave a running request out."""
        if len(rows) != len(self.running) or (
                self.waiting and self._head_fits(self.allocator.free_pages
                                                 - self._promised_pages())):
            return None
        following = []
        for row in rows:
            request = self.running.get(row.request)
            if request is None or row.length != 1 or not row.samples or not request.decoding:
                return None
            if len(request.generated) + 1 >= request.max_new_tokens:
                continue  # this step's token is its last
            following.append(Row(row.request, row.start + 1, 1, samples=True))
        if self.waiting and len(following) < len(rows):
            return None  # a request ends with this step: its row and pages may admit another
        for row in following:
            reserved = self.allocator.reserve(row.request, row.start + 1)
            assert reserved, "admission promised these pages"
        return following or None

    def commit(self, rows: list[Row], new_tokens: dict[int, int],
               eos_token_ids: frozenset[int]) -> list[tuple[Request, str]]:
        """Record a step: rows' tokens are cached, sampled tokens appended (with prefix
        caching, the full pages the step completed are registered).

        Returns the requests that finished, with ``"eos"`` or ``"length"``; their pages are free.
        """
        finished = []
        for row in rows:
            request = self.running[row.request]
            assert row.start == request.cached
            request.cached += row.length
            if self.caching and (request.cached // self.allocator.page_size
                                 > self.allocator.read_only_pages(row.request)):
                self.allocator.register(row.request, request.tokens, request.cached)
            if not row.samples:
                continue
            token = new_tokens[row.request]
            request.append(token)
            if token in eos_token_ids:
                finished.append((request, "eos"))
            elif len(request.generated) >= request.max_new_tokens:
                finished.append((request, "length"))
        for request, _ in finished:
            self.abort(request.index)
        return finished

    def abort(self, request_index: int) -> Request:
        """Stop a request, running (its pages and state slot return) or waiting."""
        if request_index not in self.running:
            request = next(r for r in self.waiting if r.index == request_index)
            self.waiting.remove(request)
            return request
        request = self.running.pop(request_index)
        self.allocator.release(request_index)
        return request

    def abort_all(self) -> None:
        """Drop every request, running or waiting, and return their pages (a step failed)."""
        self.running.clear()
        self.waiting.clear()
        self.allocator.release_all()  # also what an interrupt left half taken or returned

