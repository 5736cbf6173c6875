"""MoE experts for prefill-sized steps: transformers' grouped GEMMs, torch_cp's combine.

The same as transformers' ``grouped_mm`` experts (pairs sorted by expert, counted on the device,
two grouped GEMMs) up to the down projection's output. Then a token's pairs are gathered back,
weighted and summed by ``pair_sums.sum_pairs``: compiled, one pointwise kernel in float32 (the
gather fused into it); eagerly as transformers does. transformers' combine, compiled, is a
reduction over the strided top-k dim that took 45 of a 256 ms prefill (Qwen3-30B-A3B, 32 x 512
tokens, run 78). For the experts ``fused_experts.fits`` accepts.
"""

from __future__ import annotations

import torch

from torch_cp import compat
from torch_cp.graphs.pair_sums import sum_pairs


def sorted_experts(experts: torch.nn.Module, x_td: torch.Tensor, ids_tk: torch.Tensor,
                   weights_tk: torch.Tensor) -> torch.Tensor:
    """The experts' output [T, H] for tokens ``x_td`` [T, H] routed to ``ids_tk`` [T, k] with
    ``weights_tk`` [T, k]."""
    tokens, top_k = ids_tk.shape
    num_experts = experts.down_proj.shape[0]
    ids_sorted, order = torch.sort(ids_tk.reshape(-1))
    # histc: counts that a CUDA graph can hold (bincount sizes its output on the host); on the CPU
    # it takes floats only.
    counts = torch.histc(ids_sorted.int() if ids_sorted.is_cuda else ids_sorted.float(),
                         bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate_up = compat.grouped_linear(x_td[order // top_k], experts.gate_up_proj, offsets)
    out_sh = compat.grouped_linear(experts._apply_gate(gate_up), experts.down_proj, offsets)
    place = torch.empty_like(order)  # each pair's row in the sorted order
    place[order] = torch.arange(order.numel(), device=order.device)
    return sum_pairs(out_sh[place].view(tokens, top_k, x_td.shape[-1]), x_td.dtype, weights_tk)
