"""torch_cp's Triton paged decode (attention/triton_decode.py) against the torch reference's
dense attention (``torch_ref.dense_partial``), in Triton's interpreter on the CPU.

fp32 pool and queries: the kernels multiply in fp32 there, so outputs and base-2 LSE within 1e-4
of the reference (float32 sums in another order, over up to 1500 keys in chunks merged by
rescaling; a wrong rescaling or chunk errs by 1e-1 and more). Rows with no
context, rows shorter than a block, longer than a split, a padding token (row -1); NaN in the
sink page and in every slot past a row's length never reaches a real token; the context in one
chunk a token, in several, in one block each, a skewed batch (one long row takes most chunks)
and no context at all. GPU: the FlashInfer backend's tests with ``decode_kernel="triton"``."""

from __future__ import annotations

import pytest
import torch

from torch_cp.attention.torch_ref import dense_partial

pytest.importorskip("triton", reason="the kernels are Triton (CPU: its interpreter)")
from torch_cp.attention import triton_decode as td  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, KV_HEADS, GROUP, DIM = 8, 2, 3, 16
LENS = [0, 1, 70, 300, 9]


def pool_and_tables(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // PAGE) for n in lens) + 1
    pages = len(lens) * width + 1  # the last page is the sink
    kv = torch.randn(pages, 2, PAGE, KV_HEADS, DIM, generator=g)
    order = torch.randperm(pages - 1, generator=g).view(len(lens), width)
    table = torch.full((len(lens), width), pages - 1, dtype=torch.int32)
    for row, n in enumerate(lens):
        used = -(-n // PAGE)
        table[row, :used] = order[row, :used].int()
        for slot in range(n, used * PAGE):  # past the row's length in its last page
            kv[table[row, used - 1], :, slot % PAGE] = float("nan")
    kv[pages - 1] = float("nan")
    return kv, table


def reference(q, kv, table, lens, token_row, scale):
    rows, width = table.shape
    cache = kv[table.long()]  # [B, W, 2, page, Hkv, D]
    k = cache[:, :, 0].reshape(rows, width * PAGE, KV_HEADS, DIM)
    v = cache[:, :, 1].reshape(rows, width * PAGE, KV_HEADS, DIM)
    slot = torch.arange(width * PAGE)
    length = torch.tensor(lens)[token_row.clamp(min=0)]
    mask = (slot[None, :] < length[:, None]) & (token_row[:, None] >= 0)
    return dense_partial(q, k, v, mask, scale, key_batch=token_row)


@pytest.mark.parametrize("lens, spare", [
    pytest.param(LENS, 1, id="few-items"),  # chunks of the whole context: one a token
    pytest.param(LENS, 6, id="chunks"),
    pytest.param(LENS, 64, id="blocks"),  # more items than blocks: chunks of one block
    pytest.param([600, 3, 5, 0, 2], 5, id="skewed"),  # the long row takes most chunks
    pytest.param([1500, 3, 5, 0, 2], 40, id="many-chunks"),  # 24: merged in several blocks
    pytest.param([0, 0, 0, 0, 0], 4, id="no-context"),
])
@pytest.mark.parametrize("block_n", [td.BLOCK_N, 16], ids=["default-tile", "tile16"])
def test_decode_equals_dense_attention(lens, spare, block_n):
    kv, table = pool_and_tables(lens)
    token_row = torch.tensor([0, 1, 2, 3, 4, -1])  # a padding token last
    q = torch.randn(len(token_row), KV_HEADS * GROUP, DIM,
                    generator=torch.Generator().manual_seed(1))
    want = reference(q, kv, table, lens, token_row, 0.25)
    out, lse = td.decode(q.to(DEVICE), kv.to(DEVICE), table.to(DEVICE),
                         torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                         token_row.to(DEVICE), 0.25, spare, block_n, warps=2)
    real = torch.tensor([n > 0 for n in lens] + [False])
    torch.testing.assert_close(out.cpu()[real], want.out[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu()[real], want.lse[real], atol=1e-4, rtol=1e-4)
    empty = ~real  # no context, and the padding token
    assert torch.equal(out.cpu()[empty], torch.zeros_like(out.cpu()[empty]))
    assert torch.isneginf(lse.cpu()[empty]).all()


def test_one_token_steps_take_their_tile(monkeypatch):
    """A one-token step at ``tile_for(1)`` (the one-token tile, one program an SM) equals dense
    attention; longer steps keep the module's tile."""
    assert td.tile_for(1) == td.ONE_TOKEN_TILE and td.tile_for(2)[0] == td.BLOCK_N
    lens = [700]
    kv, table = pool_and_tables(lens)
    token_row = torch.tensor([0])
    q = torch.randn(1, KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(2))
    want = reference(q, kv, table, lens, token_row, 0.25)
    block_n, warps, per_sm, stages = td.tile_for(1)
    spare = td.spare_items(1, KV_HEADS, sms=8, programs_per_sm=per_sm)
    out, lse = td.decode(q.to(DEVICE), kv.to(DEVICE), table.to(DEVICE),
                         torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                         token_row.to(DEVICE), 0.25, spare, block_n, warps, stages)
    torch.testing.assert_close(out.cpu(), want.out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), want.lse, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(td, "ONE_TOKEN_TILE", None)
    assert td.tile_for(1) == (td.BLOCK_N, td.WARPS, td.PROGRAMS_PER_SM, td.STAGES)


def test_spare_items_fill_the_device_and_hold_every_token():
    assert td.spare_items(tokens=1, kv_heads=8, sms=132) == 66
    assert td.spare_items(tokens=32, kv_heads=4, sms=132) == 132
    assert td.spare_items(tokens=512, kv_heads=8, sms=132) == 512
    assert td.spare_items(tokens=1, kv_heads=8, sms=132, programs_per_sm=2) == 33
    assert td.supported(128, 8) and not td.supported(96, 8) and not td.supported(128, 128)
