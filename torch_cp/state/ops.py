"""The state kernels behind torch.library custom ops: torch.compile sees opaque calls that
mutate the state pool (the whole pool and the layer's index, as the KV pool ops take it: see
``torch_cp.graphs.compile``), so compiled decoder layers write the state in place."""

from __future__ import annotations

import torch

from torch_cp.state.kernels import conv_step, delta_rule_step


@torch.library.custom_op("torch_cp::state_conv", mutates_args=("conv",))
def state_conv(x_nc: torch.Tensor, weight_ck: torch.Tensor, conv: torch.Tensor, layer_idx: int,
               slots_b: torch.Tensor, fresh_b: torch.Tensor, qo_indptr: torch.Tensor,
               decode: bool, activation: str) -> torch.Tensor:
    """``kernels.conv_step`` on layer ``layer_idx`` of the pool's ``conv`` tensor."""
    return conv_step(x_nc, weight_ck, conv[layer_idx], slots_b, fresh_b, qo_indptr, decode,
                     activation)


@state_conv.register_fake
def _(x_nc, weight_ck, conv, layer_idx, slots_b, fresh_b, qo_indptr, decode, activation):
    return torch.empty_like(x_nc)


@torch.library.custom_op("torch_cp::state_delta_rule", mutates_args=("recurrent",))
def state_delta_rule(q_nhk: torch.Tensor, k_nhk: torch.Tensor, v_nhv: torch.Tensor,
                     g_nh: torch.Tensor, beta_nh: torch.Tensor, recurrent: torch.Tensor,
                     layer_idx: int, slots_b: torch.Tensor, fresh_b: torch.Tensor,
                     qo_indptr: torch.Tensor, decode: bool, kernels: str) -> torch.Tensor:
    """``kernels.delta_rule_step`` on layer ``layer_idx`` of the pool's ``recurrent`` tensor."""
    return delta_rule_step(q_nhk, k_nhk, v_nhv, g_nh, beta_nh, recurrent[layer_idx], slots_b,
                           fresh_b, qo_indptr, decode, kernels)


@state_delta_rule.register_fake
def _(q_nhk, k_nhk, v_nhv, g_nh, beta_nh, recurrent, layer_idx, slots_b, fresh_b, qo_indptr,
      decode, kernels):
    return torch.empty_like(v_nhv)
