"""Invariant 4: padding rows and padding tokens cannot poison real rows.

NaN in the padding's queries, keys and values and in the sink page leaves every real token's
output bit-identical to the same padded step with finite padding, and close to the unpadded step,
for decode buckets with more rows than real rows and mixed buckets with tokens past the last row,
at P = 1 and over P = 2 partners in both modes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from placed_cases import Case, run_case, tolerance

from torch_cp.placement import ContextParallel

CASES = [
    Case("tp", "gqa", "decode", group=2, dtype=torch.float32, seed=20),
    Case("tp", "gqa", "mixed", group=2, dtype=torch.bfloat16, seed=21),
    Case("sp", "gqa", "mixed", group=2, dtype=torch.float32, seed=22, kv_heads=2),
    Case("sp", "mla", "decode", group=2, dtype=torch.bfloat16, seed=23),
    Case("tp", "mla", "mixed", group=2, dtype=torch.float32, seed=24),
]
PAD = dict(pad_rows=3, pad_tokens=5)


def _outputs(placement: ContextParallel, case: Case):
    """Real-token outputs of the case's step: unpadded, padded with NaN, padded with 1.0."""
    return [run_case(case, placement, **kw)[1][0] for kw in
            ({}, dict(PAD, pad_fill=float("nan")), dict(PAD, pad_fill=1.0))]


def _run_all(rank: int, world_size: int, cases):
    group = dist.new_group(list(range(world_size)))
    return {c.id: _outputs(ContextParallel(world_size, rank, c.mode, group), c) for c in cases}


@pytest.fixture(scope="module")
def two_partners():
    return run_ranks(2, _run_all, CASES)


def _check(case: Case, unpadded, nan_padded, finite_padded, where: str):
    assert torch.isfinite(nan_padded).all(), f"{where}: NaN padding reached a real row"
    assert torch.equal(nan_padded, finite_padded), f"{where}: padding values changed a real row"
    torch.testing.assert_close(nan_padded.float(), unpadded.float(), **tolerance(case.dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_padding_is_invisible_on_one_partner(case):
    _check(case, *_outputs(ContextParallel.single(), case), "P=1")


@pytest.mark.slow  # spawns processes
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_padding_is_invisible_across_partners(two_partners, case):
    for rank, results in enumerate(two_partners):
        _check(case, *results[case.id], f"P=2 rank {rank}")
