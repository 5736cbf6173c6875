"""torch_cp's fused experts for decode-sized steps (graphs/fused_experts.py), registered as
transformers' experts implementation ``"torch_cp_fused"``. Without CUDA the kernels run in
Triton's interpreter (tests/conftest.py).

- fp32, every MoE family's experts: the kernels equal transformers' ``batched_mm`` (atol 1e-5 on
  outputs of ~10-20: fp32 sums over 256 channels in another order).
- bf16: against the exact (fp32) computation from the same bf16 weights and inputs, at least as
  close as ``batched_mm`` is in root mean square (it rounds its intermediates to bf16; the
  kernels keep fp32 until SiLU(gate) * up), and within 2**-7 of the largest output (one bf16
  rounding or two).
- ``grouped_experts``' kernels (each routed expert read once, up to 16 of its pairs a tile) the
  same, with experts routed more pairs than one tile holds, at sizes no tile divides, and with
  bf16 tokens to fp32 experts; tiles Triton cannot make are refused.
- ``sorted_experts`` (``grouped_mm``'s GEMMs, torch_cp's combine) the same: equal to
  ``batched_mm`` in fp32, as exact in bf16.
- The implementation takes the kernels for at most ``MAX_PAIRS`` (token, expert) pairs,
  ``grouped_experts`` for at most ``MAX_GROUPED_PAIRS``, and ``sorted_experts`` above (bit for
  bit its output); experts the kernels cannot read (a bias) always take transformers'
  ``grouped_mm`` (bit for bit).
- A patched tiny Qwen3-MoE set to ``"torch_cp_fused"`` generates the unpatched model's tokens
  through the engine, its decode steps through either kernels.
- GPU: every MoE family on it, captured and compiled, gives the reference backend's tokens up
  to bf16 near-ties, the implementation kept for the capture; qwen3_moe and glm4_moe_lite the
  same with every step through the grouped kernels.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch
from gpu_models import MOE_MODELS, NEW_TOKENS, assert_equal_but_near_ties, prompts, tokens

import torch_cp
from torch_cp.graphs.experts import capturable, experts_modules, grouped_mm_fits

pytest.importorskip("triton", reason="the kernels are Triton (CPU: its interpreter)")
from transformers.integrations import moe  # noqa: E402

from torch_cp.graphs import fused_experts as fe  # noqa: E402
from torch_cp.graphs import grouped_experts as ge  # noqa: E402
from torch_cp.graphs import sorted_experts as se  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def few_programs(monkeypatch):
    """In Triton's interpreter every program runs in Python: the engine tests take whole tiles
    (one program per pair, or per expert, and kernel), the GPU tests their own."""
    if DEVICE == "cpu":
        for name in ("GATE_UP_TILES", "DOWN_TILES"):
            monkeypatch.setattr(fe, name, fe.Tiles(rows=256, cols=256, warps=4))
            monkeypatch.setattr(ge, name, ge.GroupedTiles(pairs=16, rows=256, cols=256, warps=4))


def routed(tokens: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 256, generator=g)
    ids = torch.randint(0, 8, (tokens, 2), generator=g)
    weights = torch.rand(tokens, 2, generator=g)
    return x.to(DEVICE, dtype), ids.to(DEVICE), weights.to(DEVICE, dtype)


def experts_of(name: str, dtype):
    return experts_modules(MOE_MODELS[name](dtype).to(DEVICE))[0]


# (kernels, tokens): 40 tokens of top 2 over 8 experts give some expert 18 pairs, more than the
# grouped kernels' tile of 16.
KERNELS = [pytest.param(fe.fused_experts, 3, id="pairs"),
           pytest.param(ge.grouped_experts, 40, id="grouped"),
           pytest.param(se.sorted_experts, 40, id="sorted")]


@pytest.mark.parametrize("kernels, tokens", KERNELS)
@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_fp32_kernels_equal_batched_mm(name, kernels, tokens):
    experts = experts_of(name, torch.float32)
    assert fe.fits(experts)
    args = routed(tokens, torch.float32)
    if tokens > 16:
        assert torch.bincount(args[1].flatten()).max() > ge.GATE_UP_TILES.pairs
    torch.testing.assert_close(kernels(experts, *args),
                               moe.batched_mm_experts_forward(experts, *args),
                               atol=1e-5, rtol=1e-5)


def odd_experts(hidden: int, inter: int, dtype=torch.float32):
    """Qwen3-MoE's experts module at sizes no tile divides, random weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=4)
    experts = Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for w in (experts.gate_up_proj, experts.down_proj):
            w.copy_(torch.randn(w.shape, generator=g) / w.shape[-1] ** 0.5)
    return experts.to(DEVICE, dtype)


