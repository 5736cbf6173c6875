"""The step plan: everything one forward step needs that is not a weight.

Built once per step on the host from logical data every partner shares (query lengths, context
lengths, page tables) plus this partner's placement, then read by every attention layer.
"""

from __future__ import annotations

import itertools
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


def dense_table(page_tables: Sequence[Sequence[int]] | torch.Tensor, sink_page: int,
                width: int | None = None) -> torch.Tensor:
    """[B, width] int64 page table padded with the sink page (width: the longest table)."""
    if isinstance(page_tables, torch.Tensor):
        table = page_tables.to(torch.int64)
        if width is not None and width != table.shape[1]:
            raise ValueError(f"a page table of {table.shape[1]} pages is not {width} wide")
        return table
    counts = torch.tensor([len(t) for t in page_tables], dtype=torch.int64)
    longest = int(counts.max()) if len(page_tables) else 0
    if width is not None and width < longest:
        raise ValueError(f"a page table of {longest} pages exceeds table_width {width}")
    width = max(1, longest) if width is None else width
    table = torch.full((len(page_tables), width), sink_page, dtype=torch.int64)
    if any(isinstance(t, torch.Tensor) for t in page_tables):
        # Tables held as tensors (PageAllocator.table_tensor): one copy, however long they are.
        flat = torch.cat([t.to(torch.int64) if isinstance(t, torch.Tensor)
                          else torch.tensor(t, dtype=torch.int64) for t in page_tables])
    else:
        flat = torch.tensor(list(itertools.chain.from_iterable(page_tables)), dtype=torch.int64)
    table[torch.arange(width) < counts[:, None]] = flat
    return table


def paged_indptrs(
    lens: torch.Tensor, page_tables: Sequence[Sequence[int]] | torch.Tensor, page_size: int,
    sink_page: int, table_width: int | None = None,
) -> PagedIndptrs:
    """CSR over pages of ``page_size`` slots for rows of ``lens`` tokens (host tensors); the dense
    table is ``table_width`` pages wide (default: the longest page table)."""
    lens = lens.to(torch.int64)
    table = dense_table(page_tables, sink_page, table_width)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = table[torch.arange(table.shape[1]) < pages[:, None]]
    last = torch.where(lens > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    i32 = torch.int32
    return PagedIndptrs(lens.to(i32), indptr.to(i32), indices.to(i32), last.to(i32),
                        table.to(i32))


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
        graph_bucket: (rows, tokens, max_pages) of the captured CUDA-graph bucket this step
            replays (its shape and the page ids its kernels were sized for), or
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
    graph_bucket: tuple[int, int, int] | None = None

    @property
    def kv_lens(self) -> torch.Tensor:
        return self.ctx_lens + self.q_lens

    def context_only(self) -> StepPlan:
        """The same step with rows attending only their cached context from the pool."""
        lens = self.placement.local_length(self.ctx_lens.cpu())
        host = paged_indptrs(lens, self.context_host.table, self.local_page_size, self.sink_page)
        return replace(self, context=host.to(self.positions.device), context_host=host,
                       is_decode=False)


def _upload(host: list[torch.Tensor], device: torch.device
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Same-dtype host tensors on ``device`` through one pinned host-to-device copy: (device
    tensors, the host tensors as views of the pinned buffer). Pinned, the host copies that
    FlashInfer's plan makes from them run asynchronously: from pageable memory a copy first waits
    for the stream, which would serialise planning ahead with the step still running."""
    if device.type == "cpu":
        return host, host
    sizes = [t.numel() for t in host]
    pinned = torch.cat([t.flatten() for t in host]).pin_memory()
    flat = pinned.to(device, non_blocking=True)
    return ([part.view(t.shape) for part, t in zip(flat.split(sizes), host)],
            [part.view(t.shape) for part, t in zip(pinned.split(sizes), host)])


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
    q_t = torch.tensor(list(q_lens) + [pad_q] * (padded_rows - rows), dtype=torch.int64)
    c_t = torch.tensor(list(ctx_lens) + [0] * (padded_rows - rows), dtype=torch.int64)
    table = dense_table(list(page_tables) + [[sink_page]] * (padded_rows - rows), sink_page,
                        table_width)
    qo_indptr = torch.zeros(padded_rows + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.cumsum(q_t, 0)

    # Every token of a row (padding rows of a decode bucket included), then token padding.
    row_of = torch.repeat_interleave(torch.arange(padded_rows), q_t)
    step = torch.arange(row_of.shape[0]) - qo_indptr[row_of]
    real = row_of < rows
    tail = padded_tokens - row_of.shape[0]
    token_row = torch.cat((row_of, torch.full((tail,), -1, dtype=torch.int64)))
    positions = torch.cat((torch.where(real, c_t[row_of] + step, 0),
                           torch.zeros(tail, dtype=torch.int64)))
    pages = torch.where(real, table[row_of, positions[: row_of.shape[0]] // page_size],
                        sink_page)
    pages = torch.cat((pages, torch.full((tail,), sink_page, dtype=torch.int64)))
    physical_pages, slots = placement.write_slots(pages, positions % page_size, sink_page)
    write_index = physical_pages * local_page + slots

    attend = c_t + q_t if is_decode else c_t
    host = paged_indptrs(placement.local_length(attend), table, local_page, sink_page)
    dev = torch.device(device)
    i32 = torch.int32
    (qo_d, q_d, c_d, *context_d), (qo_h, _, _, *context_h) = _upload(
        [qo_indptr.to(i32), q_t.to(i32), c_t.to(i32), host.lens, host.indptr, host.indices,
         host.last_page_len, host.table], dev)
    (positions_d, token_row_d, write_index_d), _ = _upload([positions, token_row, write_index],
                                                           dev)
    return StepPlan(
        num_rows=rows,
        num_tokens=num_tokens,
        qo_indptr=qo_d,
        q_lens=q_d,
        ctx_lens=c_d,
        positions=positions_d,
        token_row=token_row_d,
        write_index=write_index_d,
        context=PagedIndptrs(*context_d),
        context_host=PagedIndptrs(*context_h),
        qo_indptr_host=qo_h,
        is_decode=is_decode,
        page_size=page_size,
        local_page_size=local_page,
        sink_page=sink_page,
        placement=placement,
        token_index=None if token_index is None else token_index.to(dev),
    )
