"""The causal conv's decode step, reading and writing the state pool in place (Triton).

In a decode step the conv's torch path (``kernels.conv_step``) gathers each row's state out of
the pool, concatenates the new input, runs the depthwise conv, writes the shifted window back
and applies SiLU: six to eight kernels a layer, each reading next to nothing (Qwen3.5-9B: 24
layers of 8192 channels x 3 inputs). This kernel does it in one: each program owns one row and
``BLOCK_C`` channels, reads the row's window from its slot (the zero slot when the row is
fresh) and the new input, writes the conv's activated output, and writes the window shifted by
one back to the row's slot. It rounds as the torch path does: the window in the pool's dtype,
the conv's sum (float32) to the weight's dtype, SiLU (float32) to the input's.

No two programs touch the same slot channels, except padding rows, which all write the sink
slot (nothing reads it).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from torch_cp.state.kernels import int_flags

BLOCK_C = 128


@triton.jit
def _conv_step(x_ptr, w_ptr, states_ptr, slots_ptr, fresh_ptr, out_ptr, zero_slot, channels,
               x_sn, w_sc, s_slot, s_c, out_sn, WIDTH: tl.constexpr, K_PAD: tl.constexpr,
               BC: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = c < channels
    t = tl.arange(0, K_PAD)  # window position: 0..WIDTH - 1 the state, WIDTH the new input
    slot = tl.load(slots_ptr + row).to(tl.int64)
    source = tl.where(tl.load(fresh_ptr + row) != 0, zero_slot, slot).to(tl.int64)
    cells = c[:, None] * s_c + t[None, :]
    prev = tl.load(states_ptr + source * s_slot + cells,
                   mask=in_c[:, None] & (t[None, :] < WIDTH), other=0.0)
    x = tl.load(x_ptr + row * x_sn + c, mask=in_c, other=0.0).to(prev.dtype)
    window = tl.where(t[None, :] == WIDTH, x[:, None], prev)
    w = tl.load(w_ptr + c[:, None] * w_sc + t[None, :],
                mask=in_c[:, None] & (t[None, :] <= WIDTH), other=0.0)
    conv = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    conv = conv.to(w.dtype).to(tl.float32)
    out = conv / (1.0 + tl.exp(-conv))
    tl.store(out_ptr + row * out_sn + c, out.to(out_ptr.dtype.element_ty), mask=in_c)
    tl.store(states_ptr + slot * s_slot + cells - 1, window,
             mask=in_c[:, None] & (t[None, :] >= 1) & (t[None, :] <= WIDTH))


def conv_step_in_place(x_bc: torch.Tensor, weight_ck: torch.Tensor, states: torch.Tensor,
                       slots_b: torch.Tensor, fresh_b: torch.Tensor) -> torch.Tensor:
    """One token per row: ``x_bc`` [B, C] through the depthwise causal conv ``weight_ck``
    [C, K] and SiLU, the window read from each row's slot ``slots_b`` [B] of ``states``
    [slots, C, K - 1] (the last slot where ``fresh_b``; it holds zeros) and written back to it
    shifted by one. Returns [B, C] in x's dtype."""
    rows, channels = x_bc.shape
    width = weight_ck.shape[1] - 1
    assert states.shape[1:] == (channels, width) and states.stride(2) == 1
    x_bc = x_bc if x_bc.stride(1) == 1 else x_bc.contiguous()
    weight_ck = weight_ck if weight_ck.stride(1) == 1 else weight_ck.contiguous()
    out = torch.empty_like(x_bc, memory_format=torch.contiguous_format)
    grid = (rows, triton.cdiv(channels, BLOCK_C))
    # Triton launches on the current device, which need not be the pool's.
    with torch.cuda.device(states.device) if states.is_cuda else contextlib.nullcontext():
        _conv_step[grid](
            x_bc, weight_ck, states, slots_b, int_flags(fresh_b), out, states.shape[0] - 1,
            channels, x_bc.stride(0), weight_ck.stride(0), states.stride(0), states.stride(1),
            out.stride(0), WIDTH=width, K_PAD=triton.next_power_of_2(width + 1), BC=BLOCK_C)
    return out
