"""The causal conv over the state pool, read and written in place (Triton).

In a decode step the conv's torch path (``kernels.conv_step``) gathers each row's state out of
the pool, concatenates the new input, runs the depthwise conv, writes the shifted window back
and applies SiLU: six to eight kernels a layer, each reading next to nothing (Qwen3.5-9B: 24
layers of 8192 channels x 3 inputs). ``conv_step_in_place`` does it in one: each program owns
one row and ``BLOCK_C`` channels, reads the row's window from its slot (the zero slot when the
row is fresh) and the new input, writes the conv's activated output, and writes the window
shifted by one back to the row's slot. In a multi-token step (prefill, chunks) the torch path
loops over the rows on the host (18 % of an 8 x 512 prefill, run 45); ``conv_rows_in_place``
runs two kernels over every token and row at once. Both round as the torch path does: the
window in the pool's dtype, the conv's sum (float32) to the weight's dtype, SiLU (float32) to
the input's.

No two programs write the same slot channels, except padding rows, which all write the sink
slot (nothing reads it); a program reads what it writes before writing it.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from torch_cp.state.kernels import int_flags

BLOCK_C = 128
BLOCK_T = 16  # tokens a program of a multi-token step computes


@triton.jit
def _slots(slots_ptr, fresh_ptr, row, zero_slot):
    """(slot written, slot read) of rows ``row``: the row's own, and the zero slot when fresh."""
    slot = tl.load(slots_ptr + row).to(tl.int64)
    return slot, tl.where(tl.load(fresh_ptr + row) != 0, zero_slot, slot).to(tl.int64)


@triton.jit
def _activated(conv, w_ptr):
    """The conv's float32 sum rounded to the weight's dtype, then SiLU in float32, as the torch
    path rounds (conv1d in the weight's dtype, then the activation)."""
    conv = conv.to(w_ptr.dtype.element_ty).to(tl.float32)
    return conv / (1.0 + tl.exp(-conv))


@triton.jit
def _conv_step(x_ptr, w_ptr, states_ptr, slots_ptr, fresh_ptr, out_ptr, zero_slot, channels,
               x_sn, w_sc, s_slot, s_c, out_sn, WIDTH: tl.constexpr, K_PAD: tl.constexpr,
               BC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = c < channels
    t = tl.arange(0, K_PAD)  # window position: 0..WIDTH - 1 the state, WIDTH the new input
    slot, source = _slots(slots_ptr, fresh_ptr, row, zero_slot)
    cells = c[:, None] * s_c + t[None, :]
    prev = tl.load(states_ptr + source * s_slot + cells,
                   mask=in_c[:, None] & (t[None, :] < WIDTH), other=0.0)
    x = tl.load(x_ptr + row * x_sn + c, mask=in_c, other=0.0).to(prev.dtype)
    window = tl.where(t[None, :] == WIDTH, x[:, None], prev)
    w = tl.load(w_ptr + c[:, None] * w_sc + t[None, :],
                mask=in_c[:, None] & (t[None, :] <= WIDTH), other=0.0)
    out = _activated(tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1), w_ptr)
    tl.store(out_ptr + row * out_sn + c, out.to(out_ptr.dtype.element_ty), mask=in_c)
    # Cell t - 1 is written from the element that read cell t: every thread of the program must
    # have read its cells before any writes (a barrier, where threads of other warps may not).
    tl.debug_barrier()
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


@triton.jit
def _window_input(x_ptr, states_ptr, p, c, in_c, start, end, source, x_sn, s_slot, s_c,
                  WIDTH: tl.constexpr):
    """Inputs at positions ``p`` [T] (int64) of channels ``c`` [BC], each of a row of tokens
    ``[start, end)`` whose state is slot ``source`` (all [T]): the packed input from the row's
    start on, the row's conv state before it."""
    from_x = (p >= start) & (p < end)
    from_state = (p < start) & (p >= start - WIDTH)
    x = tl.load(x_ptr + p[:, None] * x_sn + c[None, :],
                mask=from_x[:, None] & in_c[None, :], other=0.0)
    cell = WIDTH - (start - p)
    prev = tl.load(states_ptr + (source * s_slot + cell)[:, None] + c[None, :] * s_c,
                   mask=from_state[:, None] & in_c[None, :], other=0.0)
    return tl.where(from_x[:, None], x.to(prev.dtype), prev)


@triton.jit
def _row_of(qo_ptr, slots_ptr, fresh_ptr, row, real, zero_slot):
    """(start, end, source slot) of rows ``row`` (int64 vectors; ``real`` masks the others)."""
    row = tl.where(real, row, 0)
    start = tl.load(qo_ptr + row).to(tl.int64)
    end = tl.load(qo_ptr + row + 1).to(tl.int64)
    return start, end, _slots(slots_ptr, fresh_ptr, row, zero_slot)[1]


