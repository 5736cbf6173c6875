"""The step plan: everything one forward step needs that is not a weight.

Built once per step on the host from logical data every partner shares (query lengths, context
lengths, page tables) plus this partner's placement, then read by every attention layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from torch_cp.placement import ContextParallel


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


def paged_indptrs(
    lens: torch.Tensor, page_tables: Sequence[Sequence[int]], page_size: int, sink_page: int,
    table_width: int | None = None,
) -> PagedIndptrs:
    """CSR over pages of ``page_size`` slots for rows of ``lens`` tokens (host tensors); the dense
    table is ``table_width`` pages wide (default: the longest page table)."""
    lens = lens.to(torch.int64)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = [p for table, n in zip(page_tables, pages.tolist()) for p in table[:n]]
    last = torch.where(lens > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    width = max(1, max((len(t) for t in page_tables), default=1))
    if table_width is not None:
        if table_width < width:
            raise ValueError(f"a page table of {width} pages exceeds table_width {table_width}")
        width = table_width
    table = torch.full((len(lens), width), sink_page, dtype=torch.int32)
    for b, t in enumerate(page_tables):
        table[b, : len(t)] = torch.tensor(list(t), dtype=torch.int32)
    i32 = torch.int32
    return PagedIndptrs(lens.to(i32), indptr.to(i32), torch.tensor(indices, dtype=i32),
                        last.to(i32), table)


@dataclass(frozen=True)
class StepPlan:
    """What every attention layer of one step reads. Tensors live on the step's device.

    Rows are sequences; tokens are the flattened new tokens of all rows, row after row
    (``qo_indptr``), followed by any padding tokens up to the bucket. Padding rows (past
    ``num_rows``) have no context and write to the sink page.

    Attributes:
        num_rows: real rows. ``q_lens.shape[0]`` may be larger (padding rows).
        num_tokens: real tokens. ``positions.shape[0]`` may be larger (padding tokens).
        qo_indptr: [B + 1] int32, row b's tokens are ``[qo_indptr[b], qo_indptr[b + 1])``.
        q_lens, ctx_lens: [B] int32 logical new tokens and cached tokens per row.
        positions: [N] int64 sequence position of each token (0 for padding tokens).
        token_row: [N] int64 row of each token, -1 for padding tokens.
        write_index: [N] int64 flat physical slot (``page * local_page_size + slot``) this partner
            writes each token's K/V to; non-owned and padding tokens go to the sink page.
        context: this partner's paged view of the KV each row attends from the pool: ``ctx + q``
            tokens for a decode step (the new token is written first), ``ctx`` tokens otherwise.
        context_host: the same on the host, for kernels that plan from host indptrs.
        qo_indptr_host: [B + 1] int32 on the host.
        is_decode: every real row adds exactly one token and there is no token padding; the step
            attends the pool only. Otherwise rows also attend their own tokens causally.
        page_size, local_page_size, sink_page: pool geometry.
        placement: the partner this plan was built for.
        token_index: [num_tokens] int64 index of each real token in the model's flattened
            ``[batch * seq]`` input when that input is not packed (``model.generate`` with padded
            rows); ``None`` when the input is the packed tokens themselves.
        graph_bucket: (rows, tokens) of the captured CUDA-graph bucket this step replays, or
            None for an eager step; backends keep graph-ready kernels per bucket.
    """

    num_rows: int
    num_tokens: int
    qo_indptr: torch.Tensor
    q_lens: torch.Tensor
    ctx_lens: torch.Tensor
    positions: torch.Tensor
    token_row: torch.Tensor
    write_index: torch.Tensor
    context: PagedIndptrs
    context_host: PagedIndptrs
    qo_indptr_host: torch.Tensor
    is_decode: bool
    page_size: int
    local_page_size: int
    sink_page: int
    placement: ContextParallel
    token_index: torch.Tensor | None = None
    graph_bucket: tuple[int, int] | None = None

    @property
    def kv_lens(self) -> torch.Tensor:
        return self.ctx_lens + self.q_lens

    def context_only(self) -> StepPlan:
        """The same step with rows attending only their cached context from the pool."""
        lens = self.placement.local_length(self.ctx_lens.cpu())
        tables = self.context_host.table.tolist()
        host = paged_indptrs(lens, tables, self.local_page_size, self.sink_page,
                             table_width=len(tables[0]) if tables else None)
        return replace(self, context=host.to(self.positions.device), context_host=host,
                       is_decode=False)


def build_step_plan(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    *,
    page_size: int,
    sink_page: int,
    placement: ContextParallel | None = None,
    device: torch.device | str = "cpu",
    pad_rows_to: int | None = None,
    pad_tokens_to: int | None = None,
    token_index: torch.Tensor | None = None,
    table_width: int | None = None,
) -> StepPlan:
    """Build the step plan for one partner.

    Args:
        q_lens: new tokens per row (>= 1 for real rows).
        ctx_lens: tokens already cached per row.
        page_tables: logical page ids of each row, enough for ``ctx + q`` tokens.
        page_size: logical page size (a multiple of P).
        sink_page: the reserved physical page non-owners and padding write to.
        placement: this partner's placement (default: one partner).
        pad_rows_to, pad_tokens_to: bucket sizes; padding rows have one token (decode) or none.
        token_index: see ``StepPlan.token_index``.
        table_width: pages in each row of the dense page table (a bucket fixes it).
    """
    placement = placement or ContextParallel.single()
    rows = len(q_lens)
    problems = []
    try:
        local_page = placement.local_page_size(page_size)
    except ValueError as e:
        problems.append(str(e))
    if not (rows == len(ctx_lens) == len(page_tables)):
        problems.append("q_lens, ctx_lens and page_tables must have one entry per row")
    if any(q < 1 for q in q_lens):
        problems.append(f"every row needs at least one new token, got q_lens={list(q_lens)}")
    for b, (q, c, t) in enumerate(zip(q_lens, ctx_lens, page_tables)):
        if len(t) * page_size < q + c:
            problems.append(f"row {b}: {len(t)} pages cannot hold {q + c} tokens")
    if problems:
        raise ValueError("invalid step: " + "; ".join(problems))
    is_decode = all(q == 1 for q in q_lens)
    num_tokens = sum(q_lens)
    padded_rows = max(pad_rows_to or rows, rows)
    if is_decode:
        padded_tokens = padded_rows
        if pad_tokens_to not in (None, padded_rows):
            is_decode = False  # token padding past the rows: attend own tokens apart
            padded_tokens = max(pad_tokens_to, num_tokens)
    else:
        padded_tokens = max(pad_tokens_to or num_tokens, num_tokens)
    pad_q = 1 if is_decode else 0
    q_all = list(q_lens) + [pad_q] * (padded_rows - rows)
    c_all = list(ctx_lens) + [0] * (padded_rows - rows)
    tables = [list(t) for t in page_tables] + [[sink_page]] * (padded_rows - rows)

    q_t = torch.tensor(q_all, dtype=torch.int64)
    c_t = torch.tensor(c_all, dtype=torch.int64)
    qo_indptr = torch.zeros(padded_rows + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.cumsum(q_t, 0)

    positions = torch.zeros(padded_tokens, dtype=torch.int64)
    token_row = torch.full((padded_tokens,), -1, dtype=torch.int64)
    pages = torch.full((padded_tokens,), sink_page, dtype=torch.int64)
    offsets = torch.zeros(padded_tokens, dtype=torch.int64)
    for b in range(rows):
        start, q, c = int(qo_indptr[b]), q_all[b], c_all[b]
        pos = torch.arange(c, c + q)
        positions[start : start + q] = pos
        token_row[start : start + q] = b
        table = torch.tensor(tables[b], dtype=torch.int64)
        pages[start : start + q] = table[pos // page_size]
        offsets[start : start + q] = pos % page_size
    for b in range(rows, padded_rows):  # padding rows of a decode bucket
        start = int(qo_indptr[b])
        token_row[start : start + q_all[b]] = b
    physical_pages, slots = placement.write_slots(pages, offsets, sink_page)
    write_index = physical_pages * local_page + slots

    attend = c_t + q_t if is_decode else c_t
    host = paged_indptrs(placement.local_length(attend), tables, local_page, sink_page,
                         table_width)
    dev = torch.device(device)
    i32 = torch.int32
    return StepPlan(
        num_rows=rows,
        num_tokens=num_tokens,
        qo_indptr=qo_indptr.to(i32).to(dev),
        q_lens=q_t.to(i32).to(dev),
        ctx_lens=c_t.to(i32).to(dev),
        positions=positions.to(dev),
        token_row=token_row.to(dev),
        write_index=write_index.to(dev),
        context=host.to(dev),
        context_host=host,
        qo_indptr_host=qo_indptr.to(i32),
        is_decode=is_decode,
        page_size=page_size,
        local_page_size=local_page,
        sink_page=sink_page,
        placement=placement,
        token_index=None if token_index is None else token_index.to(dev),
    )
