"""Finding the parts of a transformers decoder model: its decoder layers, their MLPs and their
attention modules (what patching, TP sharding and regional compilation walk), and what a
module class's forward computes (its source)."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable

from torch import nn


@functools.cache
def forward_source(cls: type) -> str:
    """``cls.forward``'s source with every whitespace removed, read once per class ("" when it
    has none to read), for recognising transformers' forwards by the lines they run."""
    try:
        return re.sub(r"\s+", "", inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return ""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (modules with ``mlp`` and ``self_attn`` or, in hybrid models,
    ``linear_attn``), in module order."""
    return [m for m in model.modules() if hasattr(m, "mlp") and (
        hasattr(m, "self_attn") or hasattr(m, "linear_attn"))]


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP or MoE block."""
    return [m.mlp for m in decoder_layers(model)]


def attention_modules(model: nn.Module, class_names: Iterable[str]) -> list[nn.Module]:
    """The modules whose class is named in ``class_names``, in layer order."""
    names = frozenset(class_names)
    found = [m for m in model.modules() if type(m).__name__ in names]
    return sorted(found, key=lambda m: m.layer_idx)


def linear_modules(model: nn.Module, family) -> list[nn.Module]:
    """A hybrid model's linear-attention modules (the family's ``linear_classes``), in layer
    order; none for other families."""
    return attention_modules(model, getattr(family, "linear_classes", ()))
