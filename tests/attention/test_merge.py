"""merge_partials and the torch reference backend against softmax attention written plainly.

The oracle, ``plain_attention``, attends one query over an explicit list of keys in float64 with
torch.softmax; it shares no code with torch_cp.

Tolerances: float32 results are compared at 1e-5 (float32 arithmetic on O(1) values, a few ulp of
error per step); bfloat16 outputs at rtol 1.6e-2 / atol 1e-2 (bf16 keeps 8 bits, so each rounding
of a partial or of the merged output costs up to 2**-8 of |v| <= ~4). LSE is float32 in both.
"""

import math
import zlib

import pytest
import torch
from buckets import padding_bucket
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_cp.attention import AttentionGeometry, Partial, TorchBackend, merge_partials, merge_two
from torch_cp.attention.merge import merge_states_applies
from torch_cp.attention.torch_ref import dense_partial
from torch_cp.kv import GQAPool, MLAPool
from torch_cp.placement import ContextParallel
from torch_cp.plan import build_step_plan

F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)
NAN = float("nan")


def tol(dtype):
    return F32_TOL if dtype == torch.float32 else BF16_TOL


def plain_attention(q_hd, k_lhd, v_lhd, scale):
    """One query [H, Dk] over L keys [L, Hkv, Dk] / values [L, Hkv, Dv]; query head h reads KV
    head h // (H // Hkv). Returns out [H, Dv] (0 when L == 0) and base-2 LSE [H] (-inf then)."""
    q, k, v = q_hd.double(), k_lhd.double(), v_lhd.double()
    heads = q.shape[0]
    if k.shape[0] == 0:
        return torch.zeros(heads, v.shape[-1], dtype=torch.float64), torch.full(
            (heads,), -math.inf, dtype=torch.float64)
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) * scale
    out = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)
    return out, torch.logsumexp(scores, -1) / math.log(2)


# --- merge_partials ---


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 4), heads=st.integers(1, 3), keys=st.integers(0, 12),
       subsets=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_merge_equals_attention_over_the_union(n, heads, keys, subsets, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(n, heads, 8, generator=g)
    k, v = torch.randn(keys, heads, 8, generator=g), torch.randn(keys, heads, 6, generator=g)
    subset_of = torch.randint(0, subsets, (keys,), generator=g)  # some subsets end up empty
    visible = torch.rand(n, keys, generator=g) < 0.7  # some queries see nothing
    scale = 8 ** -0.5
    outs = torch.zeros(subsets, n, heads, 6)
    lses = torch.zeros(subsets, n, heads)
    for s in range(subsets):
        for i in range(n):
            idx = ((subset_of == s) & visible[i]).nonzero().flatten()
            outs[s, i], lses[s, i] = plain_attention(q[i], k[idx], v[idx], scale)
    merged = merge_partials(outs.to(dtype), lses)
    assert merged.out.dtype == dtype and merged.lse.dtype == torch.float32
    for i in range(n):
        idx = visible[i].nonzero().flatten()
        out, lse = plain_attention(q[i], k[idx], v[idx], scale)
        torch.testing.assert_close(merged.out[i].double(), out, **tol(dtype))
        torch.testing.assert_close(merged.lse[i].double(), lse, **F32_TOL)

    # empty partials anywhere in the stack change nothing, whatever their out holds
    empties = torch.randint(1, 4, (), generator=g).item()
    at = torch.randperm(subsets + empties, generator=g)
    padded_out = torch.zeros(subsets + empties, n, heads, 6)
    padded_lse = torch.full((subsets + empties, n, heads), -math.inf)
    padded_out[at[:subsets]], padded_lse[at[:subsets]] = outs, lses
    padded_out[at[subsets:][0]] = NAN  # garbage in an empty partial must not leak
    again = merge_partials(padded_out.to(dtype), padded_lse)
    assert not again.out.isnan().any() and not again.lse.isnan().any()
    torch.testing.assert_close(again.out, merged.out, rtol=1e-6, atol=1e-6)  # summation order only
    torch.testing.assert_close(again.lse, merged.lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_empty_partials_give_zero_and_minus_infinity(dtype):
    out = torch.zeros(3, 2, 4, 8, dtype=dtype)
    lse = torch.full((3, 2, 4), -math.inf)
    merged = merge_partials(out, lse)
    assert torch.equal(merged.out, torch.zeros(2, 4, 8, dtype=dtype))
    assert torch.equal(merged.lse, torch.full((2, 4), -math.inf))


def test_merge_two_is_merge_partials_of_the_pair():
    g = torch.Generator().manual_seed(0)
    a = Partial(torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, generator=g))
    b = Partial(torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, generator=g))
    b.lse[0] = -math.inf
    pair = merge_two(a, b)
    both = merge_partials(torch.stack((a[0], b[0])), torch.stack((a[1], b[1])))
    assert torch.equal(pair.out, both.out) and torch.equal(pair.lse, both.lse)
    torch.testing.assert_close(pair.out[0], a[0][0], **F32_TOL)  # b's row 0 is empty