@pytest.mark.parametrize("hidden, inter", [(200, 40), (72, 96)])
def test_grouped_kernels_at_sizes_no_tile_divides(hidden, inter):
    """Partial channel tiles and reduction chunks; one expert routed 36 pairs (three blocks of
    16), another none."""
    experts = odd_experts(hidden, inter)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(36, hidden, generator=g)
    ids = torch.stack([torch.zeros(36, dtype=torch.long), torch.randint(1, 3, (36,), generator=g)],
                      dim=1)
    args = x.to(DEVICE), ids.to(DEVICE), torch.rand(36, 2, generator=g).to(DEVICE)
    torch.testing.assert_close(ge.grouped_experts(experts, *args),
                               moe.batched_mm_experts_forward(experts, *args),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pairs, experts, block, hot", [
    (80, 8, 16, False), (7, 32, 16, False), (200, 32, 16, False), (64, 4, 32, True)],
    ids=["some", "few", "many", "hot"])
def test_align_lays_out_each_pair_once_in_the_fewest_blocks_of_its_expert(pairs, experts, block,
                                                                         hot, monkeypatch):
    """``align``: every pair in exactly one slot, each block's pairs of its expert, padding -1,
    ``cdiv(count, block)`` blocks an expert, then the unused blocks -1 ("hot": all on one).
    Its buffers start full of a valid-looking index, as a graph's reused buffers would be."""
    ids = torch.randint(0, experts, (pairs,), generator=torch.Generator().manual_seed(pairs))
    if hot:
        ids[:] = 2
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(1))
    slots, block_experts = ge.align(ids.to(DEVICE), experts, block)
    monkeypatch.undo()
    slots, block_experts = slots.view(-1, block).cpu(), block_experts.cpu()
    counts = torch.bincount(ids, minlength=experts)
    used = (counts + block - 1) // block
    assert block_experts.tolist() == (torch.arange(experts).repeat_interleave(used).tolist()
                                      + [-1] * (len(block_experts) - int(used.sum())))
    laid = slots[block_experts >= 0]
    assert torch.equal(torch.sort(laid[laid >= 0]).values, torch.arange(pairs, dtype=torch.int32))
    expert_of_slot = block_experts[block_experts >= 0, None].expand_as(laid)
    assert torch.equal(ids[laid[laid >= 0].long()], expert_of_slot[laid >= 0].long())
    assert torch.equal((laid >= 0).sum(1), torch.minimum(  # each expert's pairs fill its blocks
        torch.full_like(laid[:, 0], block), counts.repeat_interleave(used)
        - block * (torch.arange(len(laid)) - (used.cumsum(0) - used).repeat_interleave(used))))


@pytest.mark.parametrize("kernels", [fe.fused_experts, ge.grouped_experts],
                         ids=["pairs", "grouped"])
def test_bf16_tokens_to_fp32_experts_are_as_exact_as_transformers(kernels):
    """Mixed dtypes (an fp32 model under autocast) stay fp32 up to the output, as transformers'
    grouped_mm does (SiLU(gate) * up in bf16 had twice its error, helper 44)."""
    experts = odd_experts(256, 40)
    x, ids, weights = routed(40, torch.float32)
    x = x.bfloat16()
    want = moe.batched_mm_experts_forward(experts, x.float(), ids % 4, weights)
    got = kernels(experts, x, ids % 4, weights)
    theirs = moe.grouped_mm_experts_forward(experts, x, ids % 4, weights)
    assert got.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2**-7 * want.abs().max().item(), rtol=0)
    # bf16 rounds each output once in both: at most a few outputs an ulp apart in the mean.
    assert (got.float() - want).pow(2).mean() <= 1.1 * (theirs.float() - want).pow(2).mean()


def test_grouped_tiles_refuse_what_triton_cannot_tile():
    with pytest.raises(ValueError, match=r"pairs 8 .*rows 48 .*stages 0"):
        ge.GroupedTiles(pairs=8, rows=48, cols=64, warps=4, stages=0)
    assert ge.GroupedTiles(16, 64, 64, 4).launch() == dict(num_warps=4)
    assert ge.GroupedTiles(16, 64, 64, 8, stages=2).launch() == dict(num_warps=8, num_stages=2)


