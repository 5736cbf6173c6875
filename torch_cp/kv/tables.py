"""Page tables as FlashInfer's CSR view: which physical pages hold each row's KV on one partner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedIndptrs:
    """One partner's physical paged view of some per-row KV lengths, in FlashInfer's CSR form.

    Attributes:
        lens: [B] int32, KV tokens this partner holds for each row.
        indptr: [B + 1] int32, row b's pages are ``indices[indptr[b]:indptr[b + 1]]``.
        indices: [nnz] int32 page ids.
        last_page_len: [B] int32, slots used in each row's last page (0 for an empty row).
        table: [B, max_pages] int32 the same pages as a dense table, padded with the sink page.
    """

    lens: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    table: torch.Tensor

    def to(self, device) -> PagedIndptrs:
        return PagedIndptrs(*(t.to(device) for t in (self.lens, self.indptr, self.indices,
                                                     self.last_page_len, self.table)))


def dense_table(page_tables: Sequence[Sequence[int]] | torch.Tensor, sink_page: int,
                width: int | None = None) -> torch.Tensor:
    """[B, width] int64 page table padded with the sink page (width: the longest table)."""
    if isinstance(page_tables, torch.Tensor):
        table = page_tables.to(torch.int64)
        if width is not None and width != table.shape[1]:
            raise ValueError(f"a page table of {table.shape[1]} pages is not {width} wide")
        return table
    rows = [t.to(torch.int64) if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=torch.int64)
            for t in page_tables]
    longest = max((len(t) for t in rows), default=0)
    if width is not None and width < longest:
        raise ValueError(f"a page table of {longest} pages exceeds table_width {width}")
    table = torch.full((len(rows), max(1, longest) if width is None else width), sink_page,
                       dtype=torch.int64)
    # Row by row: a mask over the whole [B, width] table cost a decode step of 64 rows of 128k
    # tokens about 10 ms of host time (helper 96); rows are few, pages many.
    for b, row in enumerate(rows):
        table[b, : len(row)] = row
    return table


def paged_indptrs(
    lens: torch.Tensor, page_tables: Sequence[Sequence[int]] | torch.Tensor, page_size: int,
    sink_page: int, table_width: int | None = None,
) -> PagedIndptrs:
    """CSR over pages of ``page_size`` slots for rows of ``lens`` tokens (host tensors); the dense
    table is ``table_width`` pages wide (default: the longest page table)."""
    i32 = torch.int32
    lens = lens.to(torch.int64)
    table = dense_table(page_tables, sink_page, table_width).to(i32)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(pages, 0)
    # Each row's first pages, row by row (a mask over the whole table cost 7 ms at 64 rows of
    # 8k pages: helper 96).
    indices = torch.cat([row[:n] for row, n in zip(table, pages.tolist())]
                        or [table.new_zeros(0)])
    last = torch.where(lens > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    return PagedIndptrs(lens.to(i32), indptr.to(i32), indices, last.to(i32), table)
