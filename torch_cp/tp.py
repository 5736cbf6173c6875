"""Tensor parallelism: shard Hugging Face linears, MLPs and MoE experts in place over "tp".

Column-parallel layers keep the output features of this rank; row-parallel layers keep the matching
input features, so each rank computes a partial sum that one all-reduce over the TP group completes.
Attention heads are split by the family (``Family.shard_attention``, which uses
``torch_cp.mesh.kv_head_replicas`` for the KV heads); this module provides the pieces and shards the
MLP/MoE blocks, which are alike across the supported families:

- dense MLP with ``gate_proj``/``up_proj``/``down_proj`` (Qwen, GLM-4-MoE dense layers, DeepSeek) or
  with a fused ``gate_up_proj`` (GLM, GLM-4): gate and up column-parallel by intermediate channel,
  ``down_proj`` row-parallel (``RowParallel``, which all-reduces).
- MoE block with ``experts`` holding fused 3-D parameters ``gate_up_proj`` [E, 2I, H] and
  ``down_proj`` [E, H, I] (transformers 5), an optional ``shared_experts`` MLP and a router
  ``gate``: experts and shared experts are split by intermediate channel, the router stays
  replicated (every rank routes identically), and one all-reduce of the block's output
  completes both sums.

Embeddings, norms and ``lm_head`` stay replicated. Sharding is one-way: dropped shards are freed.
Every sharded parameter records which part of the full tensor it kept (``shard_of``: a ``Shard``).
On a model built on the meta device sharding allocates nothing, and ``torch_cp.from_pretrained``
then reads exactly the recorded part of each tensor from the checkpoint: the rules above decide
both what ``patch_model`` cuts from loaded weights and what a rank loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torch_cp import compat, gemv


@dataclass(frozen=True, eq=False)
class Shard:
    """The part of a full tensor a TP-sharded parameter holds: entries ``index`` (a slice or a
    1-D index tensor, in full-tensor coordinates) along ``dim``, of ``full`` there."""

    dim: int
    index: slice | torch.Tensor
    full: int

    def runs(self) -> list[tuple[int, int]]:
        """``index`` as ``[start, stop)`` runs of consecutive entries, in the kept order."""
        if isinstance(self.index, slice):
            return [(self.index.start, self.index.stop)]
        runs: list[list[int]] = []
        for i in self.index.tolist():
            if runs and runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, i + 1])
        return [(a, b) for a, b in runs]


SHARD_ATTR = "tp_shard"


def shard_of(param: torch.Tensor) -> Shard | None:
    """What part of the full tensor ``param`` holds; None when it was not sharded (whole)."""
    return getattr(param, SHARD_ATTR, None)


def _shard(tensor: torch.Tensor, dim: int, index: slice | torch.Tensor) -> nn.Parameter:
    """A new parameter holding only the kept part (a view would keep the whole tensor alive),
    recording it (``shard_of``)."""
    assert shard_of(tensor) is None, "a parameter is sharded once"
    if isinstance(index, slice):
        kept = tensor.narrow(dim, index.start, index.stop - index.start).clone(
            memory_format=torch.contiguous_format)
    else:
        index = index.cpu()
        kept = tensor.index_select(dim, index.to(tensor.device))
    param = nn.Parameter(kept, requires_grad=tensor.requires_grad)
    setattr(param, SHARD_ATTR, Shard(dim, index, tensor.shape[dim]))
    return param


def keep_entries(module: nn.Module, name: str, dim: int, index: slice | torch.Tensor) -> None:
    """Keep entries ``index`` along ``dim`` of the parameter ``module.<name>``, in place (a conv's
    channels, per-head parameters)."""
    setattr(module, name, _shard(getattr(module, name), dim, index))


def keep_out_features(linear: nn.Linear, index: slice | torch.Tensor) -> None:
    """Column-parallel: keep output features ``index`` (weight rows, bias entries), in place."""
    linear.weight = _shard(linear.weight, 0, index)
    if linear.bias is not None:
        linear.bias = _shard(linear.bias, 0, index)
    linear.out_features = linear.weight.shape[0]


def keep_in_features(linear: nn.Linear, index: slice | torch.Tensor) -> None:
    """Row-parallel input split: keep input features ``index`` (weight columns), in place. The
    bias stays whole; ``RowParallel`` adds it once, after the all-reduce."""
    linear.weight = _shard(linear.weight, 1, index)
    linear.in_features = linear.weight.shape[1]


def rank_slice(size: int, tp_rank: int, tp: int) -> slice:
    """This rank's contiguous share of ``size`` channels (``size % tp == 0``)."""
    assert size % tp == 0, f"{size} channels do not split over tp = {tp}"
    per_rank = size // tp
    return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)


