"""What a model family tells patch_model: how to validate, shard and run its attention."""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import nn

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.mesh import KVHeadLayout
from torch_cp.placement import ContextParallel


class Family(Protocol):
    """A model family (one module under models/ exports one instance, ``FAMILY``).

    Attributes:
        model_types: the ``config.model_type`` values it covers.
        kind: ``"gqa"`` (pool of K/V heads) or ``"mla"`` (latent pool).
        attention_classes: names of the Hugging Face attention classes it patches.
    """

    model_types: tuple[str, ...]
    kind: Literal["gqa", "mla"]
    attention_classes: tuple[str, ...]

    def kv_heads(self, config) -> int:
        """KV heads as placement sees them (MLA: 1, the latent head)."""
        ...

    def problems(self, config, tp: int) -> list[str]:
        """Configuration problems specific to this family (empty when fine)."""
        ...

    def geometry(self, config, tp: int, placement: ContextParallel) -> AttentionGeometry:
        """Per-rank attention shapes after sharding over ``tp`` ranks."""
        ...

    def shard_attention(self, attn: nn.Module, tp_rank: int, tp: int, layout: KVHeadLayout) -> None:
        """Slice this rank's heads out of the attention projections, in place (``torch_cp.tp``'s
        ``keep_out_features`` / ``keep_in_features``), ``o_proj``'s input columns included.

        ``patch_model`` then makes ``o_proj`` row-parallel (``torch_cp.tp.RowParallel``: all-reduce
        over TP, bias once) and shards each decoder layer's MLP/MoE with ``torch_cp.tp.shard_mlp``.
        It runs on meta models too (``torch_cp.from_pretrained`` shards before loading, and reads
        what each parameter recorded it keeps), so it must cut through ``torch_cp.tp``'s helpers
        and decide from shapes and the config alone, never from weight values.
        """
        ...

    def forward(self, attn: nn.Module, x_nd: torch.Tensor, cos_nd: torch.Tensor,
                sin_nd: torch.Tensor, pool, plan) -> torch.Tensor:
        """The patched attention of N packed tokens: projections (+ norms, RoPE),
        ``attn.cp_attention`` over ``pool`` with ``plan``, output projection (a row-parallel
        o_proj reduces over TP itself).

        x_nd: [N, hidden], N = the plan's tokens (bucket padding included); cos_nd, sin_nd:
        [N, rotary dim]. Returns [N, hidden]. ``torch_cp.hf.forward`` packs the Hugging Face
        module's [B, S] input into these and unpacks the result.
        """
        ...