# --- dense_partial and TorchBackend ---


@pytest.mark.parametrize("chunk", [None, 1, 3], ids=["whole", "chunk1", "chunk3"])
def test_dense_partial_masks_nan_and_empty_queries(monkeypatch, chunk):
    """Also in chunks of queries (``CHUNK_ELEMENTS`` bounds a long step's memory): one query,
    and three, which do not divide the four."""
    if chunk is not None:  # a query gathers 6 keys x (2 heads x (8 + 5) + 2 x 4 scores)
        monkeypatch.setattr("torch_cp.attention.torch_ref.CHUNK_ELEMENTS", chunk * 6 * 34)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 4, 8, generator=g), torch.randn(4, 6, 2, 8, generator=g),
               torch.randn(4, 6, 2, 5, generator=g))
    mask = torch.rand(4, 6, generator=g) < 0.6
    mask[0] = False  # a query with no key at all
    mask[1:, :2] = True
    batch = torch.tensor([2, 0, 3, 1])  # query i reads key set batch[i]
    for i in range(4):
        k[batch[i], ~mask[i]], v[batch[i], ~mask[i]] = NAN, NAN  # every masked slot is NaN
    got = dense_partial(q, k, v, mask, 0.3, key_batch=batch)
    assert torch.equal(got.out[0], torch.zeros(4, 5)) and got.lse[0].eq(-math.inf).all()
    for i in range(1, 4):
        idx = mask[i].nonzero().flatten()
        out, lse = plain_attention(q[i], k[batch[i], idx], v[batch[i], idx], 0.3)
        torch.testing.assert_close(got.out[i].double(), out, **F32_TOL)
        torch.testing.assert_close(got.lse[i].double(), lse, **F32_TOL)


ROWS = {  # (ctx, q) per row: rows with no context, below and across pages
    "prefill": [(0, 3), (5, 1), (7, 4), (0, 1), (9, 2)],
    "decode": [(0, 1), (6, 1), (3, 1), (8, 1)],
}
PADDING = {"none": {}, "rows": dict(rows_to=6), "tokens": dict(tokens_to=16)}
KINDS = {"gqa-g1": 1, "gqa-g2": 2, "gqa-g4": 4, "mla": None}
PAGE = 4


def new_kv(kind, tokens, g):
    """GQA: K [n, 2, 16], V [n, 2, 16]. MLA: ckv [n, 16] (keys ckv|kpe, values ckv), kpe [n, 8]."""
    if kind == "mla":
        return torch.randn(tokens, 16, generator=g), torch.randn(tokens, 8, generator=g)
    return torch.randn(tokens, 2, 16, generator=g), torch.randn(tokens, 2, 16, generator=g)


