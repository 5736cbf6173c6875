"""Logical page allocation. Sees only logical lengths, so every partner decides the same."""

from __future__ import annotations

from collections import deque

import torch


class PageAllocator:
    """Free list of logical page ids and the page table of each live request.

    ``reserve`` answers ``False`` ("not now") when the free pages cannot cover a request's growth,
    and changes nothing in that case; ``release`` returns every page of a request.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
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
        """Return every page of ``request_id`` to the free list (a no-op for unknown ids)."""
        self._give_back(self._tables.pop(request_id, []))
        self._arrays.pop(request_id, None)

    @property
    def live_requests(self) -> list:
        return list(self._tables)

    # Hooks a caching allocator overrides: where pages come from and where they go back.
    def _take(self, count: int) -> list[int]:
        return [self._free.popleft() for _ in range(count)]

    def _give_back(self, pages: list[int]) -> None:
        self._free.extend(pages)

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
