"""torch.compile(fullgraph=True) of a patched model, whole or layer by layer (what
``Engine(compile=True)`` captures): the backend kernels are custom ops, the exchange is
functional collectives, so a step traces without breaks; compiled logits equal eager logits
within fp32 reassociation (1e-4 on O(1-10) logits; observed ~2e-6)."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from mla_models import tiny_config as tiny_mla_config
from mla_models import tiny_model as tiny_mla_model
from multirank import run_ranks
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import torch_cp
from torch_cp.engine.scheduler import Row
from torch_cp.engine.steps import StepLauncher
from torch_cp.graphs import compiled_layers
from torch_cp.plan import build_step_plan

pytestmark = pytest.mark.slow  # compiles with Inductor

PAGE = 8
TOL = dict(atol=1e-4, rtol=1e-4)


def _step(model, cache, forward, tokens, q_lens, ctx_lens, tables):
    plan = build_step_plan(q_lens, ctx_lens, tables, page_size=PAGE,
                           sink_page=cache.pool.sink_page, placement=model.torch_cp.placement)
    cache.begin_step(plan)
    ends = plan.qo_indptr_host[1:].long() - 1
    with torch.inference_mode():
        out = forward(input_ids=torch.tensor([tokens]), position_ids=plan.positions[None],
                      use_cache=False, logits_to_keep=ends, cache=cache)
    return out.logits[0]


def eager_and_compiled(model):
    """Logits of a prefill step and a decode step, eager and compiled, each on its own pool."""
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (13,), generator=g).tolist()
    steps = [(prompt, [6, 7], [0, 0], [[0], [1]]), ([5, 9], [1, 1], [6, 7], [[0], [1]])]
    results = []
    for forward in (model.forward, compiled):
        cache = torch_cp.PagedKVCache.for_model(model, num_pages=4, page_size=PAGE)
        results.append([_step(model, cache, forward, *s) for s in steps])
    return results


def _on_rank(rank: int, world: int):
    mesh = torch_cp.init_mesh(tp=world, device_type="cpu")
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), context_parallel=True, mesh=mesh,
                                 page_size=PAGE)
    return eager_and_compiled(model)


def test_compiled_placed_model_equals_eager_over_two_partners():
    for rank, (eager, compiled) in enumerate(run_ranks(2, _on_rank)):
        for e, c in zip(eager, compiled):
            torch.testing.assert_close(c, e, **TOL, msg=lambda m, r=rank: f"rank {r}: {m}")


def _largest_buffer(code: str) -> int:
    """Elements of the largest buffer that Inductor's generated code allocates."""
    shapes = re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code)
    return max(math.prod(int(d) for d in s.split(",") if d.strip()) for s in shapes)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_compiled_step_writes_the_pool_in_place(family):
    """A whole model compiled at P = 1 (``fullgraph=True``): a prefill's and a decode step's
    logits equal eager; the pool is written in place: no buffer of a pool layer's size in the
    compiled step (traced as plain indexing, functionalization rebuilt each layer and the whole
    pool every layer); and a Qwen3 decode step runs four weight GEMMs a layer, the fused ones
    included."""
    model = (torch_cp.tiny_qwen3() if family == "qwen3"
             else tiny_mla_model(tiny_mla_config(family)))
    torch_cp.patch_model(model, page_size=PAGE)
    torch._dynamo.reset()
    cache = torch_cp.PagedKVCache.for_model(model, num_pages=400, page_size=PAGE)
    compiled = torch.compile(model.forward, fullgraph=True)
    prefill = ([1, 2, 3], [3], [0], [[0]])
    got = _step(model, cache, compiled, *prefill)
    torch.testing.assert_close(got, _step(model, cache, model.forward, *prefill), **TOL)
    eager = _step(model, cache, model.forward, [5], [1], [3], [[0]])
    out, code = run_and_get_code(_step, model, cache, compiled, [5], [1], [3], [[0]])
    torch.testing.assert_close(out, eager, **TOL)  # the compiled write landed where eager's did
    layer = min(t[0].numel() for t in cache.pool.tensors)
    assert _largest_buffer("\n".join(code)) < layer
    if family == "qwen3":  # q/k/v and gate/up each one GEMM (fused_linear.py): 4 a layer
        gemms = len(re.findall(r"extern_kernels\.mm\(", "\n".join(code)))
        assert gemms == 4 * model.config.num_hidden_layers + 1, gemms  # + the LM head


LAYERS = 12


def _step_script(model, cache) -> list[torch.Tensor]:
    """What a capture runs: a 4-row prefill, then decode steps of 4, 2 and 1 rows."""
    tables = [[2 * r, 2 * r + 1] for r in range(4)]
    outs = [_step(model, cache, model, list(range(3, 3 + 4 * 5)), [5] * 4, [0] * 4, tables)]
    for rows in (4, 2, 1):
        outs.append(_step(model, cache, model, [7] * rows, [1] * rows, [5] * rows, tables[:rows]))
    return outs


