"""The two stateful parts of a gated DeltaNet layer over a step's packed rows.

- ``conv_step``: the depthwise causal conv over each row's new inputs, preceded by the row's
  conv state (its last ``K - 1`` inputs), which it then replaces.
- ``delta_rule_step``: the gated delta rule from each row's recurrent state, which it replaces.

A row whose context is empty (``fresh``: a new request, a padding row) starts from zeros: it
reads the pool's last slot, which holds zeros and is never written (``StatePool.zero_slot``),
not its own, which may hold a finished request's state or NaN; so no pass clears anything and
each step moves each row's state once in and once out. A decode step (one token per row, padding
rows included) runs every row at once from device tensors only, so a CUDA graph can hold it;
other steps go row by row on host lengths (``qo_indptr`` is read once per step and layer) or,
with flash-linear-attention, through its variable-length kernel.

Kernels: ``"torch"``, transformers' own torch implementations (the reference: what the
unpatched model runs on a CPU), or ``"fla"``, flash-linear-attention's Triton kernels (what
transformers runs on a GPU when it is installed) for multi-token steps and torch_cp's own Triton
kernel for decode steps (``decode_kernel.py``: it updates the pool's slots in place, where fla's
recurrent kernel needs the states gathered out of the pool and scattered back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_cp import compat

KERNELS = ("torch", "fla")
# Whether ``"fla"`` steps run the conv through torch_cp's in-place kernels (conv_kernel.py);
# off, transformers' torch conv. On since run 64 (docs/gpu-runs.md): every hybrid GPU test passed
# through them, and Qwen3.5-9B's batch-1 step fell from 5.72 to 5.20 ms (BENCHMARKS.md).
CONV_KERNELS = True


def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _start(states: torch.Tensor, slots_b: torch.Tensor, fresh_b: torch.Tensor) -> torch.Tensor:
    """The state each row starts from: its slot's, or the zero slot's (the last) when fresh
    (``fresh_b`` [B] bool or integer, nonzero: fresh)."""
    zero_slot = torch.full_like(slots_b, states.shape[0] - 1)
    return states.index_select(0, torch.where(fresh_b != 0, zero_slot, slots_b))


def int_flags(flags_b: torch.Tensor) -> torch.Tensor:
    """Flags a Triton kernel can read (it takes no bool pointers): the plan's ``state_fresh`` is
    int64 already, so no kernel runs for it."""
    return flags_b.to(torch.int8) if flags_b.dtype == torch.bool else flags_b


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(x) if activation == "silu" else compat.activation(activation)(x)


def conv_step(x_nc: torch.Tensor, weight_ck: torch.Tensor, states: torch.Tensor,
              slots_b: torch.Tensor, fresh_b: torch.Tensor, qo_indptr: torch.Tensor | None,
              decode: bool, activation: str, kernels: str = "torch",
              qo_indptr_host: torch.Tensor | None = None,
              token_row: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv of packed inputs ``x_nc`` [N, C] with ``weight_ck`` [C, K].

    ``states`` [slots, C, K - 1]: one layer's conv states (the last slot: zeros, never written),
    updated in place for each row's slot ``slots_b`` [B]. Returns the activated conv output
    [N, C] (tokens past the rows: zeros). ``qo_indptr`` [B + 1]: row bounds (device; None for a
    decode step), ``qo_indptr_host`` the same on the host (default: ``qo_indptr``), and
    ``token_row`` [N] each token's row (-1 past the rows; the plan's). With ``kernels="fla"``,
    SiLU and the pool in the weight's dtype, torch_cp's in-place kernels (``conv_kernel.py``)
    run the step once ``CONV_KERNELS`` is on.
    """
    if (kernels == "fla" and activation == "silu" and CONV_KERNELS
            and states.dtype == weight_ck.dtype):
        from torch_cp.state import conv_kernel

        if decode:
            return conv_kernel.conv_step_in_place(x_nc, weight_ck, states, slots_b, fresh_b)
        return conv_kernel.conv_rows_in_place(x_nc, weight_ck, states, slots_b, fresh_b,
                                              qo_indptr, token_row)
    width = weight_ck.shape[1] - 1
    prev_bck = _start(states, slots_b, fresh_b)
    conv_weight = weight_ck.unsqueeze(1)
    channels = x_nc.shape[1]
    if decode:  # one token per row, N == B
        window_bck = torch.cat([prev_bck, x_nc.unsqueeze(-1).to(prev_bck.dtype)], dim=-1)
        out_nc = F.conv1d(window_bck.to(weight_ck.dtype), conv_weight, groups=channels)[..., 0]
        states.index_copy_(0, slots_b, window_bck[..., 1:])
        return _activate(out_nc, activation).to(x_nc.dtype)
    bounds = (qo_indptr if qo_indptr_host is None else qo_indptr_host).tolist()
    out_nc = torch.zeros_like(x_nc)
    new_bck = torch.empty_like(prev_bck)
    for b in range(slots_b.shape[0]):
        start, end = bounds[b], bounds[b + 1]
        seq_cl = torch.cat([prev_bck[b], x_nc[start:end].T.to(prev_bck.dtype)], dim=-1)
        new_bck[b] = seq_cl[:, seq_cl.shape[1] - width:]
        if end > start:
            out_lc = F.conv1d(seq_cl[None].to(weight_ck.dtype), conv_weight, groups=channels)
            out_nc[start:end] = _activate(out_lc[0], activation).T.to(x_nc.dtype)
    states.index_copy_(0, slots_b, new_bck)
    return out_nc


