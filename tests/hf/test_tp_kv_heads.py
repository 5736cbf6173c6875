"""TP ranks that hold several KV heads (tp < kv_heads, as Qwen3-8B's 8 KV heads at tp = 2 or 4):
every rank generates the unpatched Hugging Face model's greedy tokens with close last-step logits,
holds exactly the q/k/v rows of its own heads (biases with them) and o_proj's columns of its
query heads (o_proj's bias whole), and its pool holds only its KV heads.

test_patch_multirank's TP cases give each rank one KV head (tp >= kv_heads), where slicing one
head's columns and slicing the rank's range of heads coincide; here every rank holds 2 or 4 KV
heads with 2 query heads per KV head, so a rank that keeps the wrong KV heads, or maps its query
heads to the wrong ones, changes the logits by O(1). TP-mode context parallelism needs
tp > kv_heads, so the TP cases run without it; one SP-mode case puts context parallelism on top
(sp = 2 x tp = 2 over 8 KV heads). Biases are random (``tiny_model``), so q/k/v biases sharded
with the wrong heads or o_proj's bias added on every rank shows too.

Ranks are spawned once per world size (2 and 4) and run every case of that size.
Tolerance: fp32, ``TOL`` (atol = rtol = 1e-4) as in test_patch_multirank. The sharded model runs
the same projections on fewer heads and sums o_proj / down_proj partials with one all-reduce, so
it differs from the single-process model only by float32 reassociation: observed <= 3e-6 on
last logits of magnitude < 5. The smallest top-2 logit gap along these models' greedy paths
(random biases and norm weights) is 8e-4 (qwen3_moe; the others 5e-3 .. 7e-2; glm4_moe takes
seed 1, whose seed 0 had a gap of 2e-4), so the tokens are a real check, and keeping one
KV head's columns instead of the rank's range moved the logits by ~5 (4.9 .. 6.0 when planted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from driver import NEW_TOKENS, PROMPTS, TOL, greedy, hf_greedy, tiny_model
from multirank import ranks_by_world

import torch_cp
from torch_cp.kv import GQAPool
from torch_cp.mesh import init_mesh
from torch_cp.placement import ContextParallel

pytestmark = pytest.mark.slow  # spawns gloo ranks

PAGE_SIZE = 8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def heads(q: int, kv: int, **extra) -> dict:
    return dict(num_attention_heads=q, num_key_value_heads=kv, **extra)


@dataclass(frozen=True)
class Case:
    family: str
    sp: int
    tp: int
    overrides: dict = field(default_factory=dict)
    context_parallel: bool = False  # SP mode when True (TP mode needs tp > kv_heads)
    partners: int = 1
    seed: int = 0  # of tiny_model's weights

    @property
    def world(self) -> int:
        return self.sp * self.tp

    @property
    def q_heads(self) -> int:
        return self.overrides["num_attention_heads"]

    @property
    def kv_heads(self) -> int:
        return self.overrides["num_key_value_heads"]

    @property
    def id(self) -> str:
        bias = "-bias" if self.overrides.get("attention_bias") else ""
        cp = f"sp-mode-P{self.partners}" if self.context_parallel else "no-cp"
        return (f"{self.family}{bias}-sp{self.sp}xtp{self.tp}-q{self.q_heads}kv{self.kv_heads}"
                f"-{cp}")


CASES = [
    # tp = 2: 4 or 2 KV heads per rank.
    Case("qwen3", 1, 2, heads(16, 8, attention_bias=True)),  # q/k/v and o_proj biases, qk-norm
    Case("qwen2", 1, 2, heads(8, 4)),                         # q/k/v biases
    Case("glm", 1, 2, heads(8, 4)),           # q/k/v biases, interleaved partial RoPE, gate_up
    Case("glm4_moe", 1, 2, heads(16, 8, attention_bias=True), seed=1),  # MoE, qk-norm, q/k/v biases
    # tp = 4 over 8 KV heads: 2 per rank.
    Case("qwen3", 1, 4, heads(16, 8, attention_bias=True)),
    Case("qwen2", 1, 4, heads(16, 8)),
    Case("glm4", 1, 4, heads(16, 8)),
    # SP-mode context parallelism over TP ranks holding 4 KV heads each.
    Case("qwen3_moe", 2, 2, heads(16, 8, attention_bias=True), context_parallel=True,
         partners=2),
]


def _attention_params(model) -> list[dict[str, torch.Tensor]]:
    """Per layer: ``<proj>.weight`` / ``<proj>.bias`` of the attention projections."""
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        params = {}
        for proj in PROJECTIONS:
            for kind in ("weight", "bias"):
                p = getattr(getattr(attn, proj), kind, None)
                if p is not None:
                    params[f"{proj}.{kind}"] = p.detach().clone()
        layers.append(params)
    return layers


def _run_cases(rank: int, world: int, cases: list[Case]) -> dict:
    results = {}
    for case in cases:
        mesh = init_mesh(tp=case.tp, sp=case.sp, device_type="cpu")
        model = torch_cp.patch_model(tiny_model(case.family, case.seed, **case.overrides),
                                     context_parallel=case.context_parallel, mesh=mesh,
                                     mode="sp" if case.context_parallel else "tp",
                                     page_size=PAGE_SIZE)
        runtime = model.torch_cp
        out = greedy(model, PROMPTS, NEW_TOKENS)
        g = runtime.geometry
        # One rank holding every KV head and every token of the same pages.
        whole = GQAPool(runtime.num_layers, out.num_pages, PAGE_SIZE, case.kv_heads, g.head_dim,
                        ContextParallel.single(), runtime.dtype)
        results[case.id] = dict(
            tokens=out.tokens, logits=out.last_logits, kv_bytes=out.kv_bytes,
            whole_bytes=whole.bytes, partners=runtime.placement.size, q_heads=g.q_heads,
            kv_heads=g.kv_heads, tp_rank=mesh["tp"].get_local_rank(),
            attention=_attention_params(model))
    return results


@pytest.fixture(scope="module")
def ranks():
    """world size -> each rank's results for the cases of that size (spawned once per size)."""
    return ranks_by_world(_run_cases, CASES)