@pytest.mark.parametrize("kernels, tokens", KERNELS)
def test_bf16_kernels_are_as_exact_as_batched_mm(kernels, tokens):
    experts = experts_of("qwen3_moe", torch.bfloat16)
    args = routed(tokens, torch.bfloat16, seed=1 if tokens < 16 else 0)
    if tokens > 16:
        assert torch.bincount(args[1].flatten()).max() > ge.GATE_UP_TILES.pairs
    exact_experts = experts_of("qwen3_moe", torch.bfloat16).float()  # the same bf16 weights
    exact = moe.batched_mm_experts_forward(exact_experts, *(a.float() if a.is_floating_point()
                                                           else a for a in args))
    got = kernels(experts, *args).float()
    theirs = moe.batched_mm_experts_forward(experts, *args).float()
    scale = exact.abs().max()
    # The root mean square over the outputs: the largest error of one output is a draw (run 71's
    # seed 0 at 40 tokens: 0.140 against batched_mm's 0.129, with 0.014 against 0.018 in RMS;
    # run 81's sorted path 0.159, 1.02 x 2**-7 of the scale). A wrong pair errs by the scale.
    assert (got - exact).pow(2).mean().sqrt() <= (theirs - exact).pow(2).mean().sqrt()
    assert (got - exact).abs().max() <= max(2**-7 * scale, 2 * (theirs - exact).abs().max())


