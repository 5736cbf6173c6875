"""MoE experts for mid-sized decode steps: each routed expert's weights read once, by tiles.

At 32 to 64 tokens of Qwen3-30B-A3B (256-512 (token, expert) pairs over 128 experts), nearly
every expert is routed a few tokens. The pair-at-a-time kernels of ``fused_experts`` would read
an expert once per pair; transformers' ``grouped_mm`` reads each once, but sorts, counts and
gathers on the way, and its GEMMs are tiled for many rows. Here one small kernel (``align``)
lays the step's pairs out by expert in blocks of ``pairs`` slots, each expert's blocks after the
previous experts' (a count, a prefix sum and a scatter over the ids, a few KB, one program per
expert); then a program owns one block and a tile of its expert's output channels and multiplies
the block's pairs with the weight tile (``tl.dot``, float32 accumulators): nothing goes to the
host, and a hot expert (at worst every token routed to the same experts) is spread over as many
programs as it has blocks rather than walked through by one. The first kernel writes
SiLU(gate) * up per pair, the second the down projection times the routing weight in float32; a
token's pairs are summed in float32, as ``fused_experts`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from torch_cp.graphs.pair_sums import sum_pairs


@dataclass(frozen=True)
class GroupedTiles:
    """One kernel's launch: ``pairs`` routed rows per ``tl.dot`` (at least 16), ``rows`` weight
    rows (output channels) per program, ``cols`` of the reduction per step (each a power of two,
    as Triton's tiles are), its warps, and the reduction loop's pipeline ``stages`` (None:
    Triton's default)."""

    pairs: int
    rows: int
    cols: int
    warps: int
    stages: int | None = None

    def __post_init__(self):
        problems = [f"{name} {value} is not a power of two >= 16" for name, value in
                    (("pairs", self.pairs), ("rows", self.rows), ("cols", self.cols))
                    if value < 16 or value & (value - 1)]
        if self.stages is not None and self.stages < 1:
            problems.append(f"stages {self.stages} is not None or >= 1")
        if problems:
            raise ValueError("GroupedTiles: " + "; ".join(problems))

    def launch(self) -> dict:
        """The launch options Triton takes for these tiles."""
        return dict(num_warps=self.warps, **({} if self.stages is None
                                             else dict(num_stages=self.stages)))


# Triton's interpreter (3.9) multiplies bfloat16 tiles in tl.dot wrongly (their bits as
# integers); there the tiles are multiplied in float32, as fp32 experts are everywhere.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Picked by ``python -m benchmarks.experts_tiles --grouped`` on the H200: run 71 the least
# time summed over 32 and 64 tokens of the Qwen3-30B-A3B and GLM-4.7-Flash blocks; run 87 with
# pipeline stages for Qwen3-30B-A3B's block: the down projection's 128 columns a step took 5 us
# off a 258 / 294 us layer at 32 / 64 tokens, the gate/up's 128 rows a program 9 us at 64.
GATE_UP_TILES = GroupedTiles(pairs=16, rows=128, cols=128, warps=4, stages=3)
DOWN_TILES = GroupedTiles(pairs=16, rows=64, cols=128, warps=4, stages=3)


@triton.jit
def _align(ids_ptr, pairs, slots_ptr, block_experts_ptr, blocks_len, BM: tl.constexpr,
           NP: tl.constexpr, EP: tl.constexpr, NB: tl.constexpr):
    """Program ``e`` lays out expert e's pairs in blocks of ``BM`` slots after the blocks of the
    experts before it: ``slots`` [blocks_len * BM] pair indices (-1 pads a block's tail),
    ``block_experts`` [blocks_len] each block's expert (-1 where no expert needs the block)."""
    expert = tl.program_id(0)
    p = tl.arange(0, NP)
    # EP > experts: a bin of its own for the padding
    ids = tl.load(ids_ptr + p, mask=p < pairs, other=EP - 1).to(tl.int32)
    counts = tl.histogram(ids, EP)
    e = tl.arange(0, EP)
    blocks = tl.where(e < EP - 1, (counts + BM - 1) // BM, 0)
    start = tl.sum(tl.where(e < expert, blocks, 0), axis=0)
    mine = (ids == expert) & (p < pairs)
    order = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    count = tl.sum(mine.to(tl.int32), axis=0)
    tl.store(slots_ptr + start * BM + order, p, mask=mine)
    tail = count + tl.arange(0, BM)
    tl.store(slots_ptr + start * BM + tail, tl.full([BM], -1, tl.int32),
             mask=tail < (count + BM - 1) // BM * BM)
    b = tl.arange(0, NB)
    own = (b >= start) & (b * BM < start * BM + count)
    unused = (b >= tl.sum(blocks, axis=0)) & (b * 0 + expert == 0)  # written by program 0
    tl.store(block_experts_ptr + b, tl.where(own, expert, -1),
             mask=(own | unused) & (b < blocks_len))


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
def _block_pairs(slots_ptr, block, BM: tl.constexpr):
    """The block's [BM] slots: which hold a pair, and the pair indices (0 in the padding)."""
    slot = tl.load(slots_ptr + block * BM + tl.arange(0, BM))
    return slot >= 0, tl.maximum(slot, 0)


@triton.jit
def _weight_rows(w_ptr, expert, w_se, w_sr, size, BN: tl.constexpr):
    """This program's tile of ``BN`` of the expert's ``size`` weight rows: their indices, which
    exist, and pointers [BN, 1]."""
    r = tl.program_id(1) * BN + tl.arange(0, BN)
    return r, r < size, w_ptr + expert.to(tl.int64) * w_se + r[:, None] * w_sr


@triton.jit
def _grouped_gate_up(x_ptr, w_ptr, slots_ptr, block_experts_ptr, out_ptr, hidden, inter, x_st,
                     w_se, w_sn, out_ss, TOP_K: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, FP32_DOT: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= 0:
        in_block, index = _block_pairs(slots_ptr, block, BM)
        n, in_n, gate_rows = _weight_rows(w_ptr, expert, w_se, w_sn, inter, BN)
        x_rows = x_ptr + (index // TOP_K)[:, None] * x_st
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        gate = _times_rows(zero, x_rows, in_block, gate_rows, in_n, hidden, BK, FP32_DOT)
        up = _times_rows(zero, x_rows, in_block, gate_rows + inter * w_sn, in_n, hidden, BK,
                         FP32_DOT)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + index[:, None] * out_ss + n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=in_block[:, None] & in_n[None, :])


@triton.jit
def _grouped_down(h_ptr, w_ptr, slots_ptr, block_experts_ptr, weights_ptr, out_ptr, hidden, inter,
                  h_ss, w_se, w_sm, out_ss, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, FP32_DOT: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= 0:
        in_block, index = _block_pairs(slots_ptr, block, BM)
        m, in_m, rows = _weight_rows(w_ptr, expert, w_se, w_sm, hidden, BN)
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        acc = _times_rows(zero, h_ptr + index[:, None] * h_ss, in_block, rows, in_m, inter, BK,
                          FP32_DOT)
        weight = tl.load(weights_ptr + index, mask=in_block, other=0.0).to(tl.float32)
        tl.store(out_ptr + index[:, None] * out_ss + m[None, :], acc * weight[:, None],
                 mask=in_block[:, None] & in_m[None, :])


def align(ids: torch.Tensor, num_experts: int, pairs_per_block: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed pairs ``ids`` [P] (expert of each) grouped by expert into blocks of
    ``pairs_per_block``: slots [B * pairs_per_block] int32 (pair indices, -1 padding) and
    block_experts [B] int32 (-1: unused), B = cdiv(P, pairs_per_block) + min(experts, P), the
    most any routing needs. On the device, in one launch: no host sync, so a graph holds it."""
    pairs = ids.numel()
    blocks_len = triton.cdiv(pairs, pairs_per_block) + min(num_experts, pairs)
    slots = torch.empty(blocks_len * pairs_per_block, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(blocks_len, dtype=torch.int32, device=ids.device)
    _align[(num_experts,)](ids, pairs, slots, block_experts, blocks_len, BM=pairs_per_block,
                           NP=max(16, triton.next_power_of_2(pairs)),
                           EP=max(16, triton.next_power_of_2(num_experts + 1)),
                           NB=max(16, triton.next_power_of_2(blocks_len)))
    return slots, block_experts


def grouped_experts(experts: torch.nn.Module, x_td: torch.Tensor, ids_tk: torch.Tensor,
                    weights_tk: torch.Tensor, gate_up_tiles: GroupedTiles | None = None,
                    down_tiles: GroupedTiles | None = None) -> torch.Tensor:
    """The experts' output [T, H] for tokens ``x_td`` [T, H] routed to ``ids_tk`` [T, k] with
    ``weights_tk`` [T, k], each routed expert's weights read once per ``pairs`` of its pairs
    (experts of the layout ``fused_experts.fits`` accepts). ``align``'s programs each read all
    T * k ids: meant for at most ``fused_experts.MAX_GROUPED_PAIRS``. Tiles: as
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
    fp32_dot = INTERPRETED or not one_16_bit
    gate_up_tiles, down_tiles = gate_up_tiles or GATE_UP_TILES, down_tiles or DOWN_TILES
    layouts = {}
    for t in (gate_up_tiles, down_tiles):
        if t.pairs not in layouts:
            layouts[t.pairs] = align(ids, num_experts, t.pairs)
    h_si = torch.empty(pairs, inter, dtype=torch.promote_types(x_td.dtype, gate_up.dtype),
                       device=x_td.device)  # fp32 experts: fp32 up to the down projection
    t = gate_up_tiles
    slots, block_experts = layouts[t.pairs]
    _grouped_gate_up[(block_experts.numel(), triton.cdiv(inter, t.rows))](
        x_td, gate_up, slots, block_experts, h_si, hidden, inter, x_td.stride(0),
        gate_up.stride(0), gate_up.stride(1), h_si.stride(0), TOP_K=top_k, BM=t.pairs,
        BN=t.rows, BK=t.cols, FP32_DOT=fp32_dot, **t.launch())
    out_sd = torch.empty(pairs, hidden, dtype=torch.float32, device=x_td.device)
    t = down_tiles
    slots, block_experts = layouts[t.pairs]
    _grouped_down[(block_experts.numel(), triton.cdiv(hidden, t.rows))](
        h_si, down, slots, block_experts, weights, out_sd, hidden, inter, h_si.stride(0),
        down.stride(0), down.stride(1), out_sd.stride(0), BM=t.pairs, BN=t.rows, BK=t.cols,
        FP32_DOT=fp32_dot, **t.launch())
    return sum_pairs(out_sd.view(tokens, top_k, hidden), x_td.dtype)
