"""Merges of partials with FlashInfer's kernels where they apply, else in torch.

The partner merge runs ``merge_states`` (S partials, one kernel); a multi-token step's merge of
its context partial with its own tokens' runs ``merge_state`` (two partials, one kernel): in
torch (``merge_two``) it takes several full-size float32 passes, about 0.25 s of a 2.4 s prefill
of 16 x 4096 tokens on Qwen3-8B against 13 ms (BENCHMARKS.md, runs 27 and 29).

``merge_states`` takes ``v [N, S, H, D]`` and base-2 ``s [N, S, H]``; its thread block is
``(D / vec, H)``, so at bf16/fp16 it launches only up to 64 heads at D = 128 and 32 heads at
D = 512 (``MERGE_STATES_MAX_HEADS``); other shapes and dtypes merge in torch
(``merge_partials``). A partial with no keys (lse -inf) would make its max -inf and the merge
NaN where every partial of a row is empty, so -inf enters as ``EMPTY_LSE``: an empty partial then
weighs exactly 0 beside any real one, and a row with no keys at all merges to out 0, lse -inf as
the torch merge gives.

``merge_state`` merges every (token, head) on its own, so a contiguous ``[N, H, D]`` partial is
viewed as ``[N * H / h, h, D]`` with ``h`` the largest divisor of ``H`` the kernel launches:
no head limit for the two-partial merge.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.partial import Partial, merge_partials, merge_two

MERGE_STATES_MAX_HEADS = {128: 64, 512: 32}
EMPTY_LSE = -1e30  # exp2(EMPTY_LSE - m) == 0 in float32 for every real lse m


def _kernel_lse(lse: torch.Tensor) -> torch.Tensor:
    """float32 LSE with -inf (no keys) as ``EMPTY_LSE``, for FlashInfer's merges."""
    return lse.float().clamp_min(EMPTY_LSE)


def _empty_as_inf(lse: torch.Tensor) -> torch.Tensor:
    """A merged LSE with -inf again where every partial was empty."""
    return torch.where(lse > EMPTY_LSE / 2, lse, float("-inf"))


@torch.library.custom_op("torch_cp::merge_states", mutates_args=())
def merge_states(out_snhd: torch.Tensor, lse_snh: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's merge of S partials, [S, N, H, D] and [S, N, H] -> [N, H, D], [N, H]."""
    import flashinfer

    v = out_snhd.transpose(0, 1).contiguous()
    s = _kernel_lse(lse_snh).transpose(0, 1).contiguous()
    out, lse = flashinfer.merge_states(v, s)
    return out, _empty_as_inf(lse)


@merge_states.register_fake
def _(out_snhd, lse_snh):
    return out_snhd.new_empty(out_snhd.shape[1:]), lse_snh.new_empty(lse_snh.shape[1:],
                                                                     dtype=torch.float32)


@torch.library.custom_op("torch_cp::merge_state", mutates_args=())
def merge_state(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's merge of two partials of the same queries: [N, H, D] and [N, H] each."""
    import flashinfer

    n, heads, dim = out_a.shape
    block = max(h for h in range(1, MERGE_STATES_MAX_HEADS[dim] + 1) if heads % h == 0)
    shape = (n * heads // block, block)

    def flat(out, lse):
        return (out.contiguous().view(*shape, dim),
                _kernel_lse(lse).contiguous().view(shape))

    out, lse = flashinfer.merge_state(*flat(out_a, lse_a), *flat(out_b.to(out_a.dtype), lse_b))
    return out.view(n, heads, dim), _empty_as_inf(lse).view(n, heads)


@merge_state.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape, dtype=torch.float32)


def flashinfer_merge_two(a: Partial, b: Partial) -> Partial:
    return Partial(*merge_state(a.out, a.lse, b.out, b.lse))


def flashinfer_merge(out_snhd: torch.Tensor, lse_snh: torch.Tensor) -> Partial:
    return Partial(*merge_states(out_snhd, lse_snh))


def _flashinfer_merges(backend) -> bool:
    return backend.name == "flashinfer" and backend.dtype in (torch.bfloat16, torch.float16)


def merge_states_applies(geometry: AttentionGeometry, dtype: torch.dtype | None) -> bool:
    """Whether ``merge_states`` launches for this rank's merged heads (``q_heads``)."""
    limit = MERGE_STATES_MAX_HEADS.get(geometry.head_dim_v, 0)
    return dtype in (torch.bfloat16, torch.float16) and geometry.q_heads <= limit


def partner_merge(backend) -> Callable[[torch.Tensor, torch.Tensor], Partial]:
    """The merge of P partners' partials for layers run by ``backend``."""
    if _flashinfer_merges(backend) and merge_states_applies(backend.geometry, backend.dtype):
        return flashinfer_merge
    return merge_partials


def own_tokens_merge(backend) -> Callable[[Partial, Partial], Partial]:
    """The merge of a multi-token step's context partial with its own tokens' partial."""
    if _flashinfer_merges(backend) and backend.geometry.head_dim_v in MERGE_STATES_MAX_HEADS:
        return flashinfer_merge_two
    return merge_two
