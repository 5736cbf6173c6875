"""Invariant 5 for the hybrid families at P = 2 and 4 over gloo ranks, TP and SP mode: through the
``Engine`` (long prompts prefilled in several chunks, requests queued for state slots) every rank
generates the unpatched single-process Hugging Face model's greedy tokens, with close last-step
logits. The linear-attention state is never striped: a rank holds its TP share of the heads
(1/tp of the P = 1 state's bytes, and those heads' values of the P = 1 engine's state), so in
TP mode the state splits over the partners and in SP mode every partner holds its TP rank's
whole share.

Ranks are spawned once per world size (2 and 4) and run every case of that size. Tolerance:
test_hybrid's (fp32, atol = rtol = 1e-3, and why); TP adds the all-reduce's reassociation only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from multirank import ranks_by_world
from test_hybrid import (
    LONG_A,
    LONG_B,
    MIN_GAP,
    TOL,
    geometry_of,
    hf_reference,
    hybrid_model,
    run_engine,
)

import torch_cp
from torch_cp.mesh import init_mesh

pytestmark = pytest.mark.slow  # spawns gloo ranks

PAGE_SIZE = 8
CHUNK = 16
MAX_ROWS = 2
NEW_TOKENS = 4
PROMPTS = [LONG_A, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], LONG_B]  # LONG_B waits for a used slot
KV1 = dict(num_key_value_heads=1)


@dataclass(frozen=True)
class Case:
    family: str
    sp: int
    tp: int
    mode: str
    partners: int  # P, what the placement must come out as
    overrides: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.sp * self.tp

    @property
    def id(self) -> str:
        return f"{self.family}-sp{self.sp}xtp{self.tp}-{self.mode}-mode-P{self.partners}"


CASES = [
    Case("qwen3_5_text", 1, 2, "tp", 2, KV1),
    Case("qwen3_next", 2, 1, "sp", 2),
    Case("qwen3_5_moe_text", 2, 2, "sp", 2),  # heads and state split over TP, partners over SP
    Case("qwen3_next", 1, 4, "tp", 4,
         dict(KV1, linear_num_key_heads=4, linear_num_value_heads=8)),
]


def _engine_run(model):
    engine = torch_cp.Engine(model, num_pages=32, max_tokens_per_step=CHUNK, max_rows=MAX_ROWS)
    tokens, logits, taken = run_engine(engine, PROMPTS, NEW_TOKENS)
    a = engine.allocator
    return dict(tokens=tokens, logits=logits, taken=taken, state_bytes=engine.state_bytes,
                conv=engine.state.conv.clone(), recurrent=engine.state.recurrent.clone(),
                all_free=(a.free_pages, a.free_state_slots) == (a.num_pages, a.state_slots))


def _run_cases(rank: int, world: int, cases: list[Case]) -> dict:
    results = {}
    for case in cases:
        mesh = init_mesh(tp=case.tp, sp=case.sp, device_type="cpu")
        model = torch_cp.patch_model(hybrid_model(case.family, **case.overrides),
                                     context_parallel=True, mesh=mesh, mode=case.mode,
                                     page_size=PAGE_SIZE)
        results[case.id] = dict(_engine_run(model), partners=model.torch_cp.placement.size,
                                tp_rank=model.torch_cp.tp_rank)
    return results


@pytest.fixture(scope="module")
def ranks():
    """world size -> each rank's results for the cases of that size (spawned once per size)."""
    return ranks_by_world(_run_cases, CASES)


@pytest.fixture(scope="module")
def references():
    """Per case: the unpatched model's tokens and last logits, and a P = 1 engine's run."""
    memo = {}

    def reference(case: Case):
        if case.id not in memo:
            tokens, logits, gap = hf_reference(hybrid_model(case.family, **case.overrides),
                                               PROMPTS, NEW_TOKENS)
            assert gap > MIN_GAP, f"{case.id}: greedy is {gap:.2g} from a tie"
            model = torch_cp.patch_model(hybrid_model(case.family, **case.overrides),
                                         page_size=PAGE_SIZE)
            memo[case.id] = (tokens, logits), _engine_run(model), model.config
        return memo[case.id]
    return reference


def tp_share(conv, recurrent, config, tp: int, tp_rank: int):
    """The state a TP rank holds of the P = 1 ``conv`` [layers, slots, C, K - 1] (channels:
    q heads | k heads | v heads) and ``recurrent`` [layers, slots, v_heads, k_dim, v_dim]."""
    key, value = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    q, k, v = conv.split([key * dk, key * dk, value * dv], dim=2)
    share = [x.chunk(tp, dim=2)[tp_rank] for x in (q, k, v)]
    return torch.cat(share, dim=2), recurrent.chunk(tp, dim=2)[tp_rank]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_rank_generates_the_unpatched_tokens(ranks, references, case):
    ref, single, _ = references(case)
    per_rank = [results[case.id] for results in ranks(case.world)]
    for rank, got in enumerate(per_rank):
        assert got["partners"] == case.partners, f"rank {rank}"
        assert got["tokens"] == ref[0], f"rank {rank}"
        torch.testing.assert_close(got["logits"], ref[1], **TOL,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")
        assert got["all_free"], f"rank {rank}: a page or state slot was not returned"
        assert got["taken"] == single["taken"], f"rank {rank}"
    assert len(set(single["taken"])) == MAX_ROWS < len(PROMPTS), "LONG_B reuses a slot"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_rank_holds_its_tp_share_of_the_state(ranks, references, case):
    """Bytes: 1/tp of P = 1's (TP mode: 1/P; SP mode: every partner the whole share). Values:
    the P = 1 engine's state of this rank's heads, slot by slot."""
    _, single, config = references(case)
    one_rank = geometry_of(config).slot_bytes(torch.float32) * (MAX_ROWS + 2)
    assert single["state_bytes"] == one_rank
    for rank, results in enumerate(ranks(case.world)):
        got = results[case.id]
        assert got["state_bytes"] * case.tp == one_rank, f"rank {rank}"
        conv, recurrent = tp_share(single["conv"], single["recurrent"], config, case.tp,
                                   got["tp_rank"])
        torch.testing.assert_close(got["conv"], conv, **TOL,
                                   msg=lambda m, r=rank: f"rank {r} conv: {m}")
        torch.testing.assert_close(got["recurrent"], recurrent, **TOL,
                                   msg=lambda m, r=rank: f"rank {r} recurrent: {m}")
