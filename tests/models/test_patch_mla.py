"""MLA families (models/mla.py): absorbed attention over the placed latent pool equals the Hugging
Face module's own decompressed attention, for prefill, extend and decode steps; a patched model
generates the unpatched model's greedy tokens (tests/models/test_generate_mla.py).

The attention-level harness builds the pool, plan and backend by hand from the core, apart from
patch_model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from mla_models import VARIANTS, tiny_config, tiny_model, variant_id

from torch_cp.attention import ContextParallelAttention, Exchange, TorchBackend
from torch_cp.fused_linear import fuse_in_projections
from torch_cp.hf.cache import PagedKVCache
from torch_cp.hf.forward import patched_forward
from torch_cp.kv import MLAPool, PageAllocator
from torch_cp.mesh import kv_head_replicas
from torch_cp.models.mla import FAMILY
from torch_cp.placement import ContextParallel
from torch_cp.plan import build_step_plan
from torch_cp.runtime import ModelRuntime

PAGE_SIZE = 4
NUM_PAGES = 32
# fp32 on both paths; only the order of the sums differs (absorbing W_UK before the dot product,
# W_UV after the softmax). Outputs are O(1) and each goes through three chained contractions of
# <= 64 terms, so the difference is a few fp32 ulps times sqrt(terms): 2e-5 covers it with margin.
TOL = dict(atol=2e-5, rtol=2e-5)

# Rows: new tokens per step. Step 0 prefills, step 1 extends (mixed q lengths, not a decode step),
# steps 2-3 decode. Lengths cross page boundaries and are not multiples of PAGE_SIZE.
SCHEDULE = [[5, 1, 9], [3, 2, 1], [1, 1, 1], [1, 1, 1]]


def reference_attention(model, layer: int, x_ld: torch.Tensor) -> torch.Tensor:
    """The Hugging Face module on one row's whole sequence, causal, no cache: [L, hidden]."""
    length = x_ld.shape[0]
    cos, sin = model.model.rotary_emb(x_ld[None], torch.arange(length)[None])
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    out, _ = model.model.layers[layer].self_attn(x_ld[None], (cos, sin), mask)
    return out[0]


