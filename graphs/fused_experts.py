"""MoE experts for decode-sized steps: two Triton kernels that read only the routed experts.

At one token, transformers' ``grouped_mm`` experts sort, count and gather before two grouped
GEMMs, all latency-bound: 0.11 ms for a Qwen3-30B-A3B layer's 8 experts against 0.018 ms to read
their weights at the copy bandwidth (run 36, BENCHMARKS.md "MoE models under CUDA graphs").
Here each (token, expert) pair is a row of programs: the first kernel reads that expert's gate
and up rows and the token once and writes SiLU(gate) * up; the second reads the expert's down
rows and writes the output scaled by the routing weight, in float32; the pairs of a token are
summed in float32. Nothing is sorted, nothing leaves the device, and a CUDA graph holds it.

Registered as transformers' experts implementation ``"torch_cp_fused"``
(``model.set_experts_implementation("torch_cp_fused")``): steps of at most ``MAX_PAIRS``
(token, expert) pairs take the kernels, steps of at most ``MAX_GROUPED_PAIRS`` the kernels of
``grouped_experts`` (each routed expert read once), larger steps (prefill) ``sorted_experts``
(``grouped_mm``'s GEMMs) where a graph can hold them and torch's grouped GEMM takes their
shapes, else transformers' ``batched_mm``. Experts of other shapes (biases, transposed or
interleaved weights, another activation, a post-expert norm, expert parallelism) take
transformers' ``grouped_mm`` or ``batched_mm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from transformers.integrations import moe

from torch_cp import compat, pdl
from torch_cp.graphs import grouped_experts as ge
from torch_cp.graphs.experts import capturable, grouped_mm_fits
from torch_cp.graphs.pair_sums import sum_pairs
from torch_cp.graphs.sorted_experts import sorted_experts
from torch_cp.pdl import pdl_release, pdl_wait  # by name: Inductor copies them (pdl.py)

NAME = "torch_cp_fused"
MAX_PAIRS = 64  # (token, expert) pairs a step may have to take the kernels
# ... to take grouped_experts' kernels: measured faster than grouped_mm at 256 and 512 pairs (32
# and 64 tokens of top 8, runs 71 and 76); above, not measured.
MAX_GROUPED_PAIRS = 512


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch: ``rows`` weight rows and ``cols`` channels a program reads at a
    time, and its warps."""

    rows: int
    cols: int
    warps: int


# Picked by benchmarks/experts_tiles.py on the H200 (run 54, BENCHMARKS.md "MoE models under CUDA
# graphs"): the fastest at one token of either block, within 4 % of the fastest at eight. Small
# row tiles give many programs, so enough weight bytes are in flight at one token.
GATE_UP_TILES = Tiles(rows=8, cols=256, warps=8)
DOWN_TILES = Tiles(rows=16, cols=256, warps=8)


