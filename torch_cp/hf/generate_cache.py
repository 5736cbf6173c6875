"""GenerateCache: the paged cache ``model.generate`` runs a patched model with.

Each call's padded ``[B, S]`` input and ``[B, past + S]`` mask become a step plan whose
``token_index`` picks the real tokens; each row keeps its logical length and pages. Given back
for a conversation's next turn, the cache grows (``hold``), keeping the pages it holds.
"""

from __future__ import annotations

import logging

import torch

from torch_cp.agreement import together
from torch_cp.engine.memory import pool_fit_problems
from torch_cp.hf.cache import PagedKVCache
from torch_cp.kv.allocator import PageAllocator
from torch_cp.plan import build_step_plan
from torch_cp.runtime import new_pools

log = logging.getLogger("torch_cp")


class GenerateCache(PagedKVCache):
    """A ``PagedKVCache`` whose step plans come from padded ``[B, S]`` inputs (``model.generate``).

    Args:
        runtime, pool, state: as for ``PagedKVCache`` (a hybrid model's state pool has a slot
            per row: row r's state lives in slot r).
        batch_size: rows B of every forward it serves.
    """

    def __init__(self, runtime, pool, batch_size: int, state=None):
        super().__init__(runtime, pool, state)
        self._init_rows(batch_size, pool.num_pages, pool.page_size)

    @classmethod
    def deferred(cls, runtime, batch_size: int, num_pages: int, page_size: int
                 ) -> GenerateCache:
        """A cache whose pools are allocated at its first forward. ``model.generate`` makes its
        cache before transformers checks the rest of its settings (a temperature of 0, stop
        strings without a tokenizer): those fail before anything sized by max_new_tokens is
        allocated (helper 116)."""
        cache = cls.__new__(cls)
        PagedKVCache.__init__(cache, runtime, None)
        cache._init_rows(batch_size, num_pages, page_size)
        return cache

    def _init_rows(self, batch_size: int, num_pages: int, page_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rows = batch_size
        self.allocator = PageAllocator(num_pages, page_size)
        self.row_lens = [0] * batch_size  # real tokens cached per row
        self.columns = 0  # padded columns seen: the length transformers counts
        self.held_pages = 0  # what ``hold`` asked for, grown to at the next forward
        # A forward planned and not yet finished (``prepare`` sets it, the model's forward hook
        # clears it): one that raised left the counts above ahead of what the pool holds.
        self.in_flight = False

    def prepare(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Plan the forward of ``input_ids`` [B, S] whose real tokens ``attention_mask``
        [B, past + S] (or [B, S]; ``None``: all real) marks with 1."""
        self.check_not_interrupted()
        if input_ids.dim() != 2 or input_ids.shape[0] != self.rows:
            raise ValueError(f"this cache serves input_ids of shape [{self.rows}, S], "
                             f"got {list(input_ids.shape)}")
        if self.held_pages > self.allocator.num_pages:
            self._grow(self.held_pages)
        self.held_pages = 0
        if self.pool is None:
            self.pool, self.state = new_pools(self.runtime, self.allocator.num_pages,
                                              self.allocator.page_size, self.rows,
                                              "allocating the generate cache")
        b, s = input_ids.shape
        mask = (torch.ones(b, s, dtype=torch.bool) if attention_mask is None
                else attention_mask[:, -s:].to("cpu", torch.bool))
        q_lens = mask.sum(1).tolist()
        rows = [r for r in range(b) if q_lens[r] > 0]  # a chunk may hold only a row's padding
        missing = sum(self.allocator.missing_pages(r, self.row_lens[r] + q_lens[r]) for r in rows)
        if missing > self.allocator.free_pages:  # ``hold`` sized it from a max_length that
            # counted only this call's input (its input_ids the new tokens alone): at least double
            self._grow(max(2 * self.allocator.num_pages,
                           self.allocator.num_pages + missing - self.allocator.free_pages))
        self.in_flight = True  # from here the counts run ahead of what the layers wrote
        if not rows:  # a prefill chunk of left padding only: nothing to attend, nothing cached
            self.plan = build_step_plan([], [], [], page_size=self.pool.page_size,
                                        sink_page=self.pool.sink_page,
                                        placement=self.runtime.placement,
                                        device=self.runtime.device)
            self.columns += s
            return
        with torch.inference_mode(False):  # the tables' tensors: see ``_grow``
            for r in rows:
                assert self.allocator.reserve(r, self.row_lens[r] + q_lens[r]), "grown to fit"
        # Tokens of a row are consecutive in the flattened input, so rows stay in order.
        token_index = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
        plan = build_step_plan(
            [q_lens[r] for r in rows], [self.row_lens[r] for r in rows],
            [self.allocator.table_tensor(r) for r in rows], page_size=self.pool.page_size,
            sink_page=self.pool.sink_page, placement=self.runtime.placement,
            device=self.runtime.device, token_index=token_index,
            state_slots=None if self.state is None else rows,
            sink_slot=None if self.state is None else self.state.sink_slot)
        self.begin_step(plan)
        for r in rows:
            self.row_lens[r] += q_lens[r]
        self.columns += s

    def check_not_interrupted(self) -> None:
        """Refuse a cache whose last forward raised: it counts that forward's tokens as cached,
        but the layers after the fault never wrote theirs (and a hybrid's earlier layers moved
        their state), so a retry would attend KV that is not there (helper 112: other tokens,
        no error)."""
        if self.in_flight:
            raise ValueError("this cache's last forward raised before it finished, so it no "
                             "longer matches what it holds: make a new one with "
                             "torch_cp.new_cache(model, batch_size, max_length)")

    def hold(self, max_length: int) -> None:
        """At the next forward, grow the pool, keeping every page it holds, until each row can
        reach ``max_length`` tokens: a cache passed back to ``generate`` for a conversation's
        next turn (its ``cache``) was sized for the turn before. Not now: transformers checks
        the rest of the call after (helper 118). (A step that still does not fit grows it too:
        ``prepare``.)"""
        self.held_pages = self.rows * -(-max_length // self.allocator.page_size)

    def check_cached_columns(self, attention_mask: torch.Tensor | None) -> None:
        """Refuse a mask [B, columns + S] that marks the cached columns otherwise than they were
        cached: the pool holds each row's real tokens in order and attends all of them, so a
        column cached as real cannot be masked out later (Hugging Face's cache can: another
        answer), nor one cached as padding (never written) marked real."""
        if self.columns == 0:
            return
        if attention_mask is None:
            marked = [self.columns] * self.rows
        elif attention_mask.dim() != 2 or attention_mask.shape[1] < self.columns:
            marked = None
        else:
            marked = attention_mask[:, :self.columns].to("cpu", torch.bool).sum(1).tolist()
        if marked == self.row_lens:
            return
        pairs = [] if marked is None else list(zip(marked, self.row_lens))
        reasons = []
        if marked is None or any(m < n for m, n in pairs):
            reasons.append("a cached column cannot be masked out afterwards (keep 1 where the "
                           "last call generated, the padding after an EOS included)")
        if any(m > n for m, n in pairs):
            reasons.append("a column cached as padding cannot be marked real afterwards (keep "
                           "the last call's mask for its columns)")
        why = " and ".join(reasons)
        raise ValueError(
            f"the cache passed holds {self.row_lens} real tokens a row in its first "
            f"{self.columns} columns; the attention mask marks "
            f"{'fewer columns' if marked is None else marked}: {why}; or generate without "
            f"the cache (or with a new one, if the call that filled it raised)")

    def _grow(self, pages: int) -> None:
        """A pool of ``pages`` pages holding this one's (the new one allocated first)."""
        if pages <= self.allocator.num_pages:
            return
        old = self.pool
        if old is None:  # not allocated yet: it will be at this size
            self.allocator.grow(pages)
            return

        def allocate():
            problems = pool_fit_problems(self.runtime, old.page_size, pages)
            if problems:  # a ValueError, before the allocation would fail or overcommit
                raise ValueError(f"the generate cache cannot grow to {pages} pages: "
                                 f"{problems[0]}")
            return self.runtime.new_pool(pages, old.page_size)

        # Never inference tensors (made under torch.inference_mode, a next turn outside it
        # could not write them); on every rank or on none (a rank out of memory alone left the
        # others in a collective).
        with torch.inference_mode(False):
            pool = together(self.runtime.spans_ranks, self.runtime.device,
                            f"growing the generate cache to {pages} pages", allocate)
            for grown, held in zip(pool.tensors, old.tensors):
                grown[:, :old.num_pages].copy_(held[:, :old.num_pages])  # dim 1: pages, no sink
        log.info("the generate cache grows from %d to %d pages", old.num_pages, pages)
        self.pool = pool  # before the allocator: its pages never outnumber the pool's
        self.allocator.grow(pages)

    def logical(self) -> dict:
        """What every rank's cache must agree on, its KV aside (each partner holds its own
        stripe, each TP rank its own heads): rows, pages and what each row has cached."""
        return dict(rows=self.rows, num_pages=self.allocator.num_pages,
                    page_size=self.allocator.page_size, row_lens=self.row_lens,
                    columns=self.columns,
                    tables=[self.allocator.table(r) for r in range(self.rows)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Padded columns already fed (what ``generate`` slices its next input by)."""
        return self.columns

    @property
    def batch_size(self) -> int:
        return self.rows

    # The base class answers from its (empty) layer list; answer for the pool's attention layers.
    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.runtime.num_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.runtime.num_layers

    @property
    def is_croppable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx):
        raise ValueError("torch_cp's paged cache does not support beam search (num_beams > 1)")

    def batch_repeat_interleave(self, repeats: int):
        raise ValueError("torch_cp's paged cache cannot expand rows after it is built")

    def batch_select_indices(self, indices):
        raise ValueError("torch_cp's paged cache cannot select rows")

    def crop(self, max_length: int):
        raise ValueError("torch_cp's paged cache cannot be cropped (assisted decoding)")


def finished_forward(module, args, kwargs, output) -> None:
    """The patched model's forward hook: a ``GenerateCache``'s forward finished."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, GenerateCache):
        cache.in_flight = False
