"""Buckets and static plans (the CPU-side half of CUDA-graph replay)."""

from __future__ import annotations

import pytest
import torch

from torch_cp.graphs import StaticPlan, default_buckets, pick_bucket
from torch_cp.plan import Bucket, build_step_plan


def test_default_buckets_cover_every_decode_batch():
    buckets = default_buckets(max_rows=40, table_width=3, mixed=[(4, 64)])
    for rows in range(1, 41):
        chosen = pick_bucket(buckets, rows, rows, decode=True, table_width=3)
        assert chosen is not None and chosen.decode and chosen.rows >= rows
        assert chosen.rows - rows < 8 and chosen.max_pages == 3 * chosen.rows
    assert pick_bucket(buckets, 41, 41, decode=True, table_width=3) is None
    assert pick_bucket(buckets, 2, 2, decode=True, table_width=4) is None  # rows too long
    assert pick_bucket(buckets, 3, 50, decode=False, table_width=3) == Bucket(4, 64, 12)
    assert pick_bucket(buckets, 3, 65, decode=False, table_width=3) is None
    assert pick_bucket(buckets, 3, 3, decode=False, table_width=1) == Bucket(4, 64, 12)


def test_bad_buckets_name_every_problem():
    with pytest.raises(ValueError) as err:
        default_buckets(max_rows=0, table_width=0, mixed=[(4, 4), (0, 8)])
    for part in ("4x4", "0x8", "max_rows", "table_width"):
        assert part in str(err.value)
    with pytest.raises(ValueError) as err:
        Bucket(4, 2, 6)
    assert "tokens >= rows" in str(err.value) and "multiple of rows" in str(err.value)


def test_a_step_that_does_not_fit_its_bucket_is_refused():
    bucket = Bucket(2, 2, 4)
    for q_lens, tables in (([1, 1, 1], [[0]] * 3), ([2, 1], [[0], [1]]),
                           ([1], [[0, 1, 2]])):
        with pytest.raises(ValueError, match="does not fit"):
            build_step_plan(q_lens, [0] * len(q_lens), tables, page_size=8, sink_page=99,
                            bucket=bucket)


def _plan(q_lens, ctx_lens, tables, bucket: Bucket):
    return build_step_plan(q_lens, ctx_lens, tables, page_size=8, sink_page=99, bucket=bucket)


@pytest.mark.parametrize("bucket", [Bucket(4, 4, 24), Bucket(4, 24, 24)], ids=str)
def test_static_plan_keeps_addresses_and_takes_new_values(bucket):
    decode = bucket.decode
    static = StaticPlan(_plan([], [], [], bucket))
    addresses = {name: t.data_ptr() for name, t in static.tensors.items()}
    addresses["table"] = static.context.table.data_ptr()
    q_lens = [1, 1, 1] if decode else [5, 1, 9]
    fresh = _plan(q_lens, [3, 17, 0], [[1, 2], [5, 6, 7], [8, 9]], bucket)
    loaded = static.load(fresh)
    for name in static.tensors:
        assert getattr(loaded, name).data_ptr() == addresses[name]
        assert torch.equal(getattr(loaded, name), getattr(fresh, name)), name
    assert loaded.context.table.data_ptr() == addresses["table"]
    for name in ("lens", "indptr", "last_page_len"):
        assert torch.equal(getattr(loaded.context, name), getattr(fresh.context, name)), name
    # The plan's table is as wide as its longest row, not the bucket (planning a step over a
    # pool of 540k pages built 64 x 540k tables: helper 96); it fills the bucket's first columns.
    assert fresh.context.table.shape == (4, 3)
    assert loaded.context.table.shape == (4, bucket.table_width)
    assert torch.equal(loaded.context.table[:, :3], fresh.context.table)
    nnz = fresh.context.indices.shape[0]
    assert torch.equal(loaded.context.indices[:nnz], fresh.context.indices)
    assert loaded.is_decode == decode and loaded.num_rows == 3
    assert torch.equal(loaded.context_host.indptr, fresh.context_host.indptr)


def test_state_fresh_marks_rows_without_context_and_padding_rows():
    """A hybrid model's plan says once which rows start from zeros (the state kernels read it),
    and a captured bucket's static plan takes it like the other step tensors."""
    bucket = Bucket(4, 4, 24)

    def plan(ctx_lens):
        return build_step_plan([1, 1, 1], ctx_lens, [[1], [2], [5, 6, 7]], page_size=8,
                               sink_page=99, bucket=bucket, state_slots=[2, 0, 1], sink_slot=5)

    first = plan([3, 0, 17])
    assert first.state_slots.tolist() == [2, 0, 1, 5]
    assert first.state_fresh.tolist() == [0, 1, 0, 1]
    static = StaticPlan(first)
    address = static.tensors["state_fresh"].data_ptr()
    loaded = static.load(plan([0, 4, 18]))
    assert loaded.state_fresh.data_ptr() == address
    assert loaded.state_fresh.tolist() == [1, 0, 0, 1]


