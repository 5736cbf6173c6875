"""Invariant 1 and 3: attention over a pool striped across P partners equals dense attention over
the unstriped sequence, for both modes, GQA and MLA, fp32 and bf16; every partner issues the same
collectives in the same order with the same shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from placed_cases import Case, run_case, tolerance

from torch_cp.placement import ContextParallel

F32, BF16 = torch.float32, torch.bfloat16
CASES = [
    Case("tp", "gqa", "mixed", group=1, dtype=F32, seed=0),
    Case("tp", "gqa", "mixed", group=2, dtype=F32, seed=1),
    Case("tp", "gqa", "decode", group=4, dtype=F32, seed=2),
    Case("tp", "gqa", "mixed", group=4, dtype=BF16, seed=3),
    Case("sp", "gqa", "mixed", group=1, dtype=F32, seed=4, kv_heads=2),
    Case("sp", "gqa", "mixed", group=4, dtype=F32, seed=5, kv_heads=2),
    Case("sp", "gqa", "decode", group=2, dtype=F32, seed=6, kv_heads=2),
    Case("sp", "gqa", "mixed", group=2, dtype=BF16, seed=7, kv_heads=2),
    Case("tp", "mla", "mixed", group=4, dtype=F32, seed=8),
    Case("tp", "mla", "decode", group=4, dtype=BF16, seed=9),
    Case("sp", "mla", "mixed", group=2, dtype=F32, seed=10),
    Case("sp", "mla", "decode", group=2, dtype=BF16, seed=11),
]


def _run_all(rank: int, world_size: int, cases: list[Case]):
    group = dist.new_group(list(range(world_size)))
    results = {}
    for case in cases:
        records = []
        placement = ContextParallel(world_size, rank, case.mode, group)
        steps = run_case(case, placement, records)
        results[case.id] = ([(out.float(), ref) for out, ref in steps], records)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def ranks(request):
    return request.param, run_ranks(request.param, _run_all, CASES)


@pytest.mark.slow  # spawns processes
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_placed_equals_dense(ranks, case):
    size, per_rank = ranks
    for rank, results in enumerate(per_rank):
        steps, _ = results[case.id]
        for step, (out, ref) in enumerate(steps):
            assert torch.isfinite(out).all(), f"rank {rank} step {step}: non-finite output"
            where = f"P={size} rank {rank} step {step}"
            torch.testing.assert_close(out, ref, **tolerance(case.dtype),
                                       msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.slow  # spawns processes
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_partners_issue_identical_collectives(ranks, case):
    _, per_rank = ranks
    records = [results[case.id][1] for results in per_rank]
    assert records[0], "a placed step must exchange partials"
    for rank, recorded in enumerate(records[1:], start=1):
        assert recorded == records[0], f"rank {rank} diverges from rank 0"


@pytest.mark.parametrize("case", CASES[:1] + CASES[8:9], ids=lambda c: c.id)
def test_one_partner_equals_dense(case):
    for out, ref in run_case(case, ContextParallel.single()):
        torch.testing.assert_close(out.float(), ref, **tolerance(case.dtype))
