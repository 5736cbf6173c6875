"""torch_cp's router kernel (graphs/fused_router.py) against transformers' own router forwards,
for every MoE family's router. Without CUDA the kernel runs in Triton's interpreter
(tests/conftest.py).

- Every family's router is recognised with its kind; a router whose forward differs is not.
- The same experts as the router's own forward, for fp32 and bf16 logits, with the score bias
  set, with groups (DeepSeek's ``n_group`` / ``topk_group``, of sizes that are and are not powers
  of two), without the normalisation and with a scaling factor: the softmax kind in descending
  order, up to equal values (which torch orders as it likes), the sigmoid kind as a set
  (transformers leaves that order unspecified). A NaN or -inf row still picks experts that
  exist.
- Weights: fp32 within 4 ulps (a softmax or sum over the same values in another order); the
  softmax kind's bf16 weights within one bf16 ulp (2**-7 relative) of its own: compiled, Triton
  rounds to nearest like torch, and fp32 values 2 ulps apart rarely round apart; Triton's
  interpreter truncates instead, so on the CPU about one weight in five is one ulp below.
- Patched on CUDA with ``KERNEL_ROUTERS`` on (here the CPU forced through the same path), a
  tiny Qwen3-MoE routes through the kernel, generates the unpatched model's tokens, and
  unpatching restores the router.
"""

from __future__ import annotations

import pytest
import torch
from gpu_models import HYBRID_MODELS, MOE_MODELS
from transformers import DeepseekV3Config

import torch_cp

pytest.importorskip("triton", reason="the kernel is Triton (CPU: its interpreter)")
from torch_cp.graphs import experts as experts_module  # noqa: E402
from torch_cp.graphs import fused_router as fr  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILIES = {**MOE_MODELS, **{k: v for k, v in HYBRID_MODELS.items() if "moe" in k or "next" in k}}
KINDS = {"qwen3_moe": "softmax", "glm4_moe": "sigmoid", "glm4_moe_lite": "sigmoid",
         "deepseek_v3": "sigmoid", "qwen3_5_moe_text": "softmax", "qwen3_next": "softmax"}


def grouped_deepseek(experts: int, groups: int, kept: int, top_k: int):
    """DeepSeek-V3's router over ``experts`` in ``groups`` groups, the best ``kept`` groups
    kept, top ``top_k``, no normalisation, scaled by 2.5."""
    from transformers import AutoModelForCausalLM

    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                              moe_intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                              v_head_dim=8, n_routed_experts=experts, num_experts_per_tok=top_k,
                              n_group=groups, topk_group=kept, norm_topk_prob=False,
                              routed_scaling_factor=2.5, first_k_dense_replace=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def router_of(model):
    routers = fr.routers(model)
    assert routers, "the model's routers are recognised"
    return routers[0]


def by_id(ids, w):
    order = ids.argsort(-1)
    return ids.gather(1, order), w.gather(1, order)