def test_decode_sized_steps_take_the_kernels_and_larger_ones_sorted_experts(monkeypatch,
                                                                          few_programs):
    experts = experts_of("qwen3_moe", torch.float32)
    monkeypatch.setattr(fe, "MAX_GROUPED_PAIRS", 2 * fe.MAX_PAIRS)  # fewer steps interpreted
    calls = []
    for module, name in ((fe, "fused_experts"), (ge, "grouped_experts"), (fe, "sorted_experts")):
        kernels = getattr(module, name)

        def counted(*args, name=name, kernels=kernels):
            calls.append(name)
            return kernels(*args)
        monkeypatch.setattr(module, name, counted)
    small = routed(fe.MAX_PAIRS // 2, torch.float32)
    fe.fused_experts_forward(experts, *small)
    assert calls == ["fused_experts"]
    middle = routed(fe.MAX_PAIRS // 2 + 1, torch.float32)
    fe.fused_experts_forward(experts, *middle)
    fe.fused_experts_forward(experts, *routed(fe.MAX_GROUPED_PAIRS // 2, torch.float32))
    assert calls == ["fused_experts"] + ["grouped_experts"] * 2
    large = routed(fe.MAX_GROUPED_PAIRS // 2 + 1, torch.float32)
    got = fe.fused_experts_forward(experts, *large)
    # Larger steps: sorted_experts where grouped_mm can be captured (the CPU), else batched_mm.
    on_grouped_mm = capturable("grouped_mm", torch.float32, torch.device(DEVICE))
    assert on_grouped_mm or DEVICE == "cuda"
    assert calls[3:] == (["sorted_experts"] if on_grouped_mm else [])
    if not on_grouped_mm:
        assert torch.equal(got, moe.batched_mm_experts_forward(experts, *large))
    experts.has_bias = True  # a layout the kernels do not read (zero biases: the same output)
    experts.gate_up_proj_bias = torch.zeros(experts.gate_up_proj.shape[:2], device=DEVICE)
    experts.down_proj_bias = torch.zeros(experts.down_proj.shape[:2], device=DEVICE)
    assert not fe.fits(experts)
    before = len(calls)
    for args in (small, middle):
        fe.fused_experts_forward(experts, *args)
    want = (moe.grouped_mm_experts_forward if on_grouped_mm
            else moe.batched_mm_experts_forward)(experts, *large)
    assert torch.equal(fe.fused_experts_forward(experts, *large), want)
    assert len(calls) == before, "experts the kernels cannot read take transformers' own"


def test_large_steps_of_experts_grouped_mm_cannot_take_run_batched_mm(monkeypatch):
    """A TP shard of 6 float32 intermediate channels (Qwen3-MoE's 12 over tp = 2, helper 106):
    rows of 24 bytes, which torch's grouped GEMM refuses ("strides should be multiple of 16
    bytes"); such a step took sorted_experts and raised."""
    experts = experts_of("qwen3_moe", torch.float32)
    inter = experts.down_proj.shape[2]
    gate_up = experts.gate_up_proj.detach()
    experts.gate_up_proj = torch.nn.Parameter(
        torch.cat([gate_up[:, :6], gate_up[:, inter:inter + 6]], dim=1))
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[..., :6].contiguous())
    monkeypatch.setattr(fe, "MAX_GROUPED_PAIRS", 2 * fe.MAX_PAIRS)  # fewer steps interpreted
    large = routed(fe.MAX_GROUPED_PAIRS // 2 + 1, torch.float32)
    assert fe.fits(experts) and not grouped_mm_fits(experts)
    assert torch.equal(fe.fused_experts_forward(experts, *large),
                       moe.batched_mm_experts_forward(experts, *large))


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU models through Triton's interpreter; on the GPU "
                    "the captured and compiled engine tests below")
@pytest.mark.parametrize("grouped", [False, True], ids=["pairs", "grouped"])
def test_engine_with_fused_experts_generates_the_unpatched_tokens(monkeypatch, grouped,
                                                                  few_programs):
    """Decode steps through either kernels (``grouped``: ``MAX_PAIRS`` 0, so every step takes
    ``grouped_experts``) give the unpatched model's tokens."""
    prompts = [[5, 9, 17, 3], [40, 2, 77, 8, 19, 23, 1]]
    reference = MOE_MODELS["qwen3_moe"](torch.float32)
    want = [reference.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    model = torch_cp.patch_model(MOE_MODELS["qwen3_moe"](torch.float32))
    model.set_experts_implementation(fe.NAME)
    if grouped:
        monkeypatch.setattr(fe, "MAX_PAIRS", 0)
    module, name = (ge, "grouped_experts") if grouped else (fe, "fused_experts")
    calls = []
    kernels = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(a[1].shape[0]) or kernels(*a))
    engine = torch_cp.Engine(model, num_pages=16, page_size=4, max_rows=2)
    assert [list(r.token_ids) for r in engine.run(prompts, 4)] == want
    assert calls and min(calls) <= len(prompts), "decode steps took the kernels"
    if not grouped:
        assert max(calls) * 2 <= fe.MAX_PAIRS


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs FlashInfer")
@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_fused_experts_captured_and_compiled_give_the_reference_tokens(name):
    """bf16, FlashInfer, decode steps replayed from CUDA graphs with compiled layers, launched
    ahead: the reference backend's tokens (uncaptured, on the same experts kernels) up to bf16
    near-ties. (Against the experts loop, qwen3_moe splits at a 0.44 gap of 6.4 on its fourth
    prompt, run 54: the kernels' rounding differs from the loop's, as grouped_mm's over two GPUs
    did at the same token in run 38; their exactness is the tests above.)"""
    ran = captured_and_compiled_give_the_reference_tokens(name)
    assert min(ran["_gate_up"], ran["_down"]) >= 1, "each replayed layer ran the kernels"


def captured_and_compiled_give_the_reference_tokens(name: str) -> Counter:
    """Asserts the engine's tokens; returns, of a second run (profiled once the graphs are
    captured), how many times each kernel ran over how many replayed steps times MoE layers
    (prefill's launches counted too: at most a few steps)."""
    reference = torch_cp.patch_model(MOE_MODELS[name](torch.bfloat16).cuda(), backend="torch")
    reference.set_experts_implementation(fe.NAME)
    expected = tokens(torch_cp.generate(reference, prompts(), NEW_TOKENS, progress=False))
    model = torch_cp.patch_model(MOE_MODELS[name](torch.bfloat16).cuda(), backend="flashinfer")
    model.set_experts_implementation(fe.NAME)
    engine = torch_cp.Engine(model, num_pages=64, page_size=16, cuda_graphs=True, compile=True,
                             overlap_planning=True, max_pages_per_row=8)
    got = tokens(engine.run(prompts(), NEW_TOKENS))
    assert model.config.get_text_config()._experts_implementation == fe.NAME, "kept for capture"
    assert engine.replayed_steps >= NEW_TOKENS - 2
    unpatched = MOE_MODELS[name](torch.bfloat16).cuda()
    unpatched.set_experts_implementation(fe.NAME)
    assert_equal_but_near_ties(unpatched, expected, got)
    replayed = engine.replayed_steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        assert tokens(engine.run(prompts(), NEW_TOKENS)) == got
    per_layer_step = (engine.replayed_steps - replayed) * len(experts_modules(model))
    assert per_layer_step >= len(experts_modules(model)) * (NEW_TOKENS - 2)
    ran = Counter(e.name for e in prof.events())
    return Counter({k: v / per_layer_step for k, v in ran.items()})


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs FlashInfer")
@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe_lite"])
def test_grouped_experts_captured_and_compiled_give_the_reference_tokens(name, monkeypatch):
    """As above with every decode step through ``grouped_experts``' kernels (``MAX_PAIRS`` 0),
    bf16 ``tl.dot`` on the tensor cores (the CPU tests multiply in float32)."""
    monkeypatch.setattr(fe, "MAX_PAIRS", 0)
    # (A Python counter inside the compiled layers recompiles them at every call, run 73.)
    ran = captured_and_compiled_give_the_reference_tokens(name)
    assert min(ran["_align"], ran["_grouped_gate_up"], ran["_grouped_down"]) >= 1, (
        "each replayed layer ran the kernels")
