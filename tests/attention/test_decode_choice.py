"""Which kernel the FlashInfer GQA backend's decode steps run (``decode_kernel``), on the CPU
with a stand-in ``flashinfer`` module that records its wrappers' plans: eager steps choose at
each plan ("auto": the Triton decode for one-token steps over short rows, at its one-token
tile); a captured bucket keeps the kernel and tile of its first plan (the capture's) when the
module's settings change later, where re-planning the other kernel would leave the captured one
reading a plan it never got. The kernels' numbers: ``test_triton_decode.py`` and the GPU
tests."""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("triton", reason="the Triton decode is Triton")
from torch_cp.attention import flashinfer_gqa as fg  # noqa: E402
from torch_cp.attention import triton_decode as td  # noqa: E402
from torch_cp.attention.backend import AttentionGeometry  # noqa: E402
from torch_cp.plan import Bucket, build_step_plan  # noqa: E402


class _Wrapper:
    planned: list[str] = []

    def __init__(self, *args, **kwargs):
        pass

    def plan(self, *args, **kwargs):
        _Wrapper.planned.append(type(self).__name__)


class _NoFence:
    def __init__(self, device):
        pass

    def wait(self):
        pass

    def mark(self):
        pass


@pytest.fixture
def backend(monkeypatch):
    fake = types.ModuleType("flashinfer")
    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                 "BatchPrefillWithRaggedKVCacheWrapper"):
        setattr(fake, name, type(name, (_Wrapper,), {}))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(fg, "PlanFence", _NoFence)  # CUDA events
    monkeypatch.setattr(_Wrapper, "planned", [])
    monkeypatch.setattr(fg, "TRITON_STEP_TOKENS", fg.TRITON_STEP_TOKENS)
    monkeypatch.setattr(td, "ONE_TOKEN_TILE", td.ONE_TOKEN_TILE)
    geometry = AttentionGeometry("gqa", 8, 2, 64, 64, 64 ** -0.5, 8)

    def make(kernel):
        return fg.FlashInferGQABackend(geometry, "cpu", dtype=torch.float32,
                                       decode_kernel=kernel)
    return make


def decode_step(backend, rows: int, bucket: Bucket | None = None, context: int = 5):
    """Plan a decode step of ``rows`` one-token rows after ``context`` tokens each (pages of 16);
    the kernel it chose and its tile."""
    pages = context // 16 + 1
    plan = build_step_plan([1] * rows, [context] * rows,
                           [list(range(i * pages, (i + 1) * pages)) for i in range(rows)],
                           page_size=16, sink_page=999, bucket=bucket)
    _Wrapper.planned.clear()
    backend.plan(plan)
    kernels = backend._active
    on_flashinfer = _Wrapper.planned == ["BatchDecodeWithPagedKVCacheWrapper"]
    assert kernels._on_triton != on_flashinfer, _Wrapper.planned
    return ("triton" if kernels._on_triton else "flashinfer"), kernels._tile


def test_auto_chooses_at_each_eager_step(backend):
    auto = backend("auto")
    one = ("triton", td.ONE_TOKEN_TILE)
    assert [decode_step(auto, rows) for rows in (1, 3, 1, 2)] == [
        one, ("flashinfer", None), one, ("flashinfer", None)]


def test_auto_leaves_rows_longer_than_its_limit_to_flashinfer(backend):
    """By the widest row an eager step holds, by its table width a bucket (a row of it may grow
    to the width after capture)."""
    auto, one = backend("auto"), ("triton", td.ONE_TOKEN_TILE)
    limit = fg.TRITON_MAX_CONTEXT
    assert decode_step(auto, 1, context=limit - 1) == one  # a table of limit slots
    assert decode_step(auto, 1, context=limit) == ("flashinfer", None)
    narrow, wide = Bucket(1, 1, limit // 16), Bucket(1, 1, limit // 16 + 1)
    for bucket in (narrow, wide):
        auto.add_bucket(bucket)
    assert decode_step(auto, 1, narrow) == one
    assert decode_step(auto, 1, wide) == ("flashinfer", None)  # a 5-token row, a wide table
    always = backend("triton")
    assert decode_step(always, 1, context=4 * limit) == one


def test_triton_runs_every_decode_step_at_the_tile_for_its_size(backend):
    always = backend("triton")
    assert decode_step(always, 1) == ("triton", td.ONE_TOKEN_TILE)
    assert decode_step(always, 3) == ("triton", (td.BLOCK_N, td.WARPS, td.PROGRAMS_PER_SM,
                                                 td.STAGES))
    assert decode_step(backend("flashinfer"), 1) == ("flashinfer", None)


def test_a_bucket_keeps_its_first_choice(backend, monkeypatch):
    auto = backend("auto")
    one_row, four_rows = Bucket(1, 1, 4), Bucket(4, 4, 16)
    for bucket in (one_row, four_rows):
        auto.add_bucket(bucket)
    captured_one = decode_step(auto, 1, one_row)
    assert captured_one == ("triton", td.ONE_TOKEN_TILE)
    assert decode_step(auto, 4, four_rows) == ("flashinfer", None)
    assert decode_step(auto, 1, four_rows) == ("flashinfer", None)  # one real row, padded to 4
    monkeypatch.setattr(fg, "TRITON_STEP_TOKENS", 4)
    monkeypatch.setattr(td, "ONE_TOKEN_TILE", (64, 8, 2, 2))
    assert decode_step(auto, 4, four_rows) == ("flashinfer", None)
    assert decode_step(auto, 1, one_row) == captured_one
    # eager steps: today's settings
    assert decode_step(auto, 4) == ("triton", (td.BLOCK_N, td.WARPS, td.PROGRAMS_PER_SM,
                                               td.STAGES))
    assert decode_step(auto, 1) == ("triton", (64, 8, 2, 2))


def test_a_bucket_stages_its_table_at_the_buckets_width(backend):
    """A bucket's plan is as wide as its longest row; staged at that width, a later, wider or
    narrower step re-allocated the table a captured Triton decode keeps reading (helper 97).
    Every step of the bucket now stages into one tensor of the bucket's width, its first
    columns the step's pages and the rest the sink page."""
    auto, bucket = backend("triton"), Bucket(2, 2, 16)
    auto.add_bucket(bucket)
    staged = []
    for context in (100, 20, 60):  # 7, 2 and 4 pages a row
        decode_step(auto, 2, bucket, context)
        table = auto._active._table
        pages = context // 16 + 1
        assert table.shape == (2, bucket.table_width)
        assert table[:, :pages].tolist() == [list(range(pages)), list(range(pages, 2 * pages))]
        assert (table[:, pages:] == 999).all()
        staged.append(table)
    assert staged[0] is staged[1] is staged[2]
