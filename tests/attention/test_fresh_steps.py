"""A step of fresh rows (no cached context: a first prefill chunk) attends its own tokens only:
no context kernel, no exchange, no merge, and the same bits as merging the empty context partial
(weight exp(-inf) = 0 on it, 1 on the own partial)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from buckets import padding_bucket

from torch_cp.attention import AttentionGeometry, ContextParallelAttention, Exchange, TorchBackend
from torch_cp.kv import GQAPool
from torch_cp.placement import ContextParallel
from torch_cp.plan import build_step_plan

PAGE = 8
TABLES = [[0, 1], [2], [3, 4]]


def plan_of(q_lens, ctx_lens, bucket=None):
    return build_step_plan(q_lens, ctx_lens, TABLES[: len(q_lens)], page_size=PAGE, sink_page=9,
                           bucket=bucket)


def test_only_an_eager_step_of_fresh_rows_skips_the_context():
    assert not plan_of([9, 3, 10], [0, 0, 0]).attends_context
    assert plan_of([9, 3, 10], [0, 2, 0]).attends_context  # one row has cached tokens
    assert plan_of([1, 1, 1], [0, 0, 0]).attends_context  # decode: its token is in the pool
    bucket = padding_bucket([9, 3, 10], TABLES, tokens_to=32)
    assert plan_of([9, 3, 10], [0, 0, 0], bucket).attends_context  # replays may have context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_step_gives_the_bits_of_merging_an_empty_context(dtype, monkeypatch):
    heads, kv_heads, dim = 4, 2, 16
    geometry = AttentionGeometry("gqa", heads, kv_heads, dim, dim, 1 / math.sqrt(dim),
                                 context_q_heads=heads)
    placement = ContextParallel.single()
    attention = ContextParallelAttention(0, TorchBackend(geometry), Exchange(placement))
    pool = GQAPool(1, 10, PAGE, kv_heads, dim, placement, dtype)
    plan = plan_of([9, 3, 10], [0, 0, 0])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(22, h, dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    attention.backend.plan(plan)
    merged = attention(q, k, v, pool, dataclasses.replace(plan, attends_context=True))

    def refuse(*args):
        raise AssertionError("a fresh step ran the context kernel")

    monkeypatch.setattr(attention.backend, "run_context", refuse)
    fresh = attention(q, k, v, pool, plan)
    assert torch.equal(fresh, merged)
    assert torch.isfinite(fresh).all()