def compare(router, tokens: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) / 4)
    x = torch.randn(tokens, router.hidden_dim, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        want_logits, want_w, want_ids = router(x)
        logits, w, ids = fr.fused_forward(router)(x)
    torch.testing.assert_close(logits, want_logits, atol=0, rtol=0)
    assert w.dtype == want_w.dtype and ids.dtype == want_ids.dtype == torch.int64
    if fr.kind_of(router) == "sigmoid":  # a set (fp32 logits: no ties here)
        (ids, w), (want_ids, want_w) = by_id(ids, w), by_id(want_ids, want_w)
        assert torch.equal(ids, want_ids)
    else:
        # bf16 logits tie often, and torch orders equal values as it likes: the experts picked
        # must have the same probabilities as torch's, in descending order.
        probs = torch.softmax(want_logits.float(), dim=-1)
        mine, theirs = probs.gather(1, ids), probs.gather(1, want_ids)
        assert torch.equal(mine.sort(-1, descending=True).values,
                           theirs.sort(-1, descending=True).values)
        assert (mine[:, :-1] >= mine[:, 1:]).all()
        w, want_w = w.sort(-1, descending=True).values, want_w.sort(-1, descending=True).values
    if w.dtype == torch.float32:  # a softmax or sum over the same values in another order
        torch.testing.assert_close(w, want_w, atol=0, rtol=4 * 2**-23)
    else:
        torch.testing.assert_close(w.float(), want_w.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_familys_router_is_recognised_and_picks_its_experts(name):
    model = FAMILIES[name](torch.float32).to(DEVICE)
    router = router_of(model)
    assert fr.kind_of(router) == KINDS[name]
    assert len(fr.routers(model)) == sum(1 for m in model.modules() if hasattr(m, "experts"))
    compare(router, tokens=7, dtype=torch.float32)


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe_lite"])
def test_bf16_routers(name):
    router = router_of(FAMILIES[name](torch.bfloat16).to(DEVICE))
    compare(router, tokens=5, dtype=torch.bfloat16, seed=1)


@pytest.mark.parametrize("experts,groups,kept,top_k", [
    (16, 4, 2, 4),  # powers of two
    (12, 4, 2, 3),  # groups of 3: padded lanes beside real ones
    (96, 8, 4, 8),  # groups of 12
])
def test_groups_without_normalisation_and_scaled(experts, groups, kept, top_k):
    router = router_of(grouped_deepseek(experts, groups, kept, top_k).to(DEVICE))
    assert (router.num_group, router.topk_group, router.top_k) == (groups, kept, top_k)
    compare(router, tokens=9, dtype=torch.float32, seed=2)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's -inf - -inf
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_a_nan_row_picks_experts_that_exist_and_leaves_the_others(name):
    """NaN ranks first (as in torch.topk), so a token with NaN logits still gets real expert
    ids (and NaN weights) rather than ids past the end for the experts to read; the other
    tokens are routed as without it."""
    router = router_of(FAMILIES[name](torch.float32).to(DEVICE))
    routing = fr.routing_of(router)
    bias = router.e_score_correction_bias if routing.kind == "sigmoid" else None
    logits = torch.randn(4, router.num_experts, device=DEVICE)
    clean_w, clean_ids = fr.route(routing, logits, bias)
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    w, ids = fr.route(routing, logits, bias)
    assert ((0 <= ids) & (ids < router.num_experts)).all()
    assert torch.equal(ids[[0, 3]], clean_ids[[0, 3]])
    assert torch.equal(w[[0, 3]], clean_w[[0, 3]])


def test_qwen3_moe_without_normalisation():
    model = FAMILIES["qwen3_moe"](torch.float32).to(DEVICE)
    router = router_of(model)
    router.norm_topk_prob = False
    compare(router, tokens=3, dtype=torch.float32, seed=3)


def test_no_tokens():
    router = router_of(FAMILIES["qwen3_moe"](torch.float32).to(DEVICE))
    compare(router, tokens=0, dtype=torch.float32)


def test_a_router_whose_forward_differs_is_left_alone():
    model = FAMILIES["qwen3_moe"](torch.float32)
    router = router_of(model)

    class Other(type(router)):
        def forward(self, hidden_states):
            return super().forward(hidden_states * 2)

    router.__class__ = Other
    assert fr.kind_of(router) is None
    assert router not in fr.routers(model)


def test_a_router_with_a_forward_set_on_it_is_left_alone():
    """accelerate's offloading hooks and the ``kernels`` library set a forward on the instance:
    the kernel would skip its work."""
    model = FAMILIES["qwen3_moe"](torch.float32)
    router = router_of(model)
    router.forward = lambda hidden_states: type(router).forward(router, -hidden_states)
    assert router not in fr.routers(model)


@pytest.mark.parametrize("groups, kept, top_k", [(1, 1, 8), (4, 3, 5)])
def test_experts_scored_minus_inf_are_still_taken_once(groups, kept, top_k):
    """A bias of -inf (experts pruned) leaves only -inf to choose from at the last picks: each
    expert, and each group, is still taken at most once, as the router's own forward takes
    them."""
    router = router_of(grouped_deepseek(8, groups, kept, top_k).to(DEVICE))
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([0.0] * 4 + [float("-inf")] * 4))
    x = torch.randn(3, router.hidden_dim, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        _, own_w, own_ids = router(x)
        _, w, ids = fr.fused_forward(router)(x)
    for row in range(3):
        assert len(set(ids[row].tolist())) == top_k, ids[row]
        assert set(ids[row].tolist()) >= set(range(4))  # the four experts with finite scores
        if groups == 1:  # every expert chosen: the same set and weights
            assert set(ids[row].tolist()) == set(own_ids[row].tolist())
            got = dict(zip(ids[row].tolist(), w[row].tolist()))
            for e, weight in zip(own_ids[row].tolist(), own_w[row].tolist()):
                assert got[e] == pytest.approx(weight, rel=1e-6)


def test_patched_model_routes_through_the_kernel(monkeypatch):
    """``patch_model`` installs the kernel's forward on CUDA only; without CUDA it is made to
    take that path on the CPU (the interpreter); the tokens must not change."""
    prompts = [[5, 9, 17, 3], [40, 2, 77, 8, 19, 23, 1]]
    reference = MOE_MODELS["qwen3_moe"](torch.float32).to(DEVICE)
    want = [reference.generate(torch.tensor([p], device=DEVICE), max_new_tokens=4,
                               do_sample=False)[0, len(p):].tolist() for p in prompts]
    monkeypatch.setattr(experts_module, "KERNEL_ROUTERS", True)
    real = experts_module.kernel_routers
    monkeypatch.setattr("torch_cp.hf.patch.kernel_routers",
                        lambda model, device: real(model, torch.device("cuda")))
    calls = []
    route = fr.route
    monkeypatch.setattr(fr, "route", lambda *a: calls.append(1) or route(*a))
    model = MOE_MODELS["qwen3_moe"](torch.float32).to(DEVICE)
    router = router_of(model)
    torch_cp.patch_model(model)
    assert "forward" in router.__dict__
    engine = torch_cp.Engine(model, num_pages=16, page_size=4, max_rows=2)
    assert [list(r.token_ids) for r in engine.run(prompts, 4)] == want
    assert calls
    torch_cp.unpatch_model(model)
    assert "forward" not in router.__dict__


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe"])
def test_gradients_and_autocast_take_the_routers_own_forward(name, monkeypatch):
    """The kernel's weights carry no gradient, and autocast rounds the sigmoid router's scores
    to bf16 before its choice: with a gradient wanted or under autocast the installed forward
    gives exactly the router's own results (and the router's weight its gradient)."""
    router = router_of(FAMILIES[name](torch.float32).to(DEVICE))
    calls = []
    route = fr.route
    monkeypatch.setattr(fr, "route", lambda *a: calls.append(1) or route(*a))
    forward = fr.fused_forward(router)
    x = torch.randn(5, router.hidden_dim, device=DEVICE, requires_grad=True)
    for a, b in zip(forward(x), router(x)):
        assert torch.equal(a, b)
    # Unequal factors: a normalised router's weights sum to 1 a token, so their plain sum's
    # gradient is zero up to rounding (and the check below was left to chance).
    factors = torch.linspace(1.0, 2.0, router.top_k, device=DEVICE)
    (forward(x)[1] * factors).sum().backward()
    want = router.weight.grad.clone()
    router.weight.grad = None
    (router(x)[1] * factors).sum().backward()
    assert torch.equal(router.weight.grad, want) and want.abs().sum() > 0
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        for a, b in zip(forward(x), router(x)):
            assert torch.equal(a, b)
    assert not calls
    with torch.no_grad():
        forward(x)
    assert calls, "without either, the kernel"


class StandInKernel:
    """``_route[grid](...)`` as torch ops: Triton's interpreter cannot be traced by Dynamo."""

    def __getitem__(self, grid):
        return self.launch

    def launch(self, logits, bias, weights, ids, *args, TOP_K, **meta):
        top = logits.float().topk(TOP_K, dim=-1)
        weights.copy_(top.values)
        ids.copy_(top.indices)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_the_forward_traces_whole_up_to_the_kernel(name, monkeypatch):
    """Dynamo traces the installed forward without a break (compiled layers use fullgraph):
    what it reads of the router was read when the forward was made. Here the kernel's launch is
    a torch stand-in; the GPU test below traces the kernel itself."""
    router = router_of(FAMILIES[name](torch.float32))
    monkeypatch.setattr(fr, "_route", StandInKernel())
    forward = fr.fused_forward(router)
    x = torch.randn(3, router.hidden_dim)
    torch._dynamo.reset()
    with torch.no_grad():
        for a, b in zip(forward(x), torch.compile(forward, fullgraph=True, backend="eager")(x)):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FAMILIES))
def test_gpu_kernel_eager_and_compiled(name):
    """On the GPU (the kernel compiled, not interpreted): the router's own experts and weights
    in fp32 and bf16, and the same experts when Dynamo traces the forward (as in compiled
    layers; Inductor may run the GEMM as another kernel: values within one bf16 ulp)."""
    for dtype in (torch.float32, torch.bfloat16):
        router = router_of(FAMILIES[name](dtype).cuda())
        compare(router, tokens=33, dtype=dtype, seed=4)
        x = torch.randn(3, router.hidden_dim, device="cuda", dtype=dtype)
        forward = fr.fused_forward(router)
        with torch.no_grad():
            eager = forward(x)
            compiled = torch.compile(forward, fullgraph=True)(x)
        assert torch.equal(eager[2], compiled[2])
        for a, b in zip(eager[:2], compiled[:2]):
            torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=2**-7)