def as_keys_values(kind, a, b):
    """The key and value tensors [n, Hkv, D] plain attention sees."""
    if kind == "mla":
        return torch.cat((a, b), -1)[:, None], a[:, None]
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("padding", list(PADDING))
@pytest.mark.parametrize("batch", list(ROWS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_torch_backend_equals_plain_attention(kind, batch, padding, dtype):
    """A history prefill, then a step of rows through the pool (P = 1); unwritten pool slots, the
    sink page and every padding query/key/value hold NaN, and real rows must not see it."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}{batch}{padding}".encode()))
    rows = ROWS[batch]
    tables, start = [], 0
    for c, q in rows:
        n = -(-(c + q) // PAGE)
        tables.append(list(range(start, start + n))[::-1])  # pages out of order
        start += n
    group = KINDS[kind]
    if kind == "mla":
        geometry = AttentionGeometry("mla", 4, 1, 24, 16, 24 ** -0.5, 4, rope_dim=8)
        pool = MLAPool(1, start, PAGE, 16, 8, ContextParallel.single(), dtype)
        pool.ckv.fill_(NAN), pool.kpe.fill_(NAN)
    else:
        geometry = AttentionGeometry("gqa", 2 * group, 2, 16, 16, 0.25, 2 * group)
        pool = GQAPool(1, start, PAGE, 2, 16, ContextParallel.single(), dtype)
        pool.kv.fill_(NAN)
    backend = TorchBackend(geometry)
    full = [[t.to(dtype) for t in new_kv(kind, c + q, g)] for c, q in rows]  # every row's K/V

    history = [b for b, (c, _) in enumerate(rows) if c > 0]
    before = build_step_plan([rows[b][0] for b in history], [0] * len(history),
                             [tables[b] for b in history], page_size=PAGE, sink_page=start)
    pool.write(0, *(torch.cat([full[b][i][: rows[b][0]] for b in history]) for i in (0, 1)),
               before.write_index)

    q_lens = [q for _, q in rows]
    plan = build_step_plan(q_lens, [c for c, _ in rows], tables, page_size=PAGE, sink_page=start,
                           bucket=padding_bucket(q_lens, tables, **PADDING[padding]))
    width, real = plan.positions.shape[0], plan.num_tokens
    q = torch.full((width, geometry.q_heads, geometry.head_dim), NAN, dtype=dtype)
    q[:real] = torch.randn(real, geometry.q_heads, geometry.head_dim, generator=g).to(dtype)
    new = [torch.full((width, *full[0][i].shape[1:]), NAN, dtype=dtype) for i in (0, 1)]
    for i in (0, 1):
        new[i][:real] = torch.cat([full[b][i][c:] for b, (c, _) in enumerate(rows)])
    pool.write(0, new[0], new[1], plan.write_index)
    backend.plan(plan)
    partial = backend.run_context(q, pool.tensors, 0)
    if not plan.is_decode:
        context_only = partial
        partial = merge_two(partial, backend.run_own(q, new[0], new[1]))
        for i, b in enumerate(plan.token_row[:real].tolist()):
            if rows[b][0] == 0:  # no context: the context partial is empty
                assert context_only.out[i].eq(0).all() and context_only.lse[i].eq(-math.inf).all()
    assert torch.isfinite(partial.out[:real]).all()
    for i, (b, t) in enumerate(zip(plan.token_row[:real].tolist(),
                                   plan.positions[:real].tolist(), strict=True)):
        k, v = as_keys_values(kind, full[b][0][: t + 1], full[b][1][: t + 1])
        out, lse = plain_attention(q[i], k, v, geometry.scale)
        torch.testing.assert_close(partial.out[i].double(), out, **tol(dtype))
        torch.testing.assert_close(partial.lse[i].double(), lse, **F32_TOL)


def test_flashinfer_merge_states_only_where_it_launches():
    """bf16/fp16 at <= 64 heads of 128 or <= 32 heads of 512 (see torch_cp.attention.merge)."""
    def geometry(heads, dim_v):
        return AttentionGeometry("gqa", heads, 1, dim_v, dim_v, 1.0, heads)

    assert merge_states_applies(geometry(64, 128), torch.bfloat16)
    assert not merge_states_applies(geometry(65, 128), torch.bfloat16)
    assert merge_states_applies(geometry(32, 512), torch.bfloat16)
    assert not merge_states_applies(geometry(64, 512), torch.bfloat16)
    assert not merge_states_applies(geometry(32, 128), torch.float32)
