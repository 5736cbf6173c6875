"""Where a token's KV lives when P partners stripe one paged pool.

Logical slot ``s`` of a page (``0 <= s < page_size``) lives on partner ``s % P`` at physical slot
``s // P`` of the same page id. Because ``page_size % P == 0``, a token at sequence position
``t`` has ``t % P == (t % page_size) % P``, so ownership is ``t % P`` and partner ``r`` holds the
tokens ``r, r + P, r + 2P, ...`` of every row, packed densely into pages of ``page_size // P``
slots under the same (logical) page ids. Partner ``r`` therefore sees an ordinary paged cache of
page size ``page_size // P`` whose row of ``L`` tokens has ``local_length(L) = ceil((L - r) / P)``
tokens (0 when ``L <= r``). A non-owner writes every token to the sink page, so all partners run
the same write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

Mode = Literal["tp", "sp"]


def page_size_problems(page_size, partners: int) -> list[str]:
    """Why ``page_size`` cannot be striped over ``partners`` ranks (the one place this rule
    lives: validation, pools, plans, engines and sizing all ask it)."""
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        return [f"page_size must be a positive int, got {page_size!r}"]
    if page_size % partners:
        return [f"page_size {page_size} is not a multiple of P = {partners}"]
    return []


@dataclass(frozen=True)
class ContextParallel:
    """One rank's view of a placed pool.

    Attributes:
        size: P, the number of partners that share one placed pool.
        rank: this rank's partner index in ``[0, P)``.
        mode: ``"tp"`` (partners are TP ranks that share a KV head) or ``"sp"`` (SP ranks of a
            replicated model).
        group: the partners' process group; ``None`` only when ``size == 1``.
    """

    size: int
    rank: int
    mode: Mode = "tp"
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        problems = []
        if self.size < 1:
            problems.append(f"size must be >= 1, got {self.size}")
        if not 0 <= self.rank < max(self.size, 1):
            problems.append(f"rank {self.rank} is outside [0, {self.size})")
        if self.mode not in ("tp", "sp"):
            problems.append(f"mode must be 'tp' or 'sp', got {self.mode!r}")
        if self.size > 1 and self.group is None:
            problems.append("a placement over more than one partner needs a process group")
        if problems:
            raise ValueError("invalid ContextParallel: " + "; ".join(problems))

    @staticmethod
    def single() -> ContextParallel:
        """The trivial placement: one partner holds everything."""
        return ContextParallel(size=1, rank=0)

    def page_size_problems(self, page_size) -> list[str]:
        return page_size_problems(page_size, self.size)

    def local_page_size(self, page_size: int) -> int:
        """Slots of a physical page: ``page_size // P``."""
        problems = self.page_size_problems(page_size)
        if problems:
            raise ValueError(problems[0])
        return page_size // self.size

    # Slot math. Works on ints and on integer tensors alike.

    def owner(self, position):
        """Partner that stores the token at sequence position (or page slot) ``position``."""
        return position % self.size

    def local_slot(self, offset):
        """Physical slot inside its page of logical page slot ``offset``."""
        return offset // self.size

    def local_length(self, length, rank: int | None = None):
        """Tokens among positions ``[0, length)`` that partner ``rank`` (default: this) holds."""
        r = self.rank if rank is None else rank
        if isinstance(length, torch.Tensor):
            return torch.clamp(length - r + self.size - 1, min=0) // self.size
        return max(length - r + self.size - 1, 0) // self.size

    def write_slots(
        self, pages: torch.Tensor, offsets: torch.Tensor, sink_page: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Map logical (page id, slot in page) of new tokens to this partner's physical slots.

        The owner (``offset % P == rank``) writes ``(page, offset // P)``; every other partner
        writes ``(sink_page, offset // P)``, so the write has the same shape on every partner.
        """
        own = self.owner(offsets) == self.rank
        physical_pages = torch.where(own, pages, torch.full_like(pages, sink_page))
        return physical_pages, self.local_slot(offsets)
