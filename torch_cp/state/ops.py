"""The state kernels behind torch.library custom ops: torch.compile sees opaque calls that
mutate the state pool (the whole pool and the layer's index, as the KV pool ops take it: see
``torch_cp.graphs.compile``), so compiled decoder layers write the state in place.

Like the attention backends, the pool is planned once per step on the host
(``StatePool.begin_step``) and the ops take an integer handle to it, not the plan's per-row
tensors: those are [rows]-shaped, so as graph inputs they would make Dynamo compile a graph per
row count (and specialise one row). Inside a captured step the ops read the plan's static
buffers, so a replay sees each step's slots.
"""

from __future__ import annotations

import weakref

import torch

from torch_cp.state.kernels import conv_step, delta_rule_step

# Weak: a pool lives as long as its cache.
_POOLS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register_pool(pool) -> int:
    """The handle the ops know ``pool`` (a ``StatePool``) by."""
    handle = id(pool)
    _POOLS[handle] = pool
    return handle


def _step(handle: int):
    plan = _POOLS[handle].step
    assert plan is not None and plan.state_slots is not None, "StatePool.begin_step ran"
    return plan


@torch.library.custom_op("torch_cp::state_conv", mutates_args=("conv",))
def state_conv(x_nc: torch.Tensor, weight_ck: torch.Tensor, conv: torch.Tensor, layer_idx: int,
               handle: int, activation: str, kernels: str) -> torch.Tensor:
    """``kernels.conv_step`` on layer ``layer_idx`` of the pool's ``conv`` tensor, for the step
    the pool was planned for."""
    p = _step(handle)
    return conv_step(x_nc, weight_ck, conv[layer_idx], p.state_slots, p.state_fresh,
                     p.qo_indptr, p.is_decode, activation, kernels,
                     qo_indptr_host=p.qo_indptr_host, token_row=p.token_row)


@state_conv.register_fake
def _(x_nc, weight_ck, conv, layer_idx, handle, activation, kernels):
    return torch.empty_like(x_nc)


@torch.library.custom_op("torch_cp::state_delta_rule", mutates_args=("recurrent",))
def state_delta_rule(q_nhk: torch.Tensor, k_nhk: torch.Tensor, v_nhv: torch.Tensor,
                     g_nh: torch.Tensor, beta_nh: torch.Tensor, recurrent: torch.Tensor,
                     layer_idx: int, handle: int, kernels: str) -> torch.Tensor:
    """``kernels.delta_rule_step`` on layer ``layer_idx`` of the pool's ``recurrent`` tensor,
    for the step the pool was planned for."""
    p = _step(handle)
    return delta_rule_step(q_nhk, k_nhk, v_nhv, g_nh, beta_nh, recurrent[layer_idx],
                           p.state_slots, p.state_fresh, p.qo_indptr, p.is_decode, kernels,
                           qo_indptr_host=p.qo_indptr_host)


@state_delta_rule.register_fake
def _(q_nhk, k_nhk, v_nhv, g_nh, beta_nh, recurrent, layer_idx, handle, kernels):
    return torch.empty_like(v_nhv)
