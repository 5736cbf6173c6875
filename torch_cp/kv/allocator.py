"""Logical page allocation. Sees only logical lengths, so every partner decides the same."""

from __future__ import annotations

from collections import deque

import torch


class PageAllocator:
    """Free list of logical page ids and the page table of each live request, and for hybrid
    models the state-pool slot of each.

    ``reserve`` answers ``False`` ("not now") when the free pages cannot cover a request's growth,
    and changes nothing in that case; ``release`` returns every page of a request, and its state
    slot with them.

    Args:
        num_pages, page_size: the pool's logical pages.
        state_slots: slots of the state pool (0: the model keeps no linear-attention state).
    """

    def __init__(self, num_pages: int, page_size: int, state_slots: int = 0):
        if num_pages < 1 or page_size < 1 or state_slots < 0:
            raise ValueError(
                f"need num_pages >= 1, page_size >= 1 and state_slots >= 0, got {num_pages}, "
                f"{page_size}, {state_slots}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.state_slots = state_slots
        self._free_slots: deque[int] = deque(range(state_slots))
        self._slot_of: dict[object, int] = {}
        self._free: deque[int] = deque(range(num_pages))
        self._tables: dict[object, list[int]] = {}
        self._arrays: dict[object, torch.Tensor] = {}  # the same tables, with room to grow

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def table(self, request_id) -> list[int]:
        return self._tables.get(request_id, [])

    def table_tensor(self, request_id) -> torch.Tensor:
        """``table(request_id)`` as an int64 CPU tensor (a view valid until the request's next
        ``reserve`` or ``release``): step planning copies it instead of converting a long list
        of Python ints every step."""
        array = self._arrays.get(request_id)
        n = len(self.table(request_id))
        return array[:n] if array is not None else torch.empty(0, dtype=torch.int64)

    def missing_pages(self, request_id, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(self.table(request_id)))

    def reserve(self, request_id, num_tokens: int) -> bool:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens; False (and no change) if
        the free pages cannot."""
        missing = self.missing_pages(request_id, num_tokens)
        if missing > self.free_pages:
            return False
        self._extend(request_id, self._take(missing))
        return True

    def release(self, request_id) -> None:
        """Return every page of ``request_id`` to the free list, and its state slot (a no-op
        for unknown ids)."""
        self._give_back(self._tables.pop(request_id, []))
        self._arrays.pop(request_id, None)
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    @property
    def live_requests(self) -> list:
        return list(dict.fromkeys([*self._tables, *self._slot_of]))

    @property
    def free_state_slots(self) -> int:
        return len(self._free_slots)

    def take_state_slot(self, request_id) -> int:
        """Give ``request_id`` a state slot (admission checked ``free_state_slots``); it
        returns with the request's pages (``release``)."""
        assert request_id not in self._slot_of, "a request holds one state slot"
        assert self._free_slots, "admission checks free_state_slots first"
        slot = self._slot_of[request_id] = self._free_slots.popleft()
        return slot

    def state_slot(self, request_id) -> int:
        return self._slot_of[request_id]

    def release_all(self) -> None:
        """Release every live request and return to the state of a new allocator: every page
        and state slot free, in order. The engine's fault handling calls it. A
        KeyboardInterrupt can land between any two lines of ``reserve`` or ``release`` (a page
        popped from the free list but not yet in a table, a table popped with its pages not
        yet given back), and on each partner at another line: rebuilding from what is left
        could leave partners deciding differently, a fresh state cannot."""
        self._tables.clear()
        self._arrays.clear()
        self._slot_of.clear()
        self._free = deque(range(self.num_pages))
        self._free_slots = deque(range(self.state_slots))

    def grow(self, num_pages: int) -> None:
        """Add the pages from ``self.num_pages`` up to ``num_pages`` to the free list (the pool
        behind them grew); the tables stay as they are."""
        assert num_pages >= self.num_pages, "a pool only grows"
        self._free.extend(range(self.num_pages, num_pages))
        self.num_pages = num_pages

    # Hooks a caching allocator overrides: where pages come from and where they go back.
    def _take(self, count: int) -> list[int]:
        return [self._free.popleft() for _ in range(count)]

    def _give_back(self, pages: list[int]) -> None:
        self._free.extend(pages)

    # Outside inference mode: a table made inside it would be an inference tensor, which the
    # request's next page, taken in a step outside it, could not be written into (helper 110).
    @torch.inference_mode(False)
    def _extend(self, request_id, new: list[int]) -> None:
        table = self._tables.setdefault(request_id, [])
        table.extend(new)
        if new:
            array = self._arrays.get(request_id)
            if array is None or array.numel() < len(table):
                capacity = 0 if array is None else array.numel()
                grown = torch.empty(max(len(table), 2 * capacity, 8), dtype=torch.int64)
                if array is not None:
                    grown[:len(table) - len(new)] = array[:len(table) - len(new)]
                array = self._arrays[request_id] = grown
            array[len(table) - len(new):len(table)] = torch.tensor(new, dtype=torch.int64)
