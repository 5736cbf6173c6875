"""The forward a patched attention module runs: Hugging Face's ``[B, S]`` tokens packed into the
step plan's tokens, the family's attention over the pool, and the result unpacked again."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch_cp.hf.cache import paged_cache_from
from torch_cp.plan import StepPlan


def pack_tokens(plan: StepPlan, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None):
    """hidden_states [B, S, hidden] and (cos, sin) [B or 1, S, rot] -> the plan's N tokens:
    (x_nd [N, hidden], cos_nd [N, rot], sin_nd [N, rot]), or x_nd alone when
    ``position_embeddings`` is None. A padded input (``plan.token_index``) gives its real
    tokens, then zeros up to the plan's bucket."""
    b, s, hidden = hidden_states.shape
    packed = [hidden_states.reshape(b * s, hidden)]
    if position_embeddings is not None:
        packed += [t.expand(b, s, t.shape[-1]).reshape(b * s, -1) for t in position_embeddings]
    index = plan.token_index
    n = plan.positions.shape[0]  # the plan's tokens, bucket padding included
    if index is not None:
        pad = (0, 0, 0, n - index.shape[0])
        packed = [F.pad(t[index], pad) for t in packed]
    if packed[0].shape[0] != n:
        raise ValueError(f"the step plan has {n} tokens but the model input gives "
                         f"{packed[0].shape[0]}: pass token_index for a padded [B, S] input")
    return tuple(packed) if position_embeddings is not None else packed[0]


def unpack_tokens(plan: StepPlan, out_nd: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """[N, hidden] -> [B, S, hidden]; tokens outside ``plan.token_index`` get zeros."""
    index = plan.token_index
    if index is None:
        return out_nd.view(batch, seq, -1)
    full = out_nd.new_zeros(batch * seq, out_nd.shape[-1])
    return full.index_copy(0, index, out_nd[: index.shape[0]]).view(batch, seq, -1)


def no_tokens(plan: StepPlan) -> bool:
    """Whether the step has no token to attend or cache (a ``model.generate`` prefill chunk of
    left padding only): every rank's layers then skip their attention alike, collectives too."""
    return plan.positions.shape[0] == 0


def patched_forward(family, attn: nn.Module):
    """The forward that replaces ``attn.forward``: takes what the Hugging Face decoder layer
    passes and runs ``family.forward`` over the ``PagedKVCache``'s pool and plan."""
    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        paged = paged_cache_from(cache if cache is not None else past_key_values)
        plan = paged.plan
        batch, seq, _ = hidden_states.shape
        if no_tokens(plan):
            return torch.zeros_like(hidden_states), None  # the residual's width
        x_nd, cos_nd, sin_nd = pack_tokens(plan, hidden_states, position_embeddings)
        out_nd = family.forward(attn, x_nd, cos_nd, sin_nd, paged.pool, plan)
        return unpack_tokens(plan, out_nd, batch, seq), None
    return forward


def patched_linear_forward(family, mod: nn.Module):
    """The forward that replaces a hybrid model's linear-attention (gated DeltaNet) module's:
    the family's ``linear_forward`` over the cache's state pool, with the plan's state slots."""
    def forward(hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
        paged = paged_cache_from(cache if cache is not None else cache_params)
        plan = paged.plan
        batch, seq, _ = hidden_states.shape
        if no_tokens(plan):
            return torch.zeros_like(hidden_states)
        x_nd = pack_tokens(plan, hidden_states, None)
        out_nd = family.linear_forward(mod, x_nd, paged.state, plan)
        return unpack_tokens(plan, out_nd, batch, seq)
    return forward