class Harness:
    """A placed latent pool, allocator, backend and one ContextParallelAttention per layer,
    attached to the given attention modules as ``cp_attention``, their input projections fused
    (what patch_model will do)."""

    def __init__(self, model, attns, config, tp: int = 1, placement: ContextParallel | None = None,
                 dtype: torch.dtype = torch.float32):
        self.model, self.attns = model, attns
        self.placement = placement or ContextParallel.single()
        self.geometry = FAMILY.geometry(config, tp, self.placement)
        backend = TorchBackend(self.geometry)
        exchange = Exchange(self.placement)
        for attn in attns:
            fuse_in_projections(attn)
            attn.cp_attention = ContextParallelAttention(attn.layer_idx, backend, exchange)
        runtime = ModelRuntime(self.placement, exchange, backend, self.geometry, len(attns),
                               dtype, torch.device("cpu"), PAGE_SIZE)
        self.pool = runtime.new_pool(NUM_PAGES, PAGE_SIZE)
        assert isinstance(self.pool, MLAPool)
        self.cache = PagedKVCache(runtime, self.pool)
        self.allocator = PageAllocator(NUM_PAGES, PAGE_SIZE)

    def step(self, rows: list[torch.Tensor], q_lens: list[int], ctx_lens: list[int],
             padded: bool = False) -> list[list[torch.Tensor]]:
        """Run every layer on the new tokens of each row (rows[b]: [ctx + q, hidden]).

        packed: input [1, N, hidden]; padded: left-padded [B, max q, hidden] read through
        ``plan.token_index``. Returns per layer the new tokens' outputs of each row, [q, hidden].
        """
        for b, (q, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            assert self.allocator.reserve(b, q + c)
        tables = [self.allocator.table(b) for b in range(len(q_lens))]
        positions = [torch.arange(c, c + q) for q, c in zip(q_lens, ctx_lens, strict=True)]
        news = [x[c:c + q] for x, q, c in zip(rows, q_lens, ctx_lens, strict=True)]
        if padded:
            width = max(q_lens)
            x = news[0].new_zeros(len(rows), width, news[0].shape[-1])
            pos = torch.zeros(len(rows), width, dtype=torch.long)
            index = []
            for b, (new, p) in enumerate(zip(news, positions, strict=True)):
                x[b, width - len(new):], pos[b, width - len(new):] = new, p
                index += range(b * width + width - len(new), (b + 1) * width)
            token_index = torch.tensor(index)
        else:
            x, pos, token_index = torch.cat(news)[None], torch.cat(positions)[None], None
        plan = build_step_plan(q_lens, ctx_lens, tables, page_size=PAGE_SIZE,
                               sink_page=self.pool.sink_page, placement=self.placement,
                               token_index=token_index)
        self.cache.begin_step(plan)
        embeddings = self.model.model.rotary_emb(x, pos)
        outs = []
        for attn in self.attns:
            out, none = patched_forward(FAMILY, attn)(x, embeddings, cache=self.cache)
            assert none is None and out.shape == x.shape
            flat = out.reshape(-1, out.shape[-1])
            if token_index is not None:
                keep = torch.ones(flat.shape[0], dtype=torch.bool)
                keep[token_index] = False
                assert torch.all(flat[keep] == 0)  # padding positions get no attention output
                flat = flat[token_index]
            outs.append(list(flat.split(q_lens)))
        return outs


def run_schedule(harness: Harness, rows, schedule=SCHEDULE, padded_steps=()):
    """Outputs [layer][row] of the new tokens of every step, concatenated over steps."""
    ctx = [0] * len(rows)
    got = [[[] for _ in rows] for _ in harness.attns]
    for i, q_lens in enumerate(schedule):
        outs = harness.step(rows, q_lens, ctx, padded=i in padded_steps)
        for layer, per_row in enumerate(outs):
            for b, o in enumerate(per_row):
                got[layer][b].append(o)
        ctx = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    return [[torch.cat(o) for o in layer] for layer in got]


def make_rows(config, schedule=SCHEDULE, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    totals = [sum(step[b] for step in schedule) for b in range(len(schedule[0]))]
    return [torch.randn(n, config.hidden_size, generator=gen) for n in totals]


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_absorbed_attention_equals_hf_attention(variant):
    """Prefill, extend (padded input through token_index) and decode over the placed latent pool
    give the HF module's attention output for every layer and row."""
    family, kw = variant
    config = tiny_config(family, **kw)
    model = tiny_model(config)
    attns = [layer.self_attn for layer in model.model.layers]
    rows = make_rows(config)
    with torch.no_grad():
        got = run_schedule(Harness(model, attns, config), rows, padded_steps=(1,))
        for layer in range(len(attns)):
            for b, x in enumerate(rows):
                torch.testing.assert_close(got[layer][b], reference_attention(model, layer, x),
                                           **TOL)


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]], ids=variant_id)
def test_absorbed_attention_in_bf16(variant):
    """bf16 weights, inputs and pool: the absorbed path is as close to the fp32 HF attention as
    HF's own bf16 module is. Outputs are < 4 in magnitude, where a bf16 ulp is 2^-6; both paths
    were measured at ~1.6 ulps (2.6e-2), so the bound is 1.25x HF's own error plus 2e-3."""
    family, kw = variant
    config = tiny_config(family, **kw)
    model = tiny_model(config)
    low = copy.deepcopy(model).to(torch.bfloat16)
    rows = make_rows(config)
    with torch.no_grad():
        harness = Harness(low, [layer.self_attn for layer in low.model.layers], config,
                          dtype=torch.bfloat16)
        got = run_schedule(harness, [x.bfloat16() for x in rows], padded_steps=(1,))
        for layer in range(config.num_hidden_layers):
            for b, x in enumerate(rows):
                want = reference_attention(model, layer, x)
                own = (reference_attention(low, layer, x.bfloat16()).float() - want).abs().max()
                err = (got[layer][b].float() - want).abs().max()
                assert got[layer][b].dtype == torch.bfloat16
                assert err <= 1.25 * own + 2e-3, (layer, b, float(err), float(own))


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]], ids=variant_id)
def test_sharded_heads_sum_to_unsharded(variant):
    """shard_attention over tp = 2: the ranks' o_proj partial products sum (plus the whole bias,
    once: what RowParallel does after its all-reduce) to the HF module's output; the latent
    projections stay whole."""
    family, kw = variant
    config = tiny_config(family, **kw)
    model = tiny_model(config)
    rows = make_rows(config)
    tp = 2
    layout = kv_head_replicas(FAMILY.kv_heads(config), tp)
    parts = []
    with torch.no_grad():
        for rank in range(tp):
            shard = copy.deepcopy(model)
            attns = [layer.self_attn for layer in shard.model.layers]
            for attn in attns:
                FAMILY.shard_attention(attn, rank, tp, layout)
                assert attn.kv_b_proj.weight.shape[0] == 2 * (16 + 16)  # 2 heads x (nope + v)
                assert attn.kv_a_proj_with_mqa.weight.shape[0] == 32 + 16
                assert attn.o_proj.weight.shape == (64, 2 * 16)
                attn.o_proj.bias = None  # the reducer adds it once
            parts.append(run_schedule(Harness(shard, attns, config, tp=tp), rows))
        for layer in range(config.num_hidden_layers):
            for b, x in enumerate(rows):
                total = parts[0][layer][b] + parts[1][layer][b]
                bias = model.model.layers[layer].self_attn.o_proj.bias
                total = total if bias is None else total + bias
                torch.testing.assert_close(total, reference_attention(model, layer, x), **TOL)


