"""Slot math (placement.py) and the step plan (plan.py) against a brute-force enumeration.

The expected values are written plainly: every token position ``t`` of every row, its owner
``t % P``, its physical page ``table[t // page_size]`` and physical slot ``(t % page_size) // P``.
"""

import math

import pytest
import torch
from buckets import padding_bucket
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_cp.kv import GQAPool
from torch_cp.kv.tables import PagedIndptrs, paged_indptrs
from torch_cp.placement import ContextParallel
from torch_cp.plan import StepPlan, build_step_plan

SETTINGS = settings(max_examples=120, deadline=None)
GROUP = object()  # the slot math never touches the partners' process group
SIZES = st.sampled_from([1, 2, 4, 8])


def placement(size: int, rank: int) -> ContextParallel:
    return ContextParallel(size, rank, group=GROUP if size > 1 else None)


def context_only(plan: StepPlan) -> PagedIndptrs:
    """The host view of the same step's rows attending only their cached context."""
    lens = plan.placement.local_length(plan.ctx_lens.cpu())
    return paged_indptrs(lens, plan.context_host.table, plan.local_page_size, plan.sink_page)


# --- slot math ---

@SETTINGS
@given(size=SIZES, data=st.data())
def test_owner_local_slot_local_length_match_enumeration(size, data):
    page_size = size * data.draw(st.integers(1, 6))
    values = data.draw(st.lists(st.integers(0, 5 * page_size), min_size=1, max_size=20))
    for rank in range(size):
        cp = placement(size, rank)
        for s in values:
            assert cp.owner(s) == s % size
            assert cp.local_slot(s % page_size) == [o for o in range(page_size)
                                                   if o % size == s % size].index(s % page_size)
            held = sum(1 for t in range(s) if t % size == rank)
            assert cp.local_length(s) == held
            assert cp.local_length(s, rank=(rank + 1) % size) == sum(
                1 for t in range(s) if t % size == (rank + 1) % size)
        t = torch.tensor(values)
        assert cp.owner(t).tolist() == [s % size for s in values]
        assert cp.local_slot(t % page_size).tolist() == [(s % page_size) // size for s in values]
        assert cp.local_length(t).tolist() == [cp.local_length(s) for s in values]
        assert cp.local_length(t).dtype == t.dtype


@SETTINGS
@given(size=SIZES, data=st.data())
def test_write_slots_owner_writes_its_page_others_the_sink(size, data):
    page_size = size * data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, 16))
    pages = torch.tensor(data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)))
    offsets = torch.tensor(data.draw(st.lists(st.integers(0, page_size - 1), min_size=n,
                                              max_size=n)))
    sink = 10
    writers = [0] * n
    for rank in range(size):
        got_pages, got_slots = placement(size, rank).write_slots(pages, offsets, sink)
        assert got_pages.shape == got_slots.shape == (n,)
        for i in range(n):
            owner = int(offsets[i]) % size
            assert int(got_pages[i]) == (int(pages[i]) if owner == rank else sink)
            assert int(got_slots[i]) == int(offsets[i]) // size
            writers[i] += owner == rank
    assert writers == [1] * n  # each token has exactly one owner among the partners


@pytest.mark.parametrize("size,page_size", [(2, 3), (4, 6), (8, 4), (3, 16)])
def test_page_size_not_a_multiple_of_p_is_refused(size, page_size):
    cp = placement(size, 0)
    assert cp.page_size_problems(page_size)
    for call in (lambda: cp.local_page_size(page_size),
                 lambda: build_step_plan([1], [0], [[0]], page_size=page_size, sink_page=1,
                                         placement=cp),
                 lambda: GQAPool(1, 2, page_size, 1, 4, cp, torch.float32)):
        with pytest.raises(ValueError, match=rf"page_size {page_size} .*multiple of P = {size}"):
            call()


def test_kv_bytes_per_rank_names_every_bad_argument():
    import numpy as np

    from torch_cp import kv_bytes_per_rank
    from torch_cp.tiny import tiny_qwen3

    config = tiny_qwen3().config
    with pytest.raises(ValueError) as caught:  # was a TypeError from comparing "100" with 0
        kv_bytes_per_rank(config, "100", partners=2.0)
    assert str(caught.value) == ("tokens must be an int >= 0, got '100'; partners must be an "
                                 "int >= 1, got 2.0")
    with pytest.raises(ValueError, match="page_size must be a positive int, got '16'"):
        kv_bytes_per_rank(config, 100, 2, page_size="16")
    assert kv_bytes_per_rank(config, np.int64(100), np.int64(2)) == \
        kv_bytes_per_rank(config, 100, 2) > 0


# --- the step plan ---

