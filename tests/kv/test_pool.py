"""GQAPool and MLAPool: writes through the placement land exactly where it says.

P partners each run the same steps (a prefill of history, an extend step, a padded decode step).
Interleaving the partners' pools (partner r's j-th slot of a row is token r + j * P) must give back
every row's K/V bit for bit; slots no token owns stay untouched, and the sink page holds only
tokens its partner does not own (or padding).
"""

import pytest
import torch
from buckets import padding_bucket

from torch_cp.kv import GQAPool, MLAPool
from torch_cp.kv.tables import paged_indptrs
from torch_cp.placement import ContextParallel
from torch_cp.plan import build_step_plan

PAGE, LAYERS, LAYER = 8, 2, 1
ROW_LENGTHS = [1, 3, 8, 13, 21, 2, 17]  # below P, one page, across pages; P = 4 divides PAGE
GROUP = object()  # writes never touch the partners' process group


def make_pool(kind, num_pages, placement, dtype):
    if kind == "gqa":
        return GQAPool(LAYERS, num_pages, PAGE, 2, 4, placement, dtype)
    return MLAPool(LAYERS, num_pages, PAGE, 6, 3, placement, dtype)


def caches(pool):
    """The pool's tensors of one layer, each [pages + 1, page_size // P, ...]."""
    if isinstance(pool, GQAPool):
        return [pool.kv[LAYER, :, 0], pool.kv[LAYER, :, 1]]
    return [pool.ckv[LAYER], pool.kpe[LAYER]]


def token_shapes(kind):
    return [(2, 4), (2, 4)] if kind == "gqa" else [(6,), (3,)]


