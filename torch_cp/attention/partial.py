"""Partials of attention and their exact merge. LSE is base 2 everywhere (FlashInfer's way)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Partial(NamedTuple):
    """Attention of some queries over a subset of keys.

    out: [N, H, Dv] softmax-weighted values over the subset (0 where the subset is empty).
    lse: [N, H] float32 ``log2(sum(exp(scale * q.k)))`` over the subset (-inf where empty).
    """

    out: torch.Tensor
    lse: torch.Tensor


def merge_partials(out_snhd: torch.Tensor, lse_snh: torch.Tensor) -> Partial:
    """Merge S partials of the same queries exactly; empty partials change nothing and give no NaN.

    Args:
        out_snhd: [S, N, H, Dv]; lse_snh: [S, N, H] base-2 LSE.
    Returns:
        The partial over the union of the S key subsets; ``out`` keeps ``out_snhd``'s dtype.
    """
    lse = lse_snh.float()
    top = lse.amax(0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp2(lse - top)  # [S, N, H]; 0 for empty partials
    total = weight.sum(0)
    weighted = torch.where(weight.unsqueeze(-1) > 0, weight.unsqueeze(-1) * out_snhd.float(),
                           torch.zeros((), dtype=torch.float32, device=out_snhd.device))
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    out = weighted.sum(0) / safe_total.unsqueeze(-1)
    merged_lse = torch.where(total > 0, top + torch.log2(safe_total),
                             torch.full_like(total, float("-inf")))
    return Partial(out.to(out_snhd.dtype), merged_lse)


def merge_two(a: Partial, b: Partial) -> Partial:
    return merge_partials(torch.stack((a.out, b.out.to(a.out.dtype))), torch.stack((a.lse, b.lse)))
