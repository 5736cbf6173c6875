"""Invariant 5 at P = 2 and 4 over gloo ranks: a model patched with a mesh (TP-sharded, context
parallel in TP or SP mode) generates on every rank the greedy tokens of the unpatched
single-process Hugging Face model, with close last-step logits; each rank's pool holds 1/P of the
bytes a P = 1 pool of the same pages holds; and every rank issues the same partner collectives.

Ranks are spawned once per world size and run every case of that size. Tolerance: fp32,
atol = rtol = 1e-4 as in test_patch_gqa (TP adds the all-reduce's float32 reassociation only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from driver import (
    NEW_TOKENS,
    PROMPTS,
    TOL,
    greedy,
    hf_greedy,
    tiny_model,
)
from multirank import ranks_by_world

import torch_cp
from torch_cp.kv import GQAPool
from torch_cp.mesh import init_mesh
from torch_cp.placement import ContextParallel

pytestmark = pytest.mark.slow  # spawns gloo ranks

PAGE_SIZE = 8


@dataclass(frozen=True)
class Case:
    family: str
    sp: int
    tp: int
    context_parallel: bool
    mode: str
    partners: int  # P, what the placement must come out as
    overrides: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.sp * self.tp

    @property
    def id(self) -> str:
        cp = f"{self.mode}-mode-P{self.partners}" if self.context_parallel else "no-cp"
        kv = self.overrides.get("num_key_value_heads", 2)
        bias = "-bias" if self.overrides.get("attention_bias") else ""
        return f"{self.family}{bias}-sp{self.sp}xtp{self.tp}-kv{kv}-{cp}"


KV1 = dict(num_key_value_heads=1)
CASES = [
    Case("qwen3", 1, 2, True, "tp", 2, dict(KV1, attention_bias=True)),  # o_proj bias once
    Case("glm4_moe", 1, 2, True, "tp", 2, KV1),   # MoE + shared experts, qk-norm, partial RoPE
    Case("glm", 1, 2, True, "tp", 2, KV1),        # fused gate_up MLP, biases, interleaved RoPE
    Case("qwen3_moe", 2, 1, True, "sp", 2),
    Case("qwen2", 1, 2, False, "tp", 1),           # TP sharding alone
    Case("qwen3", 1, 4, True, "tp", 4, KV1),
    Case("qwen3", 1, 4, True, "tp", 2),            # 2 KV heads: 2 partners per head
    Case("qwen3_moe", 2, 2, True, "sp", 2),
    Case("glm4", 2, 2, True, "tp", 2, KV1),        # TP mode, replicated over SP
    # Every family at P = 2 in both modes (the cases above cover some of them).
    Case("qwen2", 1, 2, True, "tp", 2, KV1),
    Case("qwen2", 2, 1, True, "sp", 2),
    Case("qwen3", 2, 1, True, "sp", 2),
    # 12 float32 expert channels, 6 a rank: rows grouped_mm refuses (switched to batched_mm)
    Case("qwen3_moe", 1, 2, True, "tp", 2, dict(KV1, moe_intermediate_size=12)),
    Case("glm", 2, 1, True, "sp", 2),
    Case("glm4", 1, 2, True, "tp", 2, KV1),
    Case("glm4", 2, 1, True, "sp", 2),
    Case("glm4_moe", 2, 1, True, "sp", 2),
]


def _run_cases(rank: int, world: int, cases: list[Case]) -> dict:
    results = {}
    for case in cases:
        mesh = init_mesh(tp=case.tp, sp=case.sp, device_type="cpu")
        model = torch_cp.patch_model(tiny_model(case.family, **case.overrides),
                                     context_parallel=case.context_parallel, mesh=mesh,
                                     mode=case.mode, page_size=PAGE_SIZE)
        runtime = model.torch_cp
        runtime.exchange.records = []
        out = greedy(model, PROMPTS, NEW_TOKENS)
        g = runtime.geometry
        unplaced = GQAPool(runtime.num_layers, out.num_pages, PAGE_SIZE, g.kv_heads, g.head_dim,
                           ContextParallel.single(), runtime.dtype)
        # Fused linears share a storage (fused_linear.py); no storage holds more than them.
        held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
        shard_only = sum(held.values()) == sum(p.nbytes for p in model.parameters())
        try:
            torch_cp.unpatch_model(model)
            unpatched = True
        except ValueError:
            unpatched = False
        results[case.id] = dict(tokens=out.tokens, logits=out.last_logits, kv_bytes=out.kv_bytes,
                                unplaced_bytes=unplaced.bytes, partners=runtime.placement.size,
                                records=runtime.exchange.records, unpatched=unpatched,
                                shard_only=shard_only, params=sum(p.numel() for p in
                                                                  model.parameters()))
    return results


@pytest.fixture(scope="module")
def ranks():
    """world size -> each rank's results for the cases of that size (spawned once per size)."""
    return ranks_by_world(_run_cases, CASES)


@pytest.fixture(scope="module")
def references():
    """The unpatched single-process model's tokens and logits, per (family, overrides)."""
    memo = {}

    def reference(case: Case):
        key = (case.family, tuple(sorted(case.overrides.items())))
        if key not in memo:
            memo[key] = hf_greedy(tiny_model(case.family, **case.overrides))
        return memo[key]
    return reference


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_rank_generates_the_unpatched_tokens(ranks, references, case):
    per_rank = ranks(case.world)
    ref_tokens, ref_logits = references(case)
    for rank, results in enumerate(per_rank):
        got = results[case.id]
        assert got["partners"] == case.partners, f"rank {rank}"
        assert got["tokens"] == ref_tokens, f"rank {rank}"
        torch.testing.assert_close(got["logits"], ref_logits, **TOL,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kv_bytes_per_rank_are_one_over_p(ranks, case):
    per_rank = ranks(case.world)
    for rank, results in enumerate(per_rank):
        got = results[case.id]
        assert got["kv_bytes"] * case.partners == got["unplaced_bytes"], f"rank {rank}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ranks_issue_identical_collectives(ranks, case):
    per_rank = ranks(case.world)
    records = [results[case.id]["records"] for results in per_rank]
    assert (len(records[0]) > 0) == (case.partners > 1)
    assert all(r == records[0] for r in records[1:])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_unpatch_refuses_a_sharded_model(ranks, case):
    """TP sharding is one-way; an SP-only model (tp = 1) unpatches."""
    assert all(results[case.id]["unpatched"] == (case.tp == 1) for results in ranks(case.world))


@pytest.mark.parametrize("case", [c for c in CASES if c.tp > 1], ids=lambda c: c.id)
def test_tp_ranks_hold_only_their_shards(ranks, case):
    """Sharding frees the rest: every parameter's storage is its own size, and the model is
    smaller than the unsharded one."""
    full = sum(p.numel() for p in tiny_model(case.family, **case.overrides).parameters())
    for rank, results in enumerate(ranks(case.world)):
        got = results[case.id]
        assert got["shard_only"], f"rank {rank}: a parameter is a view of a larger tensor"
        assert got["params"] < full, f"rank {rank}"
