"""``mla_planner``: where FlashInfer 0.7.2 plans causal MLA exactly, and the head parts the
own-token kernel runs in (host arithmetic, CPU). The query tile is 64 rows, or 128 when the mean
``q * H`` exceeds 64; a causal tile is exact when it is a multiple of the heads (a whole number
of tokens). The parts' outputs against the torch reference: the GPU test
``test_flashinfer_gpu.py::test_mla_own_token_paths``."""

from __future__ import annotations

import pytest

from torch_cp.attention.mla_planner import (
    causal_mla_on_flashinfer,
    max_own_parts,
    own_parts_for,
    own_token_parts,
)

PREFILL = [512] * 4  # tile 128 at any head count
TINY = [1, 0, 0, 0]  # mean q * H <= 64 up to 256 heads: tile 64


@pytest.mark.parametrize("q_lens", [PREFILL, TINY], ids=["tile128", "tile64"])
@pytest.mark.parametrize("heads, want", [(16, (16,)), (32, (32,)), (64, (64,)), (20, (16, 4)),
                                         (40, (32, 8)), (5, (4, 1)), (48, (32, 16)), (1, (1,)),
                                         (63, (32, 16, 8, 4, 2, 1))])
def test_heads_that_tile_run_at_once_and_others_in_power_of_two_parts(q_lens, heads, want):
    parts = own_token_parts(q_lens, heads)
    assert parts == want
    assert sum(parts) == heads and len(parts) <= max_own_parts(heads)
    assert all(causal_mla_on_flashinfer(q_lens, part) for part in parts)
    assert causal_mla_on_flashinfer(q_lens, heads) == (parts == (heads,))


@pytest.mark.parametrize("q_lens, heads, want", [
    (TINY, 128, (64, 64)),  # tile 64: 128 heads never fit it at once
    (TINY, 96, (64, 32)),
    (PREFILL, 128, (128,)),  # tile 128
    (PREFILL, 96, (64, 32)),
    (PREFILL, 200, (64, 64, 64, 8)),
])
def test_more_heads_than_a_tile_run_in_parts_of_at_most_64(q_lens, heads, want):
    parts = own_token_parts(q_lens, heads)
    assert parts == want and len(parts) <= max_own_parts(heads)
    assert all(causal_mla_on_flashinfer(q_lens, part) for part in parts)


def test_each_mode_runs_the_own_tokens_with_its_heads():
    assert own_parts_for("auto", PREFILL, 16) == (16,)
    assert own_parts_for("auto", PREFILL, 20) == (16, 4)
    assert own_parts_for("auto", TINY, 128) == (64, 64)
    assert own_parts_for("torch", PREFILL, 16) is None
