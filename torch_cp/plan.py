"""The step plan: everything one forward step needs that is not a weight.

Built once per step on the host from logical data every partner shares (query lengths, context
lengths, page tables) plus this partner's placement, then read by every attention layer. A step
replayed from a captured CUDA graph carries its ``Bucket``; a backend that refuses a step raises
``StepRefused`` while planning it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torch_cp.kv.tables import PagedIndptrs, dense_table, paged_indptrs
from torch_cp.placement import ContextParallel


@dataclass(frozen=True, order=True)
class Bucket:
    """A captured step shape.

    A decode bucket (``tokens == rows``) holds up to ``rows`` one-token rows; a mixed bucket
    (``tokens > rows``) up to ``rows`` rows of up to ``tokens`` tokens in all. Every row's page
    table is ``table_width = max_pages // rows`` pages wide, so a step of the bucket holds at most
    ``max_pages`` page ids (what graph-ready kernels size their buffers for).
    """

    rows: int
    tokens: int
    max_pages: int

    def __post_init__(self):
        problems = []
        if not 1 <= self.rows <= self.tokens:
            problems.append(f"needs tokens >= rows >= 1, got {self.rows} rows, {self.tokens} "
                            f"tokens")
        if self.rows >= 1 and (self.max_pages < self.rows or self.max_pages % self.rows):
            problems.append(f"max_pages {self.max_pages} is not a positive multiple of rows "
                            f"{self.rows}")
        if problems:
            raise ValueError("invalid bucket: " + "; ".join(problems))

    @property
    def decode(self) -> bool:
        return self.rows == self.tokens

    @property
    def table_width(self) -> int:
        return self.max_pages // self.rows

    def fits(self, rows: int, tokens: int, decode: bool, table_width: int) -> bool:
        """Whether a step of ``rows`` rows, ``tokens`` tokens and page tables up to
        ``table_width`` long can replay this bucket."""
        return (decode == self.decode and rows <= self.rows and tokens <= self.tokens
                and table_width <= self.table_width)


class StepRefused(Exception):
    """A backend refuses a step as too large; the engine retries it with fewer rows or tokens.

    Raise it (or a subclass, e.g. FlashInfer MLA's planner-cap refusal) from ``backend.plan``,
    before any KV is written, and decide it from data every partner shares (query lengths), so
    that all partners refuse together.
    """


@dataclass(frozen=True)
class StepPlan:
    """What every attention layer of one step reads. Tensors live on the step's device.

    Rows are sequences; tokens are the flattened new tokens of all rows, row after row
    (``qo_indptr``), followed by any padding tokens up to the bucket. Padding rows (past
    ``num_rows``) have no context and write to the sink page: the plan's paged views hold the
    real rows' pages only.

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
            tokens for a decode step (the new token is written first), ``ctx`` tokens otherwise;
            none for padding rows.
        context_host: the same on the host, for kernels that plan from host indptrs.
        qo_indptr_host: [B + 1] int32 on the host.
        is_decode: every real row adds exactly one token and there is no token padding; the step
            attends the pool only. Otherwise rows also attend their own tokens causally.
        attends_context: some row attends cached KV (every decode step and every captured
            step, whose replays may). False only for an eager multi-token step of fresh rows
            (a first prefill chunk), whose attention is its own tokens' alone.
        page_size, local_page_size, sink_page: pool geometry.
        placement: the partner this plan was built for.
        token_index: [num_tokens] int64 index of each real token in the model's flattened
            ``[batch * seq]`` input when that input is not packed (``model.generate`` with padded
            rows); ``None`` when the input is the packed tokens themselves.
        bucket: the captured shape this step is padded to and replays, or None (eager).
        state_slots: [B] int64 state-pool slot of each row (hybrid models' linear-attention
            state; padding rows: the sink slot), or None when the model keeps no state.
        state_fresh: [B] int64, 1 where a row's state starts from zeros (no context: a new
            request or a padding row), else 0; None with ``state_slots``. Made once per step
            here, so no layer compares ``ctx_lens`` itself.
        state_sink_slot: the state pool's sink slot the plan was built for, or None.
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
    bucket: Bucket | None = None
    state_slots: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None
    state_sink_slot: int | None = None
    attends_context: bool = True

    @property
    def page_ids(self) -> torch.Tensor:
        """[nnz] int32 page ids of the context on the device (a captured step's buffer holds a
        bucket's worth; this is the prefix the step uses)."""
        return self.context.indices[: self.context_host.indices.numel()]


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
    bucket: Bucket | None = None,
    token_index: torch.Tensor | None = None,
    state_slots: Sequence[int] | None = None,
    sink_slot: int | None = None,
) -> StepPlan:
    """Build the step plan for one partner.

    Args:
        q_lens: new tokens per row (>= 1 for real rows).
        ctx_lens: tokens already cached per row.
        page_tables: logical page ids of each row, enough for ``ctx + q`` tokens.
        page_size: logical page size (a multiple of P).
        sink_page: the reserved physical page non-owners and padding write to.
        placement: this partner's placement (default: one partner).
        bucket: pad the step to this captured shape: padding rows of one token (decode bucket)
            or none (mixed bucket, whose token padding follows the last row); rows' page
            tables at most ``bucket.table_width`` wide (the plan's dense table is as wide as
            the longest; ``StaticPlan.load`` puts it in the bucket's).
        token_index: see ``StepPlan.token_index``.
        state_slots, sink_slot: each row's state-pool slot and the pool's sink slot, for
            models with linear-attention state (padding rows get the sink slot).
    """
    placement = placement or ContextParallel.single()
    rows = len(q_lens)
    problems = placement.page_size_problems(page_size)
    if not (rows == len(ctx_lens) == len(page_tables)):
        problems.append("q_lens, ctx_lens and page_tables must have one entry per row")
    if any(q < 1 for q in q_lens):
        problems.append(f"every row needs at least one new token, got q_lens={list(q_lens)}")
    for b, (q, c, t) in enumerate(zip(q_lens, ctx_lens, page_tables)):
        if len(t) * page_size < q + c:
            problems.append(f"row {b}: {len(t)} pages cannot hold {q + c} tokens")
    is_decode = all(q == 1 for q in q_lens)
    num_tokens = sum(q_lens)
    if bucket is not None:
        width = max((len(t) for t in page_tables), default=0)
        if not bucket.fits(rows, num_tokens, is_decode and bucket.decode, width):
            problems.append(f"a step of {rows} rows, {num_tokens} tokens "
                            f"({'decode' if is_decode else 'multi-token'}) and page tables up "
                            f"to {width} pages does not fit {bucket}")
    if state_slots is not None and (len(state_slots) != rows or sink_slot is None):
        problems.append("state_slots needs one slot per row and the pool's sink_slot")
    elif state_slots is not None:
        # Below the sink slot (the zero slot follows it) and one row each: a real row on the
        # zero slot would make every later fresh row start from its state.
        slots = [int(x) for x in state_slots]
        if len(set(slots)) != rows or not all(0 <= x < sink_slot for x in slots):
            problems.append(f"state_slots must be distinct slots in [0, {sink_slot}) (the sink "
                            f"slot and the zero slot are the pool's), got {slots}")
    if problems:
        raise ValueError("invalid step: " + "; ".join(problems))
    local_page = page_size // placement.size
    padded_rows = bucket.rows if bucket is not None else rows
    if bucket is not None and not bucket.decode:
        is_decode = False  # token padding past the rows: attend own tokens apart
    padded_tokens = bucket.tokens if bucket is not None else num_tokens
    pad_q = 1 if is_decode else 0
    q_t = torch.tensor(list(q_lens) + [pad_q] * (padded_rows - rows), dtype=torch.int64)
    c_t = torch.tensor(list(ctx_lens) + [0] * (padded_rows - rows), dtype=torch.int64)
    # As wide as the step's longest row, a bucket's too: its static table is the bucket's
    # width, and a plan fills its first columns (``StaticPlan.load``; kernels read a row's
    # pages up to its length only). Built the bucket's width (``Engine``'s default was then the
    # whole pool), it cost a step of 64 rows over a pool of 540k pages 0.3 s of host time
    # (helper 96).
    table = dense_table(list(page_tables) + [[sink_page]] * (padded_rows - rows), sink_page)
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
    attend[rows:] = 0  # padding rows attend nothing: no kernel reads the sink page for them
    host = paged_indptrs(placement.local_length(attend), table, local_page, sink_page)
    dev = torch.device(device)
    i32 = torch.int32
    (qo_d, q_d, c_d, *context_d), (qo_h, _, _, *context_h) = _upload(
        [qo_indptr.to(i32), q_t.to(i32), c_t.to(i32), host.lens, host.indptr, host.indices,
         host.last_page_len, host.table], dev)
    slots = [] if state_slots is None else [torch.tensor(
        [int(s) for s in state_slots] + [sink_slot] * (padded_rows - rows), dtype=torch.int64),
        (c_t == 0).to(torch.int64)]
    (positions_d, token_row_d, write_index_d, *slots_d), _ = _upload(
        [positions, token_row, write_index, *slots], dev)
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
        bucket=bucket,
        state_slots=slots_d[0] if slots_d else None,
        state_fresh=slots_d[1] if slots_d else None,
        state_sink_slot=None if state_slots is None else sink_slot,
        attends_context=is_decode or bucket is not None or any(int(c) > 0 for c in ctx_lens),
    )