@pytest.fixture(scope="module")
def unpatched():
    """(family, overrides) -> (the unpatched model, its greedy tokens and last logits)."""
    memo = {}

    def reference(case: Case):
        key = (case.family, tuple(sorted(case.overrides.items())))
        if key not in memo:
            model = tiny_model(case.family, case.seed, **case.overrides)
            memo[key] = (model, *hf_greedy(model))
        return memo[key]
    return reference


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_rank_generates_the_unpatched_tokens(ranks, unpatched, case):
    _, ref_tokens, ref_logits = unpatched(case)
    for rank, results in enumerate(ranks(case.world)):
        got = results[case.id]
        assert got["partners"] == case.partners, f"rank {rank}"
        assert got["tokens"] == ref_tokens, f"rank {rank}"
        torch.testing.assert_close(got["logits"], ref_logits, **TOL,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_rank_holds_the_projections_of_its_own_heads(ranks, unpatched, case):
    """TP rank r holds query heads [r q/tp, (r+1) q/tp) and KV heads [r kv/tp, (r+1) kv/tp):
    those rows of q_proj / k_proj / v_proj (weight and bias), o_proj's input columns of its query
    heads, and o_proj's whole bias (added once, after the all-reduce)."""
    model = unpatched(case)[0]
    q_per, kv_per = case.q_heads // case.tp, case.kv_heads // case.tp
    for rank, results in enumerate(ranks(case.world)):
        got = results[case.id]
        r = got["tp_rank"]
        assert (got["q_heads"], got["kv_heads"]) == (q_per, kv_per), f"rank {rank}"
        for layer, shards in zip(model.model.layers, got["attention"], strict=True):
            attn = layer.self_attn
            d = attn.head_dim
            q_rows = slice(r * q_per * d, (r + 1) * q_per * d)
            kv_rows = slice(r * kv_per * d, (r + 1) * kv_per * d)
            want = {"q_proj.weight": attn.q_proj.weight[q_rows],
                    "k_proj.weight": attn.k_proj.weight[kv_rows],
                    "v_proj.weight": attn.v_proj.weight[kv_rows],
                    "o_proj.weight": attn.o_proj.weight[:, q_rows]}
            for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                if getattr(attn, proj).bias is not None:
                    want[f"{proj}.bias"] = getattr(attn, proj).bias[rows]
            if attn.o_proj.bias is not None:
                want["o_proj.bias"] = attn.o_proj.bias
            assert shards.keys() == want.keys(), f"rank {rank}"
            for name, tensor in want.items():
                assert torch.equal(shards[name], tensor.detach()), f"rank {rank}: {name}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pool_holds_only_the_ranks_kv_heads(ranks, case):
    """kv_heads / tp heads per rank (and 1/P of the tokens with context parallelism)."""
    for rank, results in enumerate(ranks(case.world)):
        got = results[case.id]
        assert got["kv_bytes"] * case.tp * case.partners == got["whole_bytes"], f"rank {rank}"
