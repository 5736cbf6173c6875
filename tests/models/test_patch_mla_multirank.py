"""MLA families on 4 gloo ranks: a patched, TP-sharded, context-parallel model generates the
unpatched single-process model's greedy tokens.

Cases (one spawn of 4 ranks for the module; every rank runs every case in order):
    TP mode, P = 2: mesh sp=2 x tp=2, partners the 2 TP ranks (the one latent head is shared by all
        TP ranks); the two SP groups run the same thing side by side.
    SP mode, P = 2: mesh sp=2 x tp=2, partners the 2 SP ranks, heads sharded over TP = 2.
    TP mode, P = 4: mesh sp=1 x tp=4, one query head per rank.
"""

from __future__ import annotations

import pytest
import torch
from driver import greedy, hf_greedy
from mla_models import LOGIT_TOL, prompts_for, tiny_config, tiny_model
from multirank import run_ranks

from torch_cp.hf.patch import patch_model
from torch_cp.mesh import init_mesh

WORLD = 4
PAGE_SIZE = 4
MAX_NEW = 5
FAMILIES = {"glm": ("glm4_moe_lite", dict()),
            "ds": ("deepseek_v3", dict(q_lora=False, yarn=True, bias=True))}
# name -> (family key, sp, tp, mode, P)
CASES = {
    "glm-tp2": ("glm", 2, 2, "tp", 2),
    "glm-sp2": ("glm", 2, 2, "sp", 2),
    "glm-tp4": ("glm", 1, 4, "tp", 4),
    "ds-tp2": ("ds", 2, 2, "tp", 2),
    "ds-sp2": ("ds", 2, 2, "sp", 2),
    "ds-tp4": ("ds", 1, 4, "tp", 4),
}
LENGTHS = (5, 11, 3, 1)  # a one-token prompt: shorter than P, empty stripes on most partners


def _config(key: str):
    family, kw = FAMILIES[key]
    return tiny_config(family, **kw)


def _run_cases(rank: int, world: int) -> dict:
    """Every case on this rank: tokens, last logits, pool bytes, placement, collectives."""
    out = {}
    for name, (key, sp, tp, mode, _) in CASES.items():
        config = _config(key)
        mesh = init_mesh(tp=tp, sp=sp, device_type="cpu")
        model = patch_model(tiny_model(config), context_parallel=True, mesh=mesh, mode=mode,
                            page_size=PAGE_SIZE)
        runtime = model.torch_cp
        runtime.exchange.records = []
        result = greedy(model, prompts_for(config, LENGTHS), MAX_NEW)
        out[name] = dict(tokens=result.tokens, logits=result.last_logits, kv_bytes=result.kv_bytes,
                         placement=(runtime.placement.size, runtime.placement.rank,
                                    runtime.placement.mode),
                         records=list(runtime.exchange.records),
                         q_heads=runtime.geometry.q_heads,
                         context_q_heads=runtime.geometry.context_q_heads)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(WORLD, _run_cases)


@pytest.fixture(scope="module")
def references() -> dict:
    """The unpatched single-process model's tokens and last logits, per family."""
    refs = {}
    for key in FAMILIES:
        config = _config(key)
        refs[key] = hf_greedy(tiny_model(config), prompts_for(config, LENGTHS), MAX_NEW)
    return refs


def _single_rank_pool_bytes(config) -> int:
    """Bytes of the P = 1 latent pool the driver would allocate for these prompts."""
    pages = sum(-(-(n + MAX_NEW) // PAGE_SIZE) for n in LENGTHS)
    per_slot = (config.kv_lora_rank + config.qk_rope_head_dim) * 4  # fp32
    return config.num_hidden_layers * (pages + 1) * PAGE_SIZE * per_slot


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logits_match_unpatched(name, ranks, references):
    key, sp, tp, mode, size = CASES[name]
    want_tokens, want_logits = references[key]
    for rank, result in enumerate(ranks):
        got = result[name]
        partner = rank % tp if mode == "tp" else rank // tp
        assert got["placement"] == (size, partner, mode)
        assert got["tokens"] == want_tokens, f"rank {rank}"
        torch.testing.assert_close(got["logits"], want_logits, **LOGIT_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_geometry_and_pool_share(name, ranks):
    """Each rank holds 1/P of the latent pool; TP mode's context kernel sees all P partners'
    query heads."""
    key, sp, tp, mode, size = CASES[name]
    config = _config(key)
    heads = config.num_attention_heads // tp
    for result in ranks:
        got = result[name]
        assert got["kv_bytes"] * size == _single_rank_pool_bytes(config)
        assert got["q_heads"] == heads
        assert got["context_q_heads"] == (heads * size if mode == "tp" else heads)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_partners_issue_the_same_collectives(name, ranks):
    records = [result[name]["records"] for result in ranks]
    assert records[0], "a context-parallel run exchanges partials"
    assert all(r == records[0] for r in records[1:])