@triton.jit
def _conv_tokens(x_ptr, w_ptr, states_ptr, slots_ptr, fresh_ptr, qo_ptr, token_row_ptr,
                 out_ptr, zero_slot, tokens, channels, x_sn, w_sc, s_slot, s_c, out_sn,
                 WIDTH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # Every token of the step, whatever its row: no program idles on a short row.
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = c < channels
    in_t = t < tokens
    row = tl.load(token_row_ptr + t, mask=in_t, other=-1).to(tl.int64)
    real = row >= 0  # token padding: -1
    start, end, source = _row_of(qo_ptr, slots_ptr, fresh_ptr, row, real, zero_slot)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for k in tl.static_range(WIDTH + 1):  # window position k: the input at t - WIDTH + k
        window = _window_input(x_ptr, states_ptr, t - WIDTH + k, c, in_c, start, end, source,
                               x_sn, s_slot, s_c, WIDTH)
        w = tl.load(w_ptr + c * w_sc + k, mask=in_c, other=0.0)
        acc += window.to(tl.float32) * w.to(tl.float32)[None, :]
    out = tl.where(real[:, None], _activated(acc, w_ptr), 0.0)
    tl.store(out_ptr + t[:, None] * out_sn + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=in_t[:, None] & in_c[None, :])


@triton.jit
def _conv_rows_state(x_ptr, states_ptr, slots_ptr, fresh_ptr, qo_ptr, zero_slot, channels,
                     x_sn, s_slot, s_c, WIDTH: tl.constexpr, W_PAD: tl.constexpr,
                     BC: tl.constexpr):
    # After _conv_tokens (which reads the old states): each row's last WIDTH inputs.
    j = tl.arange(0, W_PAD)
    row = tl.program_id(0).to(tl.int64) + j * 0
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = c < channels
    start, end, source = _row_of(qo_ptr, slots_ptr, fresh_ptr, row, row >= 0, zero_slot)
    last = _window_input(x_ptr, states_ptr, end - WIDTH + j, c, in_c, start, end, source,
                         x_sn, s_slot, s_c, WIDTH)  # [W_PAD, BC]
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # A row shorter than the window keeps some of its old cells, shifted: the element that
    # writes a cell is not the one that read it, so every read lands before any write.
    tl.debug_barrier()
    tl.store(states_ptr + (slot * s_slot + j)[:, None] + c[None, :] * s_c, last,
             mask=(j < WIDTH)[:, None] & in_c[None, :])


def conv_rows_in_place(x_nc: torch.Tensor, weight_ck: torch.Tensor, states: torch.Tensor,
                       slots_b: torch.Tensor, fresh_b: torch.Tensor, qo_indptr: torch.Tensor,
                       token_row_n: torch.Tensor) -> torch.Tensor:
    """A multi-token step: row b's tokens ``x_nc[qo_indptr[b]:qo_indptr[b + 1]]`` [N, C]
    through the depthwise causal conv ``weight_ck`` [C, K] and SiLU, after the row's conv state
    (slot ``slots_b[b]`` of ``states`` [slots, C, K - 1]; the last slot where ``fresh_b``), which
    then takes the row's last K - 1 inputs. ``token_row_n`` [N]: each token's row, -1 past the
    rows (the step plan's ``token_row``). Two kernels over every token and row at once, where
    the torch path loops over the rows; their grids depend on N and B only. Returns [N, C] in
    x's dtype (tokens past the rows: zeros)."""
    tokens, channels = x_nc.shape
    rows = slots_b.shape[0]
    width = weight_ck.shape[1] - 1
    assert states.shape[1:] == (channels, width) and states.stride(2) == 1
    assert token_row_n.shape == (tokens,) and qo_indptr.shape == (rows + 1,)
    x_nc = x_nc if x_nc.stride(1) == 1 else x_nc.contiguous()
    weight_ck = weight_ck if weight_ck.stride(1) == 1 else weight_ck.contiguous()
    out = torch.empty(tokens, channels, dtype=x_nc.dtype, device=x_nc.device)
    fresh = int_flags(fresh_b)
    common = dict(zero_slot=states.shape[0] - 1, channels=channels, x_sn=x_nc.stride(0),
                  s_slot=states.stride(0), s_c=states.stride(1), WIDTH=width, BC=BLOCK_C)
    blocks = triton.cdiv(channels, BLOCK_C)
    with torch.cuda.device(states.device) if states.is_cuda else contextlib.nullcontext():
        if tokens:
            _conv_tokens[(triton.cdiv(tokens, BLOCK_T), blocks)](
                x_nc, weight_ck, states, slots_b, fresh, qo_indptr, token_row_n, out,
                tokens=tokens, w_sc=weight_ck.stride(0), out_sn=out.stride(0), BT=BLOCK_T,
                **common)
        if rows:
            _conv_rows_state[(rows, blocks)](x_nc, states, slots_b, fresh, qo_indptr,
                                             W_PAD=triton.next_power_of_2(width), **common)
    return out
