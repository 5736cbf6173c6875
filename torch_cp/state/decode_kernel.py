"""The gated delta rule's decode step, reading and writing the state pool in place (Triton).

flash-linear-attention's recurrent kernel takes a batch of initial states and returns the final
ones, so a decode step around it gathers every row's state out of the pool, the kernel reads it
and writes a new one, and the engine scatters that back: three round trips of the largest
tensor a hybrid model's decode step touches (Qwen3.5-9B: 50 MB of fp32 state a request). This
kernel reads each row's state from its slot (the zero slot when the row is fresh) and writes it
back to the row's slot: one. It computes what transformers' ``torch_recurrent_gated_delta_rule``
does for one token (q and k L2-normalised, q scaled by ``Dk ** -0.5``, the state decayed by
``exp(g)``, the delta rule, then the output), in float32.

Each program owns one row, one value head and ``BV`` of its value channels: it reads and writes
only its own block of the row's slot, so no two programs touch the same state (padding rows all
write the sink slot; nothing reads it).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from torch_cp.state.kernels import int_flags

BLOCK_V = 32


@triton.jit
def _decode_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, fresh_ptr, o_ptr,
                 zero_slot, scale, q_sn, q_sh, k_sn, k_sh, v_sn, v_sh, g_sn, beta_sn, s_slot,
                 s_h, s_k, o_sn, o_sh, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BV: tl.constexpr):
    row = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    in_v = dv < DV
    q = tl.load(q_ptr + row * q_sn + hk * q_sh + dk).to(tl.float32)
    k = tl.load(k_ptr + row * k_sn + hk * k_sh + dk).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    v = tl.load(v_ptr + row * v_sn + hv * v_sh + dv, mask=in_v, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_sn + hv).to(tl.float32)
    beta = tl.load(beta_ptr + row * beta_sn + hv).to(tl.float32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    source = tl.where(tl.load(fresh_ptr + row) != 0, zero_slot, slot).to(tl.int64)
    block = hv * s_h + dk[:, None] * s_k + dv[None, :]
    h = tl.load(states_ptr + source * s_slot + block, mask=in_v[None, :], other=0.0)
    h = h * tl.exp(g)
    delta = (v - tl.sum(h * k[:, None], axis=0)) * beta
    h = h + k[:, None] * delta[None, :]
    tl.store(states_ptr + slot * s_slot + block, h, mask=in_v[None, :])
    out = tl.sum(h * q[:, None], axis=0)
    tl.store(o_ptr + row * o_sn + hv * o_sh + dv, out.to(o_ptr.dtype.element_ty), mask=in_v)


def decode_step_in_place(q_bhk: torch.Tensor, k_bhk: torch.Tensor, v_bhv: torch.Tensor,
                         g_bh: torch.Tensor, beta_bh: torch.Tensor, states: torch.Tensor,
                         slots_b: torch.Tensor, fresh_b: torch.Tensor) -> torch.Tensor:
    """One token per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g (log decay) and beta [B, Hv];
    ``states`` [slots, Hv, Dk, Dv] float32 (contiguous in its last two dims; the last slot
    holds zeros), read from each row's slot ``slots_b`` [B] (the last slot where ``fresh_b``)
    and written back to it. Returns [B, Hv, Dv] in v's dtype."""
    rows, k_heads, dk = q_bhk.shape
    v_heads, dv = v_bhv.shape[1:]
    assert states.dtype == torch.float32 and states.stride(3) == 1 and states.stride(2) == dv
    assert dk & (dk - 1) == 0, "Dk must be a power of two (tl.arange)"
    q_bhk, k_bhk, v_bhv = (t if t.stride(-1) == 1 else t.contiguous()
                           for t in (q_bhk, k_bhk, v_bhv))
    g_bh, beta_bh = g_bh.contiguous(), beta_bh.contiguous()
    out = torch.empty_like(v_bhv, memory_format=torch.contiguous_format)
    grid = (rows, v_heads, triton.cdiv(dv, BLOCK_V))
    # Triton launches on the current device, which need not be the pool's.
    with torch.cuda.device(states.device) if states.is_cuda else contextlib.nullcontext():
        _decode_step[grid](
            q_bhk, k_bhk, v_bhv, g_bh, beta_bh, states, slots_b, int_flags(fresh_b), out,
            states.shape[0] - 1, dk ** -0.5, q_bhk.stride(0), q_bhk.stride(1), k_bhk.stride(0),
            k_bhk.stride(1), v_bhv.stride(0), v_bhv.stride(1), g_bh.stride(0),
            beta_bh.stride(0), states.stride(0), states.stride(1), states.stride(2),
            out.stride(0), out.stride(1), GROUP=v_heads // k_heads, DK=dk, DV=dv, BV=BLOCK_V)
    return out
