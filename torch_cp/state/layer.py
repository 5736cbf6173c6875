"""LinearStateLayer: one gated DeltaNet layer's stateful core over the state pool."""

from __future__ import annotations

import torch
from torch import nn

from torch_cp.state.ops import state_conv, state_delta_rule
from torch_cp.state.pool import StatePool


class LinearStateLayer(nn.Module):
    """The causal conv and the gated delta rule of one linear-attention layer, reading and
    replacing each row's state in the pool (``StatePool.begin_step`` planned the step).

    A module of its own, like ``ContextParallelAttention``: Dynamo traces an int attribute of a
    module it calls (``layer_idx``) as a symbol, so every compiled linear layer shares one graph;
    read from a closure of the patched forward it was a constant, one graph per layer.

    Args:
        layer_idx: the layer's index in the state pool (its order among the linear layers).
        kernels: ``"torch"`` or ``"fla"`` (``torch_cp.state.kernels``).
    """

    def __init__(self, layer_idx: int, kernels: str):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernels = kernels

    def forward(self, qkv_nc: torch.Tensor, conv_weight_ck: torch.Tensor, activation: str,
                g_nh: torch.Tensor, beta_nh: torch.Tensor, k_heads: int, k_dim: int,
                v_dim: int, state: StatePool) -> torch.Tensor:
        """qkv_nc [N, C] (q, k: ``k_heads * k_dim`` channels each, then v) through the conv,
        then the delta rule with log decay ``g_nh`` and ``beta_nh`` [N, Hv] -> [N, Hv, Dv]."""
        n = qkv_nc.shape[0]
        mixed_nc = state_conv(qkv_nc, conv_weight_ck, state.conv, self.layer_idx, state.handle,
                              activation, self.kernels)
        key = k_heads * k_dim
        q, k, v = torch.split(mixed_nc, [key, key, mixed_nc.shape[1] - 2 * key], dim=-1)
        return state_delta_rule(q.reshape(n, k_heads, k_dim), k.reshape(n, k_heads, k_dim),
                                v.reshape(n, -1, v_dim), g_nh, beta_nh, state.recurrent,
                                self.layer_idx, state.handle, self.kernels)
