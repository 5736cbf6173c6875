"""``mla_planner``: where FlashInfer 0.7.2 plans causal MLA exactly, and the heads the own-token
kernel runs with (host arithmetic, CPU). The query tile is 64 rows, or 128 when the mean
``q * H`` exceeds 64; a causal tile is exact when it is a multiple of the heads (a whole number
of tokens). The padded path's outputs against the torch reference: the GPU test
``test_flashinfer_gpu.py::test_mla_own_token_paths``."""

from __future__ import annotations

import pytest

from torch_cp.attention.mla_planner import (
    causal_mla_on_flashinfer,
    own_heads_for,
    own_token_heads,
)

PREFILL = [512] * 4  # tile 128 at any head count
TINY = [1, 0, 0, 0]  # mean q * H <= 64 up to 256 heads: tile 64


@pytest.mark.parametrize("q_lens", [PREFILL, TINY], ids=["tile128", "tile64"])
@pytest.mark.parametrize("heads, want", [(16, 16), (32, 32), (64, 64), (20, 32), (40, 64),
                                         (5, 8), (48, 64), (1, 1)])
def test_heads_that_tile_are_kept_and_others_padded_to_a_power_of_two(q_lens, heads, want):
    assert own_token_heads(q_lens, heads) == want
    assert causal_mla_on_flashinfer(q_lens, want)
    assert causal_mla_on_flashinfer(q_lens, heads) == (want == heads)


def test_no_exact_heads_where_the_padding_exceeds_the_tile():
    assert own_token_heads(TINY, 128) is None  # tile 64: 128 heads never fit it
    assert own_token_heads(TINY, 96) is None
    assert own_token_heads(PREFILL, 96) == 128  # tile 128


def test_each_mode_runs_the_own_tokens_with_its_heads():
    assert own_heads_for("auto", PREFILL, 16) == 16
    assert own_heads_for("auto", PREFILL, 20) == 32  # padded: exact on the GPU, run 81
    assert own_heads_for("auto", TINY, 128) is None
    assert own_heads_for("torch", PREFILL, 16) is None