@triton.jit
def _rows_times(rows, vec_ptr, in_rows, length, BN: tl.constexpr, BK: tl.constexpr):
    """[BN] float32: each of ``BN`` weight rows (pointers ``rows`` [BN, 1], masked by
    ``in_rows``) times the vector at ``vec_ptr`` of ``length``, in ``BK`` chunks."""
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, length, BK):
        k = k0 + tl.arange(0, BK)
        in_k = k < length
        vec = tl.load(vec_ptr + k, mask=in_k, other=0.0).to(tl.float32)
        w = tl.load(rows + k[None, :], mask=in_rows[:, None] & in_k[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * vec[None, :], axis=1)
    return acc


@triton.jit
def _gate_up(x_ptr, w_ptr, ids_ptr, out_ptr, hidden, inter, x_st, w_se, w_sn, out_ss,
             TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # every program, before any load (torch_cp/pdl.py)
    pdl_release(PDL)
    # One loop over [2 * BN] rows, gate row j and up row j interleaved (2j, 2j + 1), so both
    # halves' loads are in flight together; split after.
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    r = tl.arange(0, 2 * BN)
    n = tl.program_id(1) * BN + r // 2
    in_n = n < inter
    rows = w_ptr + expert * w_se + (n + (r % 2) * inter)[:, None] * w_sn
    x = x_ptr + (pair // TOP_K) * x_st
    gate, up = tl.split(tl.reshape(_rows_times(rows, x, in_n, hidden, 2 * BN, BK), [BN, 2]))
    out = gate / (1.0 + tl.exp(-gate)) * up
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    tl.store(out_ptr + pair * out_ss + n, out.to(out_ptr.dtype.element_ty), mask=n < inter)


@triton.jit
def _down(h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, hidden, inter, h_ss, w_se, w_sm, out_ss,
          BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pdl_release(PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    m = tl.program_id(1) * BN + tl.arange(0, BN)
    in_m = m < hidden
    rows = w_ptr + expert * w_se + m[:, None] * w_sm
    acc = _rows_times(rows, h_ptr + pair * h_ss, in_m, inter, BN, BK)
    weight = tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * out_ss + m, acc * weight, mask=in_m)


def fits(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` have the layout the kernels read: concatenated [gate; up] rows
    ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], SiLU(gate) * up (transformers' default
    gate, not a class's own), no bias or post-expert norm."""
    return (experts.has_gate and experts.is_concatenated and not experts.is_transposed
            and not experts.has_bias and not experts.has_post_expert_norm
            and not experts._is_expert_parallel
            and type(experts.act_fn).__name__ in ("SiLU", "SiLUActivation")
            and compat.has_default_gate(experts)
            and experts.gate_up_proj.stride(-1) == 1 and experts.down_proj.stride(-1) == 1)


def fused_experts(experts: torch.nn.Module, x_td: torch.Tensor, ids_tk: torch.Tensor,
                  weights_tk: torch.Tensor, gate_up_tiles: Tiles | None = None,
                  down_tiles: Tiles | None = None) -> torch.Tensor:
    """The experts' output [T, H] for tokens ``x_td`` [T, H] routed to ``ids_tk`` [T, k] with
    ``weights_tk`` [T, k], through the two kernels (any T; ``fused_experts_forward`` decides
    when), at the given tiles or the module's ``GATE_UP_TILES`` / ``DOWN_TILES``."""
    tokens, hidden = x_td.shape
    top_k = ids_tk.shape[1]
    x_td = x_td if x_td.stride(-1) == 1 else x_td.contiguous()
    ids, weights = ids_tk.reshape(-1).contiguous(), weights_tk.reshape(-1).contiguous()
    gu, dn = gate_up_tiles or GATE_UP_TILES, down_tiles or DOWN_TILES
    args = (x_td, experts.gate_up_proj, experts.down_proj, ids, weights, top_k)
    if pdl.active(x_td):
        out_sd = _pairs_pdl(*args, gu.rows, gu.cols, gu.warps, dn.rows, dn.cols, dn.warps)
    else:
        out_sd = _pairs(*args, gu, dn, on_pdl=False)
    return sum_pairs(out_sd.view(tokens, top_k, hidden), x_td.dtype)


def _pairs(x_td: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
           weights: torch.Tensor, top_k: int, gu: Tiles, dn: Tiles, on_pdl: bool
           ) -> torch.Tensor:
    """Each (token, expert) pair's weighted output [T * k, H] in float32."""
    pairs, (hidden, inter) = ids.shape[0], down.shape[-2:]
    # fp32 experts keep SiLU(gate) * up in fp32 for bf16 tokens too, as transformers does.
    h_si = torch.empty(pairs, inter, dtype=torch.promote_types(x_td.dtype, gate_up.dtype),
                       device=x_td.device)
    _gate_up[(pairs, triton.cdiv(inter, gu.rows))](
        x_td, gate_up, ids, h_si, hidden, inter, x_td.stride(0), gate_up.stride(0),
        gate_up.stride(1), h_si.stride(0), TOP_K=top_k, BN=gu.rows, BK=gu.cols, PDL=on_pdl,
        num_warps=gu.warps, **pdl.launch_options(on_pdl))
    out_sd = torch.empty(pairs, hidden, dtype=torch.float32, device=x_td.device)
    _down[(pairs, triton.cdiv(hidden, dn.rows))](
        h_si, down, ids, weights, out_sd, hidden, inter, h_si.stride(0), down.stride(0),
        down.stride(1), out_sd.stride(0), BN=dn.rows, BK=dn.cols, PDL=on_pdl,
        num_warps=dn.warps, **pdl.launch_options(on_pdl))
    return out_sd


# Behind an op, the kernels are launched from here with the dependent launch (Inductor launches
# the Triton kernels it traces without launch options; torch_cp/gemv.py).
@torch.library.custom_op("torch_cp::fused_expert_pairs", mutates_args=())
def _pairs_pdl(x_td: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor, top_k: int, gu_rows: int, gu_cols: int, gu_warps: int,
               dn_rows: int, dn_cols: int, dn_warps: int) -> torch.Tensor:
    return _pairs(x_td, gate_up, down, ids, weights, top_k, Tiles(gu_rows, gu_cols, gu_warps),
                  Tiles(dn_rows, dn_cols, dn_warps), on_pdl=True)


@_pairs_pdl.register_fake
def _(x_td, gate_up, down, ids, weights, top_k, *tiles):
    return x_td.new_empty(ids.shape[0], down.shape[-2], dtype=torch.float32)


def fused_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-implementation signature: the pair kernels for a decode-sized step,
    ``grouped_experts`` for a mid-sized one, else ``sorted_experts`` (transformers' ``grouped_mm``
    for experts of another layout; ``batched_mm`` where a CUDA graph cannot hold those)."""
    pairs = top_k_index.numel()
    if pairs <= MAX_GROUPED_PAIRS and fits(self):
        kernels = fused_experts if pairs <= MAX_PAIRS else ge.grouped_experts
        return kernels(self, hidden_states, top_k_index, top_k_weights)
    w = self.down_proj
    if not (capturable("grouped_mm", w.dtype, w.device) and grouped_mm_fits(self)):
        return moe.batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    grouped = sorted_experts if fits(self) else moe.grouped_mm_experts_forward
    return grouped(self, hidden_states, top_k_index, top_k_weights)


moe.ALL_EXPERTS_FUNCTIONS.register(NAME, fused_experts_forward)