def _deep_model(family: str, seed: int = 0):
    if family == "qwen3":
        model = torch_cp.tiny_qwen3(num_hidden_layers=LAYERS, seed=seed)
    else:
        config = tiny_mla_config(family)
        config.num_hidden_layers = LAYERS
        model = tiny_mla_model(config, seed=seed)
    return torch_cp.patch_model(model, page_size=PAGE)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_compiled_layers_share_their_graphs(family):
    """Regional compilation (``Engine(compile=True)``) of a 12-layer model: the logits equal
    eager; the graphs do not grow with the layers (for each kind of layer, DeepSeek's dense and
    MoE layers differ: the first layer's static shapes, the symbolic layer index, dynamic
    shapes, and one row specialised), so there is no graph per layer; the pool is written in
    place; after the block the model runs eagerly again."""
    model = _deep_model(family)
    torch._dynamo.reset()
    counters.clear()
    new_cache = functools.partial(torch_cp.PagedKVCache.for_model, model, num_pages=400,
                                  page_size=PAGE)
    eager = _step_script(model, new_cache())
    assert counters["stats"]["unique_graphs"] == 0
    with compiled_layers(model):
        compiled, code = run_and_get_code(_step_script, model, new_cache())
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, **TOL)
    kinds = 1 if family == "qwen3" else 2
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 4 * kinds < LAYERS, f"{graphs} graphs for {LAYERS} layers"
    layer = min(t[0].numel() for t in new_cache().pool.tensors)
    assert _largest_buffer("\n".join(code)) < layer
    _step_script(model, new_cache())
    assert counters["stats"]["unique_graphs"] == graphs, "eager outside the block"
    # A second model in the same process (another backend, so another handle in the ops):
    # the compiled layers serve it too, without tracing anything from the first model's backend.
    other = _deep_model(family, seed=1)
    expected = _step_script(other, torch_cp.PagedKVCache.for_model(other, 400, PAGE))
    with compiled_layers(other):
        got = _step_script(other, torch_cp.PagedKVCache.for_model(other, 400, PAGE))
    for e, c in zip(expected, got):
        torch.testing.assert_close(c, e, **TOL)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_eager_steps_run_the_compiled_layers_at_every_length(family):
    """``Engine(compile=True)`` runs the steps no bucket fits (long prefills) through the
    compiled layers too, entering ``compiled_layers`` per step: logits equal eager for steps of
    different rows and lengths, and after a step of a second length (Dynamo then compiles a
    dynamic token dimension) further lengths compile nothing new. The first two steps are of
    fresh rows, which attend their own tokens only (``plan.attends_context``); the first step
    with cached context compiles once more, its token dimension already dynamic."""
    model = _deep_model(family)
    cache = torch_cp.PagedKVCache.for_model(model, num_pages=40, page_size=PAGE)
    steps = [  # (rows, page tables): prompts, chunks after a context, a mixed step
        ([Row(0, 0, 13, True)], [[0, 1]]),
        ([Row(1, 0, 6, False), Row(2, 0, 9, True)], [[2, 3], [4, 5]]),
        ([Row(1, 6, 10, True), Row(3, 0, 21, True)], [[2, 3], [6, 7, 8]]),
        ([Row(0, 13, 1, True), Row(4, 0, 30, True), Row(5, 0, 2, True)],
         [[0, 1], [9, 10, 11, 12], [13]]),
    ]
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    tokens = [torch.randint(0, vocab, (sum(r.length for r in rows),), generator=g).tolist()
              for rows, _ in steps]

    def run(compile: bool) -> tuple[list[torch.Tensor], list[int]]:
        """Logits of every step, and the graphs compiled so far after each."""
        launcher = StepLauncher(model, cache, compile=compile)
        outs, graphs = [], []
        for (rows, tables), ids in zip(steps, tokens):
            step = launcher.plan(rows, [torch.tensor(t) for t in tables])
            outs.append(launcher.launch(step, ids, list(range(len(rows)))))
            graphs.append(counters["stats"]["unique_graphs"])
        return outs, graphs

    eager, _ = run(compile=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, graphs = run(compile=True)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, **TOL)
    assert graphs[0] >= 1, "the first step ran the compiled layers"
    # At most one more graph per kind of layer (those the first step compiled).
    assert graphs[2] - graphs[1] <= graphs[0] and graphs[3] == graphs[2], \
        f"a length after the second compiled again: {graphs}"
    _, after = run(compile=False)
    assert after == [graphs[-1]] * 4, "eager when compile is off"


def test_compiled_layers_leave_each_layer_as_they_found_it():
    """Eager layers are eager again after the block, and a layer the user compiled keeps its
    own compiled call (entering makes torch.compile wrappers only; nothing compiles)."""
    from torch_cp.layers import decoder_layers
    from torch_cp.tiny import tiny_qwen3

    model = tiny_qwen3()
    layers = decoder_layers(model)
    users = torch.compile(layers[0]._call_impl)
    layers[0]._compiled_call_impl = users
    with compiled_layers(model):
        assert all(layer._compiled_call_impl not in (None, users) for layer in layers)
    assert layers[0]._compiled_call_impl is users
    assert all(layer._compiled_call_impl is None for layer in layers[1:])
