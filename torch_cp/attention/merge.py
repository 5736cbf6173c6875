"""The partner merge: FlashInfer's ``merge_states`` (one kernel) where it applies, else torch.

``merge_states`` takes ``v [N, S, H, D]`` and base-2 ``s [N, S, H]``; its thread block is
``(D / vec, H)``, so at bf16/fp16 it launches only up to 64 heads at D = 128 and 32 heads at
D = 512 (``MERGE_STATES_MAX_HEADS``); other shapes and dtypes merge in torch
(``merge_partials``). A partial with no keys (lse -inf) would make its max -inf and the merge
NaN where every partial of a row is empty, so -inf enters as ``EMPTY_LSE``: an empty partial then
weighs exactly 0 beside any real one, and a row with no keys at all merges to out 0, lse -inf as
the torch merge gives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.partial import Partial, merge_partials

MERGE_STATES_MAX_HEADS = {128: 64, 512: 32}
EMPTY_LSE = -1e30  # exp2(EMPTY_LSE - m) == 0 in float32 for every real lse m


@torch.library.custom_op("torch_cp::merge_states", mutates_args=())
def merge_states(out_snhd: torch.Tensor, lse_snh: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's merge of S partials, [S, N, H, D] and [S, N, H] -> [N, H, D], [N, H]."""
    import flashinfer

    v = out_snhd.transpose(0, 1).contiguous()
    s = lse_snh.float().clamp_min(EMPTY_LSE).transpose(0, 1).contiguous()
    out, lse = flashinfer.merge_states(v, s)
    return out, torch.where(lse > EMPTY_LSE / 2, lse, float("-inf"))


@merge_states.register_fake
def _(out_snhd, lse_snh):
    return out_snhd.new_empty(out_snhd.shape[1:]), lse_snh.new_empty(lse_snh.shape[1:],
                                                                     dtype=torch.float32)


def flashinfer_merge(out_snhd: torch.Tensor, lse_snh: torch.Tensor) -> Partial:
    return Partial(*merge_states(out_snhd, lse_snh))


def merge_states_applies(geometry: AttentionGeometry, dtype: torch.dtype) -> bool:
    """Whether ``merge_states`` launches for this rank's merged heads (``q_heads``)."""
    limit = MERGE_STATES_MAX_HEADS.get(geometry.head_dim_v, 0)
    return dtype in (torch.bfloat16, torch.float16) and geometry.q_heads <= limit


def partner_merge(backend) -> Callable[[torch.Tensor, torch.Tensor], Partial]:
    """The merge of P partners' partials for layers run by ``backend``."""
    dtype = getattr(backend, "dtype", None)
    if backend.name == "flashinfer" and merge_states_applies(backend.geometry, dtype):
        return flashinfer_merge
    return merge_partials
