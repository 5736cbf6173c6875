"""MoE experts for mid-sized decode steps: each routed expert's weights read once, by tiles.

At 32 to 64 tokens of Qwen3-30B-A3B (256-512 (token, expert) pairs over 128 experts), nearly
every expert is routed a few tokens. The pair-at-a-time kernels of ``fused_experts`` would read
an expert once per pair; transformers' ``grouped_mm`` reads each once, but sorts, counts and
gathers on the way, and its GEMMs are tiled for many rows. Here a program owns one expert and a
tile of its output channels, finds that expert's pairs itself (a compare and a prefix sum over
the step's expert ids, a few KB from L2), and multiplies up to ``pairs`` of them at a time with
the weight tile (``tl.dot``, float32 accumulators): nothing sorted, no host, and experts nobody
chose cost one read of the ids. The first kernel writes SiLU(gate) * up per pair, the second
the down projection times the routing weight in float32; a token's pairs are summed in float32,
as ``fused_experts`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GroupedTiles:
    """One kernel's launch: ``pairs`` routed rows per ``tl.dot`` (at least 16), ``rows`` weight
    rows (output channels) per program, ``cols`` of the reduction per step (each a power of two,
    as Triton's tiles are), and its warps."""

    pairs: int
    rows: int
    cols: int
    warps: int

    def __post_init__(self):
        problems = [f"{name} {value} is not a power of two >= 16" for name, value in
                    (("pairs", self.pairs), ("rows", self.rows), ("cols", self.cols))
                    if value < 16 or value & (value - 1)]
        if problems:
            raise ValueError("GroupedTiles: " + "; ".join(problems))


# Triton's interpreter (3.9) multiplies bfloat16 tiles in tl.dot wrongly (their bits as
# integers); there the tiles are multiplied in float32, as fp32 experts are everywhere.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Picked by ``python -m benchmarks.experts_tiles --grouped`` on the H200 (run 71): the least
# time summed over 32 and 64 tokens of the Qwen3-30B-A3B and GLM-4.7-Flash blocks.
GATE_UP_TILES = GroupedTiles(pairs=16, rows=64, cols=128, warps=4)
DOWN_TILES = GroupedTiles(pairs=16, rows=64, cols=64, warps=4)


@triton.jit
def _expert_pairs(ids_ptr, pairs, expert, NP: tl.constexpr):
    """The step's pairs routed to ``expert`` (mask [NP]), their order among them, their count."""
    p = tl.arange(0, NP)
    mine = tl.load(ids_ptr + p, mask=p < pairs, other=-1) == expert
    order = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    return mine, order, tl.sum(mine.to(tl.int32), axis=0)


@triton.jit
def _block_of(mine, order, block, NP: tl.constexpr, BM: tl.constexpr):
    """[BM] pair indices of the expert's pairs numbered ``block * BM`` onward, and their mask."""
    want = block * BM + tl.arange(0, BM)
    picked = (order[None, :] == want[:, None]) & mine[None, :]
    index = tl.sum(tl.where(picked, tl.arange(0, NP)[None, :], 0), axis=1)
    return index, tl.sum(picked.to(tl.int32), axis=1) > 0


@triton.jit
def _times_rows(acc, a_rows, in_a, w_rows, in_w, length, BK: tl.constexpr, FP32_DOT: tl.constexpr):
    """``acc`` [BM, BN] plus the vectors at ``a_rows`` [BM, 1] times the weight rows at
    ``w_rows`` [BN, 1] transposed, over ``length`` in ``BK`` chunks."""
    for k0 in range(0, length, BK):
        k = k0 + tl.arange(0, BK)
        in_k = k < length
        a = tl.load(a_rows + k[None, :], mask=in_a[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=in_w[:, None] & in_k[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _grouped_gate_up(x_ptr, w_ptr, ids_ptr, out_ptr, pairs, hidden, inter, x_st, w_se, w_sn,
                     out_ss, TOP_K: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, FP32_DOT: tl.constexpr):
    expert = tl.program_id(0)
    mine, order, count = _expert_pairs(ids_ptr, pairs, expert, NP)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    in_n = n < inter
    gate_rows = w_ptr + expert.to(tl.int64) * w_se + n[:, None] * w_sn
    up_rows = gate_rows + inter * w_sn
    for block in range(0, tl.cdiv(count, BM)):
        index, in_block = _block_of(mine, order, block, NP, BM)
        x_rows = x_ptr + (index // TOP_K)[:, None] * x_st
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        gate = _times_rows(zero, x_rows, in_block, gate_rows, in_n, hidden, BK, FP32_DOT)
        up = _times_rows(zero, x_rows, in_block, up_rows, in_n, hidden, BK, FP32_DOT)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + index[:, None] * out_ss + n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=in_block[:, None] & in_n[None, :])


@triton.jit
def _grouped_down(h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, pairs, hidden, inter, h_ss, w_se,
                  w_sm, out_ss, NP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, FP32_DOT: tl.constexpr):
    expert = tl.program_id(0)
    mine, order, count = _expert_pairs(ids_ptr, pairs, expert, NP)
    m = tl.program_id(1) * BN + tl.arange(0, BN)
    in_m = m < hidden
    rows = w_ptr + expert.to(tl.int64) * w_se + m[:, None] * w_sm
    for block in range(0, tl.cdiv(count, BM)):
        index, in_block = _block_of(mine, order, block, NP, BM)
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        acc = _times_rows(zero, h_ptr + index[:, None] * h_ss, in_block, rows, in_m, inter, BK,
                          FP32_DOT)
        weight = tl.load(weights_ptr + index, mask=in_block, other=0.0).to(tl.float32)
        tl.store(out_ptr + index[:, None] * out_ss + m[None, :], acc * weight[:, None],
                 mask=in_block[:, None] & in_m[None, :])


def grouped_experts(experts: torch.nn.Module, x_td: torch.Tensor, ids_tk: torch.Tensor,
                    weights_tk: torch.Tensor, gate_up_tiles: GroupedTiles | None = None,
                    down_tiles: GroupedTiles | None = None) -> torch.Tensor:
    """The experts' output [T, H] for tokens ``x_td`` [T, H] routed to ``ids_tk`` [T, k] with
    ``weights_tk`` [T, k], each routed expert's weights read once per ``pairs`` of its pairs
    (experts of the layout ``fused_experts.fits`` accepts). Every program scans all T * k ids
    (a [pairs, T * k] tile): meant for at most ``fused_experts.MAX_GROUPED_PAIRS``. Tiles: as
    given, else the module's ``GATE_UP_TILES`` / ``DOWN_TILES``."""
    tokens, hidden = x_td.shape
    top_k = ids_tk.shape[1]
    pairs = tokens * top_k
    gate_up, down = experts.gate_up_proj, experts.down_proj
    num_experts, inter = down.shape[0], down.shape[-1]
    x_td = x_td if x_td.stride(-1) == 1 else x_td.contiguous()
    ids, weights = ids_tk.reshape(-1).contiguous(), weights_tk.reshape(-1).contiguous()
    # tl.dot takes two tiles of one 16-bit dtype; fp32 or mixed dtypes multiply in fp32.
    one_16_bit = x_td.dtype == gate_up.dtype == down.dtype != torch.float32
    common = dict(NP=max(16, triton.next_power_of_2(pairs)),
                  FP32_DOT=INTERPRETED or not one_16_bit)
    h_si = torch.empty(pairs, inter, dtype=x_td.dtype, device=x_td.device)
    t = gate_up_tiles or GATE_UP_TILES
    _grouped_gate_up[(num_experts, triton.cdiv(inter, t.rows))](
        x_td, gate_up, ids, h_si, pairs, hidden, inter, x_td.stride(0), gate_up.stride(0),
        gate_up.stride(1), h_si.stride(0), TOP_K=top_k, BM=t.pairs, BN=t.rows, BK=t.cols,
        num_warps=t.warps, **common)
    out_sd = torch.empty(pairs, hidden, dtype=torch.float32, device=x_td.device)
    t = down_tiles or DOWN_TILES
    _grouped_down[(num_experts, triton.cdiv(hidden, t.rows))](
        h_si, down, ids, weights, out_sd, pairs, hidden, inter, h_si.stride(0), down.stride(0),
        down.stride(1), out_sd.stride(0), BM=t.pairs, BN=t.rows, BK=t.cols, num_warps=t.warps,
        **common)
    return out_sd.view(tokens, top_k, hidden).sum(dim=1).to(x_td.dtype)