@st.composite
def steps(draw, spare_tokens: int = 1):
    """P, page size, rows of (q, ctx) and page tables cut from a shuffled list of page ids. Tables
    hold ``ctx + q + spare_tokens`` tokens, some one page more."""
    size = draw(SIZES)
    page_size = size * draw(st.integers(1, 4))
    rows = draw(st.integers(1, 5))
    decode = draw(st.booleans())
    length = st.one_of(st.integers(0, size), st.integers(0, 3 * page_size))
    q_lens = [1 if decode else max(1, draw(length)) for _ in range(rows)]
    ctx_lens = [draw(length) for _ in range(rows)]
    need = [math.ceil((q + c + spare_tokens) / page_size) + draw(st.integers(0, 1))
            for q, c in zip(q_lens, ctx_lens, strict=True)]
    num_pages = sum(need) + draw(st.integers(0, 3))
    ids = draw(st.permutations(range(num_pages)))
    tables, start = [], 0
    for n in need:
        tables.append(list(ids[start:start + n]))
        start += n
    return size, page_size, q_lens, ctx_lens, tables, num_pages


def expected_context(attend, tables, size, rank, page_size, sink):
    """Partner ``rank``'s paged view of ``attend[b]`` tokens per row, enumerated token by token."""
    local = page_size // size
    lens, indptr, indices, last = [], [0], [], []
    for n, table in zip(attend, tables, strict=True):
        mine = [t for t in range(n) if t % size == rank]
        pages = []
        for t in mine:  # the pages partner `rank` fills, in order
            if table[t // page_size] not in pages:
                pages.append(table[t // page_size])
        lens.append(len(mine))
        indices += pages
        indptr.append(len(indices))
        last.append(len(mine) - (len(pages) - 1) * local if mine else 0)
    width = max(len(t) for t in tables)
    dense = [list(t) + [sink] * (width - len(t)) for t in tables]
    return lens, indptr, indices, last, dense


@SETTINGS
@given(step=steps())
def test_step_plan_matches_enumeration(step):
    size, page_size, q_lens, ctx_lens, tables, sink = step
    local = page_size // size
    decode = all(q == 1 for q in q_lens)
    for rank in range(size):
        plan = build_step_plan(q_lens, ctx_lens, tables, page_size=page_size, sink_page=sink,
                               placement=placement(size, rank))
        positions, rows, writes = [], [], []
        for b, (q, c, table) in enumerate(zip(q_lens, ctx_lens, tables, strict=True)):
            for t in range(c, c + q):
                page = table[t // page_size] if t % size == rank else sink
                positions.append(t)
                rows.append(b)
                writes.append(page * local + (t % page_size) // size)
        assert plan.num_rows == len(q_lens) and plan.num_tokens == sum(q_lens)
        assert plan.is_decode == decode
        assert plan.local_page_size == local and plan.sink_page == sink
        assert plan.qo_indptr.tolist() == [sum(q_lens[:b]) for b in range(len(q_lens) + 1)]
        assert plan.q_lens.tolist() == q_lens and plan.ctx_lens.tolist() == ctx_lens
        assert plan.positions.tolist() == positions
        assert plan.token_row.tolist() == rows
        assert plan.write_index.tolist() == writes
        attend = [c + q if decode else c for q, c in zip(q_lens, ctx_lens, strict=True)]
        lens, indptr, indices, last, dense = expected_context(attend, tables, size, rank,
                                                              page_size, sink)
        for view in (plan.context, plan.context_host):
            assert view.lens.tolist() == lens
            assert view.indptr.tolist() == indptr
            assert view.indices.tolist() == indices
            assert view.last_page_len.tolist() == last
            assert view.table.tolist() == dense
        # Page tables held as tensors (PageAllocator.table_tensor), some rows only: same plan.
        held = [torch.tensor(t, dtype=torch.int64) if b % 2 == 0 else t
                for b, t in enumerate(tables)]
        same = build_step_plan(q_lens, ctx_lens, held, page_size=page_size, sink_page=sink,
                               placement=placement(size, rank))
        assert torch.equal(same.write_index, plan.write_index)
        for name in ("lens", "indptr", "indices", "last_page_len", "table"):
            assert torch.equal(getattr(same.context_host, name), getattr(plan.context_host, name))
        ctx_only = context_only(plan)
        expect = expected_context(ctx_lens, tables, size, rank, page_size, sink)
        assert [ctx_only.lens.tolist(), ctx_only.indptr.tolist(), ctx_only.indices.tolist(),
                ctx_only.last_page_len.tolist(), ctx_only.table.tolist()] == list(expect)


def simulate_step(memory, plan, sink, local, rows=None):
    """Apply one partner's writes to ``memory`` {physical slot: (row, position)}; return the
    tokens it wrote outside the sink page. ``rows[b]`` names the plan's row b (default b)."""
    written = []
    for i, (b, t, slot) in enumerate(zip(plan.token_row.tolist(), plan.positions.tolist(),
                                         plan.write_index.tolist(), strict=True)):
        if i >= plan.num_tokens:
            continue
        if slot // local == sink:
            continue
        b = b if rows is None else rows[b]
        assert memory.get(slot, (b, t)) == (b, t), "two tokens in one physical slot"
        memory[slot] = (b, t)
        written.append((b, t))
    return written


def read_context(memory, plan, size, rank, local):
    """Every token partner ``rank`` reads through its plan's context, checked in place."""
    view, seen = plan.context_host, []
    for b in range(plan.num_rows):
        pages = view.indices[view.indptr[b]:view.indptr[b + 1]].tolist()
        for j in range(int(view.lens[b])):
            slot = pages[j // local] * local + j % local
            assert memory[slot] == (b, rank + j * size)  # the j-th token this partner holds
            seen.append(memory[slot])
    return seen


@SETTINGS
@given(step=steps(spare_tokens=1))
def test_partners_together_hold_every_token_exactly_once(step):
    """History (a prefill of ctx tokens), the drawn step and one decode step, written on every
    partner: each token is written outside the sink page by one partner, and the partners' reads
    together cover every token once, rows shorter than P and partial pages included."""
    size, page_size, q_lens, ctx_lens, tables, sink = step
    local = page_size // size
    history = [b for b, c in enumerate(ctx_lens) if c > 0]
    reads, writes = [], []
    for rank in range(size):
        cp, memory = placement(size, rank), {}
        if history:
            before = build_step_plan([ctx_lens[b] for b in history], [0] * len(history),
                                     [tables[b] for b in history], page_size=page_size,
                                     sink_page=sink, placement=cp)
            writes += simulate_step(memory, before, sink, local, rows=history)
        plan = build_step_plan(q_lens, ctx_lens, tables, page_size=page_size, sink_page=sink,
                               placement=cp)
        writes += simulate_step(memory, plan, sink, local)
        reads.append(read_context(memory, plan, size, rank, local))
        grown = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
        after = build_step_plan([1] * len(q_lens), grown, tables, page_size=page_size,
                                sink_page=sink, placement=cp)
        writes += simulate_step(memory, after, sink, local)
        reads.append(read_context(memory, after, size, rank, local))
    lengths = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    every = [(b, t) for b, n in enumerate(lengths) for t in range(n + 1)]
    assert sorted(writes) == every
    decode = all(q == 1 for q in q_lens)
    attend = [n if decode else c for n, c in zip(lengths, ctx_lens, strict=True)]
    assert sorted(sum(reads[0::2], [])) == [(b, t) for b, n in enumerate(attend) for t in range(n)]
    assert sorted(sum(reads[1::2], [])) == every


@SETTINGS
@given(step=steps(), extra_rows=st.integers(0, 3), extra_tokens=st.none() | st.integers(0, 6))
def test_padding_writes_to_the_sink_and_leaves_real_rows_alone(step, extra_rows, extra_tokens):
    size, page_size, q_lens, ctx_lens, tables, sink = step
    rows, tokens = len(q_lens), sum(q_lens)
    pad_rows = rows + extra_rows
    decode = all(q == 1 for q in q_lens)
    pad_tokens = None if extra_tokens is None else (pad_rows if decode else tokens) + extra_tokens
    # Documented: a decode bucket gives each padding row one token unless token padding goes past
    # the rows; then, like any other step, padding rows have no token and padding tokens no row.
    stays_decode = decode and pad_tokens in (None, pad_rows)
    bucket = padding_bucket(q_lens, tables, pad_rows, pad_tokens)
    width = bucket.tokens
    local = page_size // size
    for rank in range(size):
        cp = placement(size, rank)
        plain = build_step_plan(q_lens, ctx_lens, tables, page_size=page_size, sink_page=sink,
                                placement=cp)
        plan = build_step_plan(q_lens, ctx_lens, tables, page_size=page_size, sink_page=sink,
                               placement=cp, bucket=bucket)
        assert plan.is_decode == stays_decode
        assert (plan.num_rows, plan.num_tokens) == (rows, tokens)
        assert plan.q_lens.shape == plan.ctx_lens.shape == (pad_rows,)
        assert plan.positions.shape == plan.token_row.shape == plan.write_index.shape == (width,)
        for name in ("positions", "token_row", "write_index"):
            assert getattr(plan, name)[:tokens].tolist() == getattr(plain, name).tolist()
        assert plan.q_lens[rows:].tolist() == [1 if stays_decode else 0] * extra_rows
        assert plan.ctx_lens[rows:].tolist() == [0] * extra_rows
        pad = slice(tokens, None)
        assert all(i // local == sink for i in plan.write_index[pad].tolist())
        assert plan.positions[pad].tolist() == [0] * (width - tokens)
        row_tokens = extra_rows if stays_decode else 0  # the padding rows' own tokens
        assert plan.token_row[pad].tolist() == (list(range(rows, pad_rows))[:row_tokens]
                                                + [-1] * (width - tokens - row_tokens))
        view = plan.context_host
        assert view.table[rows:].eq(sink).all()
        # padding rows attend nothing: no pages, no tokens
        assert view.indptr[rows:].eq(view.indptr[rows]).all() and view.lens[rows:].eq(0).all()
        assert view.indices.numel() == view.indptr[rows]
        # a decode step that token padding turns into a multi-token step attends its context only
        same = plain.context_host if stays_decode else context_only(plain)
        assert view.lens[:rows].tolist() == same.lens.tolist()
        assert view.indices[:view.indptr[rows]].tolist() == same.indices.tolist()