def steps(lengths):
    """(q_lens, ctx_lens, row ids, padding) of three steps that write every token once."""
    prefill = [(b, n - 4) for b, n in enumerate(lengths) if n > 4]
    extend = [(b, n - 1 - max(n - 4, 0)) for b, n in enumerate(lengths) if n > 1]
    return [
        ([q for _, q in prefill], [0] * len(prefill), [b for b, _ in prefill], {}),
        ([q for _, q in extend], [max(n - 4, 0) for n in (lengths[b] for b, _ in extend)],
         [b for b, _ in extend], dict(tokens_to=40)),
        ([1] * len(lengths), [n - 1 for n in lengths], list(range(len(lengths))),
         dict(rows_to=len(lengths) + 3)),
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_partners_pools_interleave_to_the_written_sequence(size, kind, dtype):
    g = torch.Generator().manual_seed(size * 10 + (kind == "mla"))
    num_pages = sum(-(-n // PAGE) for n in ROW_LENGTHS) + 2  # two pages no row uses
    ids = torch.randperm(num_pages, generator=g).tolist()
    tables, start = [], 0
    for n in ROW_LENGTHS:
        tables.append(ids[start:start + -(-n // PAGE)])
        start += len(tables[-1])
    unused = ids[start:]
    data = [[torch.randn(n, *shape, generator=g).to(dtype) for shape in token_shapes(kind)]
            for n in ROW_LENGTHS]  # data[b][i]: row b's i-th tensor (K / V or ckv / kpe)

    pools, sink_writes = [], []
    for rank in range(size):
        placement = ContextParallel(size, rank, group=GROUP if size > 1 else None)
        pool = make_pool(kind, num_pages, placement, dtype)
        assert pool.sink_page == num_pages
        to_sink = {}  # sink slot -> every token (or padding) value written there
        for q_lens, ctx_lens, row_ids, pad in steps(ROW_LENGTHS):
            step_tables = [tables[b] for b in row_ids]
            plan = build_step_plan(q_lens, ctx_lens, step_tables, page_size=PAGE,
                                   sink_page=num_pages, placement=placement,
                                   bucket=padding_bucket(q_lens, step_tables, **pad))
            width = plan.write_index.shape[0]
            new = [torch.randn(width, *s, generator=g).to(dtype) for s in token_shapes(kind)]
            for j, (b, t) in enumerate(zip(plan.token_row[:plan.num_tokens].tolist(),
                                           plan.positions[:plan.num_tokens].tolist(),
                                           strict=True)):
                for i in range(2):
                    new[i][j] = data[row_ids[b]][i][t]
            pool.write(LAYER, new[0], new[1], plan.write_index)
            for j, slot in enumerate(plan.write_index.tolist()):
                owned = j < plan.num_tokens and int(plan.positions[j]) % size == rank
                assert (slot // pool.local_page_size == num_pages) == (not owned)
                if not owned:
                    to_sink.setdefault(slot % pool.local_page_size, []).append(
                        [new[i][j] for i in range(2)])
        pools.append(pool)
        sink_writes.append(to_sink)

    # every partner's pool has the same shapes
    assert len({tuple(c.shape for c in caches(p)) for p in pools}) == 1
    local = PAGE // size
    lens_host = torch.tensor(ROW_LENGTHS)
    for rank, pool in enumerate(pools):
        view = paged_indptrs(pool.placement.local_length(lens_host), tables, local, num_pages)
        touched = torch.zeros(num_pages + 1, local, dtype=torch.bool)
        for b, n in enumerate(ROW_LENGTHS):
            pages = view.indices[view.indptr[b]:view.indptr[b + 1]].long()
            held = int(view.lens[b])
            assert held == len(range(rank, n, size))
            touched[pages] = True
            for i, cache in enumerate(caches(pool)):
                mine = cache[pages].flatten(0, 1)[:held]  # this partner's slots of row b, in order
                assert torch.equal(mine, data[b][i][rank::size]), f"rank {rank} row {b}"
            last = int(view.last_page_len[b])
            if held:
                touched[pages[-1], last:] = False
        for i, cache in enumerate(caches(pool)):
            untouched = cache[:num_pages][~touched[:num_pages]]
            assert untouched.eq(0).all(), "a write landed on a slot no token owns"
            assert cache[unused].eq(0).all()
            assert pool_other_layer(pool, i).eq(0).all()
            for slot in range(local):
                value = cache[num_pages, slot]
                candidates = sink_writes[rank].get(slot, [])
                if not candidates:
                    assert value.eq(0).all()
                else:  # duplicate indices: which write lands is unspecified, but it is one of them
                    assert any(torch.equal(value, c[i]) for c in candidates)

    # interleaving the partners' slots gives back every row
    for b, n in enumerate(ROW_LENGTHS):
        for i in range(2):
            row = torch.empty_like(data[b][i])
            for rank, pool in enumerate(pools):
                view = paged_indptrs(pool.placement.local_length(torch.tensor([n])), [tables[b]],
                                     local, num_pages)
                pages = view.indices.long()
                row[rank::size] = caches(pool)[i][pages].flatten(0, 1)[: int(view.lens[0])]
            assert torch.equal(row, data[b][i])


def pool_other_layer(pool, i):
    if isinstance(pool, GQAPool):
        return pool.kv[LAYER - 1, :, i]
    return (pool.ckv, pool.kpe)[i][LAYER - 1]


def test_sink_page_takes_every_non_owner_write():
    """With P = 2, one token at slot 1 of page 0: partner 0 writes it to the sink, partner 1 to
    page 0; nothing else changes on either."""
    k = torch.arange(8.0).view(1, 2, 4)
    for rank in range(2):
        placement = ContextParallel(2, rank, group=GROUP)
        pool = GQAPool(1, 3, 4, 2, 4, placement, torch.float32)
        plan = build_step_plan([1], [1], [[0]], page_size=4, sink_page=3, placement=placement)
        pool.write(0, k, -k, plan.write_index)
        page = 3 if rank == 0 else 0
        assert torch.equal(pool.kv[0, page, 0, 0], k[0]) and torch.equal(pool.kv[0, page, 1, 0],
                                                                          -k[0])
        pool.kv[0, page, :, 0] = 0
        assert pool.kv.eq(0).all()
