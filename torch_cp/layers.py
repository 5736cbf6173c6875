"""Finding the parts of a transformers decoder model: its decoder layers, their MLPs and their
attention modules (what patching, TP sharding and regional compilation walk)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (modules with ``self_attn`` and ``mlp``), in module order."""
    return [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP or MoE block."""
    return [m.mlp for m in decoder_layers(model)]


def attention_modules(model: nn.Module, class_names: Iterable[str]) -> list[nn.Module]:
    """The modules whose class is named in ``class_names``, in layer order."""
    names = frozenset(class_names)
    found = [m for m in model.modules() if type(m).__name__ in names]
    return sorted(found, key=lambda m: m.layer_idx)
