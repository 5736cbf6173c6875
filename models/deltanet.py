"""Gated DeltaNet layers (Qwen3.5, Qwen3-Next): their TP split and their forward over a step's
packed tokens with the state pool.

Both models project the input to q, k, v (through a causal conv), the output gate z, and the
per-value-head b (beta) and a (decay); Qwen3.5 with four linears (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), Qwen3-Next with two whose outputs are grouped per key head
(``in_proj_qkvz``, ``in_proj_ba``). A value head ``j`` reads key head ``j // (Hv / Hk)``, so a
contiguous share of the key heads and the matching share of the value heads split over TP with
no exchange; ``out_proj`` is row-parallel. In SP mode every partner computes the same state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch_cp.state import StatePool
from torch_cp.tp import keep_entries, keep_in_features, keep_out_features, rank_slice


def _heads(rank_heads: slice, width: int, offset: int = 0) -> torch.Tensor:
    return offset + torch.arange(rank_heads.start * width, rank_heads.stop * width)


def shard_linear(mod: nn.Module, tp_rank: int, tp: int) -> None:
    """Keep this rank's key heads and their value heads in the projections, the conv channels,
    ``dt_bias`` and ``A_log``; ``out_proj`` keeps their input columns (made row-parallel by the
    caller). Decides from shapes alone (it also runs on meta models)."""
    hk, hv, dk, dv = mod.num_k_heads, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim
    k_heads, v_heads = rank_slice(hk, tp_rank, tp), rank_slice(hv, tp_rank, tp)
    key_dim = hk * dk
    conv = torch.cat([_heads(k_heads, dk), _heads(k_heads, dk, key_dim),
                      _heads(v_heads, dv, 2 * key_dim)])
    if hasattr(mod, "in_proj_qkvz"):  # grouped per key head: [q | k | v group | z group]
        keep_out_features(mod.in_proj_qkvz, _heads(k_heads, 2 * dk + 2 * dv * hv // hk))
        keep_out_features(mod.in_proj_ba, _heads(k_heads, 2 * hv // hk))
    else:
        keep_out_features(mod.in_proj_qkv, conv)
        keep_out_features(mod.in_proj_z, _heads(v_heads, dv))
        keep_out_features(mod.in_proj_b, v_heads)
        keep_out_features(mod.in_proj_a, v_heads)
    keep_entries(mod.conv1d, "weight", 0, conv)
    mod.conv1d.in_channels = mod.conv1d.out_channels = mod.conv1d.groups = conv.numel()
    keep_entries(mod, "dt_bias", 0, v_heads)
    keep_entries(mod, "A_log", 0, v_heads)
    keep_in_features(mod.out_proj, _heads(v_heads, dv))
    mod.num_k_heads, mod.num_v_heads = hk // tp, hv // tp
    mod.key_dim, mod.value_dim = mod.num_k_heads * dk, mod.num_v_heads * dv
    mod.conv_dim = conv.numel()


def _project(mod: nn.Module, x_nd: torch.Tensor):
    """(conv input [N, C], z [N, Hv, Dv], b [N, Hv], a [N, Hv]), the input projections run as
    one GEMM (``cp_in``, fused_linear.py)."""
    n = x_nd.shape[0]
    if hasattr(mod, "in_proj_qkvz"):
        hk, ratio = mod.num_k_heads, mod.num_v_heads // mod.num_k_heads
        dk, dv = mod.head_k_dim, mod.head_v_dim
        qkvz, ba = mod.cp_in(x_nd)
        q, k, v, z = torch.split(qkvz.view(n, hk, -1), [dk, dk, ratio * dv, ratio * dv], dim=-1)
        b, a = torch.split(ba.view(n, hk, -1), [ratio, ratio], dim=-1)
        qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return qkv, z.reshape(n, -1, dv), b.reshape(n, -1), a.reshape(n, -1)
    qkv, z, b, a = mod.cp_in(x_nd)
    # The state ops read the conv input densely; the others are views of the one GEMM's output.
    return qkv.contiguous(), z.view(n, -1, mod.head_v_dim), b, a


def linear_forward(mod: nn.Module, x_nd: torch.Tensor, state: StatePool, plan) -> torch.Tensor:
    """The gated DeltaNet of N packed tokens, reading and replacing each row's state in
    ``state`` (planned for ``plan``: slots ``plan.state_slots``; a row with no context starts
    from zeros) through the layer's ``cp_state`` (a ``LinearStateLayer``). [N, hidden] ->
    [N, hidden] (a row-parallel ``out_proj`` reduces over TP itself)."""
    n = x_nd.shape[0]
    assert state.step is plan, "the state pool was planned for this step (PagedKVCache)"
    qkv_nc, z_nhv, b_nh, a_nh = _project(mod, x_nd)
    beta_nh = b_nh.sigmoid()
    g_nh = -mod.A_log.float().exp() * F.softplus(a_nh.float() + mod.dt_bias)
    core_nhv = mod.cp_state(qkv_nc, mod.conv1d.weight[:, 0], mod.activation, g_nh, beta_nh,
                            mod.num_k_heads, mod.head_k_dim, mod.head_v_dim, state)
    core = mod.norm(core_nhv.reshape(-1, mod.head_v_dim), z_nhv.reshape(-1, mod.head_v_dim))
    return mod.out_proj(core.reshape(n, -1))
