"""MoE routers in one kernel: after the router GEMM, the choice of each token's experts.

transformers' routers run the choice as separate ops after their GEMM: a softmax, ``torch.topk``
(two kernels on CUDA, a radix select and a sort of the k chosen) and the normalisation for Qwen's
routers; a sigmoid, a bias, two or three ``topk``, a scatter, a mask, a gather and the
normalisation for DeepSeek's and GLM's. At one token they are latency-bound: 0.55 ms of a
Qwen3-30B-A3B decode step of 4.2 ms (run 59, BENCHMARKS.md). Here one program per token keeps
its router logits in registers and picks its experts by k rounds of max: the same experts (up
to the order of equal values) and weights, in one kernel.

Two router kinds, recognised by their forward's source (``kind_of``); any other router, or one
whose forward differs, keeps its own:
- ``"softmax"`` (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): softmax in float32, the top k of it in
  descending order, optionally divided by their sum, cast to the logits' dtype.
- ``"sigmoid"`` (DeepSeek-V3, GLM-4.5-4.7, GLM-4.7-Flash): sigmoid, plus the score-correction
  bias for the choice, ``topk_group`` of ``n_group`` groups by the sum of each group's best two,
  the top k of those groups' experts (in descending order of choice, where transformers leaves
  the order unspecified), weighted by the sigmoid without the bias, optionally divided by their
  sum (+ 1e-20), times ``routed_scaling_factor``; float32.

Equal values are broken toward the lower expert id (torch's order among equal values is
unspecified), and NaN ranks first, as in ``torch.topk``. What a router computes (its kind, k,
groups, normalisation, scale) is read once, when its forward is made (``fused_forward``, by
``patch_model``): set a router's attributes before patching. Only its weight and bias are read
at each call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from torch_cp import gemv, pdl
from torch_cp.graphs.experts import moe_blocks
from torch_cp.layers import forward_source
from torch_cp.pdl import pdl_release, pdl_wait  # by name: Inductor copies them (pdl.py)

# Fragments of transformers' router forwards (whitespace removed) that say what they compute.
SOFTMAX_LINES = ("hidden_states=hidden_states.reshape(-1,self.hidden_dim)",
                 "router_logits=F.linear(hidden_states,self.weight)",
                 "softmax(router_logits,dtype=torch.float,dim=-1)",
                 "torch.topk(router_probs,self.top_k,dim=-1)",
                 "router_top_value=router_top_value.to(router_logits.dtype)")
SOFTMAX_NORM = "router_top_value/=router_top_value.sum(dim=-1,keepdim=True)"
SIGMOID_LINES = ("hidden_states=hidden_states.view(-1,self.hidden_dim)",
                 "router_logits=F.linear(hidden_states.type(torch.float32),"
                 "self.weight.type(torch.float32))",
                 "scores=router_logits.sigmoid()",
                 "scores_for_choice=scores+self.e_score_correction_bias",
                 ".topk(2,dim=-1)[0].sum(dim=-1)",
                 "torch.topk(scores_for_choice,k=self.top_k,dim=-1,sorted=False)[1]",
                 "topk_weights=scores.gather(1,topk_indices)",
                 "denominator=topk_weights.sum(dim=-1,keepdim=True)+1e-20",
                 "topk_weights=topk_weights*self.routed_scaling_factor")
CONDITIONAL_NORM = "ifself.norm_topk_prob:"
# The kernel's warps, read at each call. One: the k rounds of max are shuffles within a warp,
# with no barrier between warps; 2.5 against 4.2 us a Qwen3-30B-A3B layer at one token (run 109).
ROUTE_WARPS = 1


@triton.jit
def _chosen_first_if_nan(choice, valid):
    """``choice`` with NaN as +inf (as ``torch.topk`` ranks NaN first: a NaN row still picks
    experts that exist) and -inf off ``valid``."""
    return tl.where(valid, tl.where(choice != choice, float("inf"), choice), float("-inf"))


@triton.jit
def _route(logits_ptr, bias_ptr, weights_ptr, ids_ptr, experts, group_size, logits_st, scale,
           SIGMOID: tl.constexpr, NORM: tl.constexpr,
           GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPS_PAD: tl.constexpr,
           GROUP_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
           PDL: tl.constexpr):
    pdl_wait(PDL)  # every program, before any load (torch_cp/pdl.py)
    pdl_release(PDL)
    token = tl.program_id(0)
    g = tl.arange(0, GROUPS_PAD)[:, None]
    j = tl.arange(0, GROUP_PAD)[None, :]
    valid = (g < GROUPS) & (j < group_size)
    e = g * group_size + j  # [GROUPS_PAD, GROUP_PAD] expert ids
    none = e * 0 + experts  # larger than every id: the "no such expert" of a min
    x = tl.load(logits_ptr + token * logits_st + e, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))
        choice = _chosen_first_if_nan(
            score + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32), valid)
        if GROUPS > 1:  # each group's best two, summed; keep the best TOPK_GROUP groups
            best = tl.max(choice, axis=1)
            first = tl.min(tl.where(choice == best[:, None], e, none), axis=1)
            second = tl.max(tl.where(e == first[:, None], float("-inf"), choice), axis=1)
            group_score = tl.where(tl.arange(0, GROUPS_PAD) < GROUPS, best + second,
                                   float("-inf"))
            groups = tl.arange(0, GROUPS_PAD)
            kept = groups < 0
            for _ in tl.static_range(TOPK_GROUP):
                # Among the groups not kept yet: where every score left is -inf, a kept
                # group's -inf would tie with them.
                left = (groups < GROUPS) & ~kept
                top = tl.max(tl.where(left, group_score, float("-inf")), axis=0)
                pick = tl.min(tl.where(left & (group_score == top), groups, GROUPS_PAD), axis=0)
                kept = kept | (groups == pick)
            choice = tl.where(kept[:, None], choice, float("-inf"))
    else:
        x = tl.where(valid, x, float("-inf"))
        exp = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        score = exp / tl.sum(tl.sum(exp, axis=1), axis=0)
        choice = _chosen_first_if_nan(score, valid)
    k = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    taken = e < 0
    for i in tl.static_range(TOP_K):
        # Among the experts not taken yet (all -inf left: never one taken again).
        left = valid & ~taken
        top = tl.max(tl.max(tl.where(left, choice, float("-inf")), axis=1), axis=0)
        pick = tl.minimum(tl.min(tl.min(tl.where(left & (choice == top), e, none), axis=1),
                                 axis=0), experts - 1)
        picked = (e == pick) & valid  # padding lanes repeat the next group's ids
        ids = tl.where(k == i, pick.to(tl.int64), ids)
        weights = tl.where(k == i, tl.sum(tl.sum(tl.where(picked, score, 0.0), axis=1), axis=0),
                           weights)
        taken = taken | picked
    if NORM:
        total = tl.sum(weights, axis=0)
        if SIGMOID:
            total = total + 1e-20
        weights = weights / total
    if SIGMOID:
        weights = weights * scale
    out = token * TOP_K + k
    tl.store(ids_ptr + out, ids, mask=k < TOP_K)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=k < TOP_K)


def _kind_of_class(cls: type) -> str | None:
    source = forward_source(cls)
    if all(line in source for line in SOFTMAX_LINES):
        return "softmax"
    if all(line in source for line in SIGMOID_LINES):
        return "sigmoid"
    return None


@dataclass(frozen=True)
class Routing:
    """What a router computes after its GEMM, read once from the router (outside any trace)."""

    kind: str  # "softmax" or "sigmoid"
    top_k: int
    normalise: bool
    groups: int = 1
    topk_group: int = 1
    scale: float = 1.0


def routing_of(router: nn.Module) -> Routing | None:
    """The ``Routing`` of ``router`` when its forward is one of the router kinds the kernel
    computes (see the module's docstring) on shapes its own forward computes, else None."""
    kind = _kind_of_class(type(router))
    if kind is None:
        return None
    experts, top_k = router.num_experts, router.top_k
    source = forward_source(type(router))
    normalise = (bool(router.norm_topk_prob) if CONDITIONAL_NORM in source
                 else kind == "sigmoid" or SOFTMAX_NORM in source)
    if kind == "softmax":
        return Routing(kind, top_k, normalise) if 0 < top_k <= experts else None
    groups, kept = router.num_group, router.topk_group
    if experts % groups or experts // groups < 2 or not 0 < kept <= groups \
            or not 0 < top_k <= kept * (experts // groups):
        return None
    return Routing(kind, top_k, normalise, groups, kept, float(router.routed_scaling_factor))


def kind_of(router: nn.Module) -> str | None:
    """``routing_of(router).kind``, or None."""
    routing = routing_of(router)
    return routing.kind if routing else None


def routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model``'s MoE blocks (``gate`` beside ``experts``) the kernel computes:
    not one whose forward was replaced on the instance (accelerate's offloading hooks, the
    ``kernels`` library), whose work the kernel would skip."""
    return [b.gate for b in moe_blocks(model)
            if isinstance(getattr(b, "gate", None), nn.Module) and routing_of(b.gate)
            and "forward" not in vars(b.gate) and not hasattr(b.gate, "_hf_hook")]


def route(routing: Routing, logits_te: torch.Tensor, bias_e: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k] int64) for router logits ``logits_te`` [T, E] (and
    the sigmoid kind's score-correction bias ``bias_e`` [E]), as the router computes them."""
    assert (bias_e is not None) == (routing.kind == "sigmoid")
    logits_te = logits_te if logits_te.stride(-1) == 1 else logits_te.contiguous()
    if pdl.active(logits_te):
        return _route_pdl(logits_te, bias_e, routing.kind, routing.top_k, routing.normalise,
                          routing.groups, routing.topk_group, routing.scale)
    return _launch(routing, logits_te, bias_e, on_pdl=False)


def _launch(routing: Routing, logits_te: torch.Tensor, bias_e: torch.Tensor | None,
            on_pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = logits_te.shape
    sigmoid = routing.kind == "sigmoid"
    weights = torch.empty(tokens, routing.top_k, device=logits_te.device,
                          dtype=torch.float32 if sigmoid else logits_te.dtype)
    ids = torch.empty(tokens, routing.top_k, dtype=torch.int64, device=logits_te.device)
    if tokens:
        group_size = experts // routing.groups
        _route[(tokens,)](
            logits_te, bias_e if sigmoid else logits_te, weights, ids, experts, group_size,
            logits_te.stride(0), routing.scale, SIGMOID=sigmoid, NORM=routing.normalise,
            GROUPS=routing.groups, TOPK_GROUP=routing.topk_group,
            GROUPS_PAD=triton.next_power_of_2(routing.groups),
            GROUP_PAD=triton.next_power_of_2(group_size), TOP_K=routing.top_k,
            K_PAD=triton.next_power_of_2(routing.top_k), PDL=on_pdl, num_warps=ROUTE_WARPS,
            **pdl.launch_options(on_pdl))
    return weights, ids


# Behind an op, the kernel is launched from here with the dependent launch (Inductor launches
# the Triton kernels it traces without launch options; torch_cp/gemv.py).
@torch.library.custom_op("torch_cp::route", mutates_args=())
def _route_pdl(logits_te: torch.Tensor, bias_e: torch.Tensor | None, kind: str, top_k: int,
               normalise: bool, groups: int, topk_group: int, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    routing = Routing(kind, top_k, normalise, groups, topk_group, scale)
    return _launch(routing, logits_te, bias_e, on_pdl=True)


@_route_pdl.register_fake
def _(logits_te, bias_e, kind, top_k, normalise, groups, topk_group, scale):
    tokens = logits_te.shape[0]
    dtype = torch.float32 if kind == "sigmoid" else logits_te.dtype
    return (logits_te.new_empty(tokens, top_k, dtype=dtype),
            logits_te.new_empty(tokens, top_k, dtype=torch.int64))


def fused_forward(router: nn.Module):
    """A forward for ``router`` (one ``routers`` gave) with its own signature and results,
    (logits, weights, ids): its GEMM as it runs it, then ``route``. The caller installs it and
    keeps the original, as for the attention forwards. Where a gradient is wanted (the kernel's
    weights have none) or under autocast (which rounds transformers' float32 sigmoid scores to
    bf16, and the choice with them), the router's own forward runs instead."""
    routing = routing_of(router)
    assert routing is not None, type(router).__name__
    sigmoid = routing.kind == "sigmoid"
    own_forward = router.forward

    def forward(hidden_states: torch.Tensor):
        if torch.is_autocast_enabled(hidden_states.device.type) or torch.is_grad_enabled() and (
                hidden_states.requires_grad or router.weight.requires_grad):
            return own_forward(hidden_states)
        x = hidden_states.reshape(-1, router.hidden_dim)
        if sigmoid:
            logits = F.linear(x.float(), router.weight.float())
            weights, ids = route(routing, logits, router.e_score_correction_bias)
        else:
            logits = gemv.linear(x, router.weight)
            weights, ids = route(routing, logits)
        return logits, weights, ids

    return forward