class RowParallel(nn.Module):
    """A linear whose input features are split over the TP group: partial product, all-reduce,
    then the bias once. Holds the original (sliced) linear's parameters, so the state-dict keys
    stay ``<name>.weight`` / ``<name>.bias``."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = compat.sum_over(gemv.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank), out_features={self.out_features}"


def row_parallel(parent: nn.Module, name: str, group) -> None:
    """Replace ``parent.<name>`` (an ``nn.Linear`` already cut by ``keep_in_features``) by its
    ``RowParallel``; a no-op when it already is one."""
    linear = getattr(parent, name)
    if not isinstance(linear, RowParallel):
        setattr(parent, name, RowParallel(linear, group))


# MLP and MoE blocks.

def _intermediate_sizes(mlp: nn.Module) -> list[tuple[str, int]]:
    """(what, channels) that must split over tp; raises ValueError for an unknown layout."""
    if hasattr(mlp, "experts"):
        experts = mlp.experts
        if not isinstance(getattr(experts, "down_proj", None), nn.Parameter):
            raise ValueError(f"{type(mlp).__name__}: experts without fused 3-D parameters")
        if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True):
            raise ValueError(f"{type(mlp).__name__}: experts with biases or without a gate")
        dim = 1 if getattr(experts, "is_transposed", False) else 2
        sizes = [("MoE intermediate size", experts.down_proj.shape[dim])]
        shared = _shared_experts(mlp)
        if shared is not None:
            if getattr(getattr(shared, "down_proj", None), "bias", None) is not None:
                raise ValueError(f"{type(mlp).__name__}: shared experts with a down_proj bias")
            sizes += [("shared experts " + w, n) for w, n in _intermediate_sizes(shared)]
        return sizes
    if hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj") and hasattr(mlp, "down_proj"):
        return [("MLP intermediate size", mlp.down_proj.in_features)]
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
        return [("MLP intermediate size", mlp.down_proj.in_features)]
    raise ValueError(f"{type(mlp).__name__}: unknown MLP layout")


def _shared_experts(mlp: nn.Module) -> nn.Module | None:
    """An MoE block's shared experts MLP: ``shared_experts`` (Qwen2-MoE style, DeepSeek, GLM) or
    ``shared_expert`` (Qwen3-Next, Qwen3.5-MoE; its ``shared_expert_gate`` scales each token's
    output by one replicated scalar, so the split sum stays exact)."""
    shared = getattr(mlp, "shared_experts", None)
    return shared if shared is not None else getattr(mlp, "shared_expert", None)


def mlp_problems(mlp: nn.Module, tp: int) -> list[str]:
    """Why ``shard_mlp(mlp, ., tp, .)`` would fail (empty when it would not)."""
    try:
        sizes = _intermediate_sizes(mlp)
    except ValueError as e:
        return [f"cannot shard over tp: {e}"]
    return [f"{what} {n} does not split evenly over tp = {tp}" for what, n in sizes if n % tp]


def _shard_dense(mlp: nn.Module, tp_rank: int, tp: int) -> None:
    """Column-split gate/up and row-split down_proj's weight; no reduction added."""
    inter = mlp.down_proj.in_features
    mine = rank_slice(inter, tp_rank, tp)
    if hasattr(mlp, "gate_up_proj"):  # fused [gate; up] rows
        keep_out_features(mlp.gate_up_proj, torch.cat(
            [torch.arange(inter)[mine], inter + torch.arange(inter)[mine]]))
    else:
        keep_out_features(mlp.gate_proj, mine)
        keep_out_features(mlp.up_proj, mine)
    keep_in_features(mlp.down_proj, mine)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = inter // tp


def _shard_experts(experts: nn.Module, tp_rank: int, tp: int) -> None:
    """Fused expert parameters [E, 2I, H] / [E, H, I] (or transposed) split by channel of I."""
    transposed = getattr(experts, "is_transposed", False)
    gate_up_dim, down_dim = (2, 1) if transposed else (1, 2)
    inter = experts.down_proj.shape[down_dim]
    mine = torch.arange(inter)[rank_slice(inter, tp_rank, tp)]
    gate_up = torch.cat([mine, inter + mine])  # fused [gate; up] channels
    experts.gate_up_proj = _shard(experts.gate_up_proj, gate_up_dim, gate_up)
    experts.down_proj = _shard(experts.down_proj, down_dim, mine)
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = inter // tp


def _all_reduce_output(group):
    def hook(module, args, output):
        assert isinstance(output, torch.Tensor), "a sharded MoE block must return a tensor"
        return compat.sum_over(output, group)
    return hook


def shard_mlp(mlp: nn.Module, tp_rank: int, tp: int, group) -> None:
    """Shard one decoder layer's MLP or MoE block over ``tp`` ranks in place (see module doc).

    Its output is the full sum on every rank: a dense MLP's ``down_proj`` becomes ``RowParallel``;
    an MoE block gets a forward hook that all-reduces its output once (routed + shared experts).
    """
    problems = mlp_problems(mlp, tp)
    if problems:
        raise ValueError("; ".join(problems))
    if hasattr(mlp, "experts"):
        _shard_experts(mlp.experts, tp_rank, tp)
        if _shared_experts(mlp) is not None:
            _shard_dense(_shared_experts(mlp), tp_rank, tp)
        mlp.register_forward_hook(_all_reduce_output(group))
    else:
        _shard_dense(mlp, tp_rank, tp)
        row_parallel(mlp, "down_proj", group)