def delta_rule_step(q_nhk: torch.Tensor, k_nhk: torch.Tensor, v_nhv: torch.Tensor,
                    g_nh: torch.Tensor, beta_nh: torch.Tensor, states: torch.Tensor,
                    slots_b: torch.Tensor, fresh_b: torch.Tensor, qo_indptr: torch.Tensor,
                    decode: bool, kernels: str, qo_indptr_host: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Gated delta rule (q and k L2-normalised in the kernel, as the models call it) of packed
    rows: q, k [N, Hk, Dk], v [N, Hv, Dv], g (log decay) and beta [N, Hv]. ``states``
    [slots, Hv, Dk, Dv] float32: one layer's recurrent states (the last slot: zeros, never
    written), updated in place. ``qo_indptr_host``: the same bounds on the host (no device
    read). Returns [N, Hv, Dv] in v's dtype (tokens past the rows: zeros)."""
    dk = q_nhk.shape[-1]
    # The pool read and written in place (decode_kernel.py), whose key block is one tl.arange:
    # a power-of-two Dk (every Qwen3.5 / Qwen3-Next head: 128); others take fla's rule below.
    if decode and kernels == "fla" and dk & (dk - 1) == 0:
        from torch_cp.state.decode_kernel import decode_step_in_place

        return decode_step_in_place(q_nhk, k_nhk, v_nhv, g_nh, beta_nh, states, slots_b, fresh_b)
    h0_bhkv = _start(states, slots_b, fresh_b)
    chunk, recurrent = _functions(kernels)
    common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    if decode:  # [B, 1, H, D]: every row one token
        out, h_bhkv = recurrent(q_nhk[:, None], k_nhk[:, None], v_nhv[:, None], g=g_nh[:, None],
                                beta=beta_nh[:, None], initial_state=h0_bhkv, **common)
        states.index_copy_(0, slots_b, h_bhkv.to(states.dtype))
        return out[:, 0].to(v_nhv.dtype)
    out_nhv = torch.zeros_like(v_nhv)
    rows = slots_b.shape[0]
    bounds = (qo_indptr if qo_indptr_host is None else qo_indptr_host).tolist()
    if kernels == "fla":
        end = bounds[rows]
        out, h_bhkv = chunk(q_nhk[None, :end], k_nhk[None, :end], v_nhv[None, :end],
                            g=g_nh[None, :end], beta=beta_nh[None, :end], initial_state=h0_bhkv,
                            cu_seqlens=qo_indptr[: rows + 1].long(), **common)
        out_nhv[:end] = out[0].to(v_nhv.dtype)
    else:
        h_bhkv = torch.empty_like(h0_bhkv)
        for b in range(rows):
            s, e = bounds[b], bounds[b + 1]
            out, h = chunk(q_nhk[None, s:e], k_nhk[None, s:e], v_nhv[None, s:e],
                           g=g_nh[None, s:e], beta=beta_nh[None, s:e],
                           initial_state=h0_bhkv[b:b + 1], **common)
            out_nhv[s:e] = out[0].to(v_nhv.dtype)
            h_bhkv[b] = h[0]
    states.index_copy_(0, slots_b, h_bhkv.to(states.dtype))
    return out_nhv


def _functions(kernels: str):
    """(chunked, recurrent) gated delta rule functions of ``kernels``."""
    if kernels == "fla":
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )

        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    return compat.torch_gated_delta_rules()