@pytest.mark.parametrize("family", ["glm4_moe_lite", "deepseek_v3"])
@pytest.mark.parametrize("yarn", [False, True])
def test_geometry(family, yarn):
    config = tiny_config(family, yarn=yarn, heads=8)
    model = tiny_model(config)
    scaling = model.model.layers[0].self_attn.scaling
    g = FAMILY.geometry(config, 2, ContextParallel.single())
    assert (g.kind, g.q_heads, g.kv_heads, g.head_dim, g.head_dim_v, g.rope_dim) == (
        "mla", 4, 1, 48, 32, 16)
    assert g.scale == scaling and g.context_q_heads == 4
    if yarn:
        assert scaling != (16 + 16) ** -0.5  # mscale applied
    # TP mode: the context kernel sees every partner's heads. The group is never used here.
    tp_mode = ContextParallel(2, 1, "tp", group=object())
    assert FAMILY.geometry(config, 2, tp_mode).context_q_heads == 8
    sp_mode = ContextParallel(2, 1, "sp", group=object())
    assert FAMILY.geometry(config, 2, sp_mode).context_q_heads == 4
    assert FAMILY.kv_heads(config) == 1
    assert FAMILY.kind == "mla" and config.model_type in FAMILY.model_types
    assert type(model.model.layers[0].self_attn).__name__ in FAMILY.attention_classes


def test_problems_name_every_problem():
    config = tiny_config("deepseek_v3", heads=4)
    assert FAMILY.problems(config, 1) == [] and FAMILY.problems(config, 4) == []
    config.qk_rope_head_dim = 15
    config.kv_lora_rank = 0
    problems = FAMILY.problems(config, 3)
    assert len(problems) == 3, problems
    joined = " ".join(problems)
    assert "tp = 3" in joined and "kv_lora_rank" in joined and "even" in joined
    other = copy.copy(config)
    other.model_type = "qwen3"
    assert any("qwen3" in p for p in FAMILY.problems(other, 1))


def test_forward_without_paged_cache_is_a_clear_error():
    config = tiny_config("glm4_moe_lite")
    attn = tiny_model(config).model.layers[0].self_attn
    x = torch.zeros(1, 2, config.hidden_size)
    with pytest.raises(TypeError, match="PagedKVCache"):
        patched_forward(FAMILY, attn)(x, (x, x), None)