def test_capture_step_writes_only_the_sink_page():
    """A capture step is all padding: every write goes to the sink page."""
    for bucket in (Bucket(8, 8, 8), Bucket(2, 16, 2)):
        plan = _plan([], [], [], bucket)
        assert plan.num_rows == 0 and plan.num_tokens == 0
        assert torch.equal(plan.write_index // plan.local_page_size,
                           torch.full_like(plan.write_index, 99))
        assert plan.is_decode == bucket.decode


def test_pick_bucket_takes_the_fewest_tokens_then_the_fewest_rows():
    """Several mixed buckets a step fits: the one with the fewest tokens wins even with more rows,
    rows break a tie of tokens; against a brute force over every step shape, whatever the order
    the buckets are given in."""
    wide, many, fewer_rows = Bucket(2, 64, 2), Bucket(8, 32, 8), Bucket(4, 32, 4)
    assert pick_bucket([wide, many], 2, 20, decode=False, table_width=1) == many
    assert pick_bucket([many, wide], 2, 20, decode=False, table_width=1) == many
    assert pick_bucket([wide, many, fewer_rows], 2, 20, False, 1) == fewer_rows
    assert pick_bucket([wide, many, fewer_rows], 6, 20, False, 1) == many
    assert pick_bucket([wide, many, fewer_rows], 2, 40, False, 1) == wide
    buckets = default_buckets(16, 2, mixed=[(2, 64), (8, 32), (4, 32), (16, 128), (1, 16)])
    for order in (buckets, buckets[::-1], buckets[1::2] + buckets[::2]):
        for rows in range(1, 18):
            for tokens in range(rows, 130):
                for decode in (False, True):
                    fits = [b for b in buckets if b.decode == decode and b.rows >= rows
                            and b.tokens >= tokens and b.table_width >= 2]
                    want = min(fits, key=lambda b: (b.tokens, b.rows)) if fits else None
                    got = pick_bucket(order, rows, tokens, decode, table_width=2)
                    assert got == want, (rows, tokens, decode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columns_past_a_rows_pages_are_never_read(dtype):
    """A bucket's static table keeps, past each row's pages, what earlier steps left there (a
    plan fills only its first columns). A decode step loaded after a wider one gives the bits
    of its own plan, with those columns holding NaN pages."""
    import math

    from torch_cp.attention import (
        AttentionGeometry,
        ContextParallelAttention,
        Exchange,
        TorchBackend,
    )
    from torch_cp.kv import GQAPool
    from torch_cp.placement import ContextParallel

    heads, kv_heads, dim, page = 4, 2, 16, 8
    geometry = AttentionGeometry("gqa", heads, kv_heads, dim, dim, 1 / math.sqrt(dim),
                                 context_q_heads=heads)
    placement = ContextParallel.single()
    attention = ContextParallelAttention(0, TorchBackend(geometry), Exchange(placement))
    pool = GQAPool(1, 12, page, kv_heads, dim, placement, dtype)
    gen = torch.Generator().manual_seed(0)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    pool.kv[0, [7, 8, 9]] = float("nan")  # the wide step's pages, stale columns later
    bucket = Bucket(2, 2, 12)
    static = StaticPlan(build_step_plan([], [], [], page_size=page, sink_page=12, bucket=bucket))

    def plan(ctx_lens, tables):
        return build_step_plan([1, 1], ctx_lens, tables, page_size=page, sink_page=12,
                               bucket=bucket)

    static.load(plan([40, 3], [[0, 1, 2, 3, 7, 8], [9]]))
    narrow = plan([9, 3], [[4, 5], [6]])
    loaded = static.load(narrow)
    assert torch.isnan(pool.kv[0, loaded.context.table[0, 4:6].long()]).all()
    q, k, v = (torch.randn(2, h, dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    out = []
    for p in (narrow, loaded):
        attention.backend.plan(p)
        out.append(attention(q, k, v, pool, p))
    assert torch.equal(out[0], out[1]) and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("limit, num_pages, width", [
    (1024, 4096, 64),  # max_position_embeddings 1024 at page 16: 64 pages, not the pool's 4096
    (1000, 4096, 63),  # a partial last page counts
    (1024, 10, 10),  # never wider than the pool
    (None, 4096, 4096),  # a config without the limit: the pool
])
def test_buckets_default_to_the_models_positions_not_the_whole_pool(monkeypatch, limit,
                                                                    num_pages, width):
    import torch_cp.graphs
    from torch_cp.engine.steps import graph_runner
    from torch_cp.tiny import tiny_qwen3

    made = []

    class Recorder:
        def __init__(self, model, cache, buckets):
            made.extend(buckets)

        def capture(self):
            pass

    monkeypatch.setattr(torch_cp.graphs, "CUDAGraphRunner", Recorder)
    from types import SimpleNamespace

    model = (tiny_qwen3(num_hidden_layers=1, max_position_embeddings=limit) if limit
             else SimpleNamespace(config=SimpleNamespace()))
    cache = type("Cache", (), {"pool": type("Pool", (), {"num_pages": num_pages,
                                                        "page_size": 16})()})()
    graph_runner(model, cache, 8, None, (), compile=False, progress=False)
    assert {b.table_width for b in made} == {width}
    made.clear()
    graph_runner(model, cache, 8, 5, (), compile=False, progress=False)  # told: kept
    assert {b.table_width for b in made} == {5}
