"""Argument values as every layer reads them (the engine's prompts and ``max_new_tokens``, the
Hugging Face bridge's ``new_cache`` sizes): one reader, below both."""

from __future__ import annotations

import operator

import torch


def as_int(value) -> int | None:
    """``value`` as an int (Python's, NumPy's or a 0-d tensor's integer), or None: bools, of
    any kind, are not ints, nor is a one-element tensor of one or more dims (``[5]``: a row of
    one token id, which ``operator.index`` would take as the id)."""
    if (isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool
            or getattr(value, "ndim", 0) != 0):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def positive_int(value) -> int | None:
    """``value`` as an int >= 1 (``as_int``'s kinds), or None."""
    n = as_int(value)
    return n if n is not None and n >= 1 else None


def plain_int(value):
    """``value`` as a Python int where it is an int of another kind (NumPy's, a 0-d tensor's:
    sizes computed with NumPy or torch), else unchanged, for the checks to name as it is."""
    n = as_int(value)
    return value if n is None else n
