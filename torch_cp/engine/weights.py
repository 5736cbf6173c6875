"""Whether the weights changed since an engine's prefix cache was filled.

A cached page holds KV that the weights of its time computed. Loading other weights in place
(``load_state_dict``, ``param.copy_``: the fused linears keep reading them) would leave the
cache serving that KV to the next prompt with the same prefix (helper 110: other tokens than a
fresh engine's). Every in-place write bumps a tensor's version counter, so the sum of the
parameters' counters is a cheap watch, read at each ``Engine.run`` and at serving steps with no
request running, together with the parameters' identity (``load_state_dict(assign=True)``
replaces them). Not seen: writes through ``.data`` and collectives into the parameters (a
``dist.broadcast`` from the rank that loaded them: ``Engine.run`` empties the cache where any
rank saw a change); ``Engine.reset_prefix_cache`` covers those.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


def _version(params: list[torch.Tensor]) -> int:
    # Inference tensors (a model built under inference mode) keep no version counter.
    return sum(0 if p.is_inference() else p._version for p in params)


class WeightsWatch:
    """The parameters of ``model`` (weakly: replaced ones are freed) and their versions when
    last ``seen``; nothing to watch when ``watching`` is False (no prefix cache)."""

    def __init__(self, model: nn.Module, watching: bool):
        self.model, self.watching = model, watching
        self.seen()

    def seen(self) -> None:
        """Record the weights as they are now."""
        params = list(self.model.parameters()) if self.watching else []
        self._refs = [weakref.ref(p) for p in params]
        self._version = _version(params)

    def changed(self) -> bool:
        """Whether a parameter was written in place or replaced since ``seen``."""
        if not self.watching:
            return False
        params = list(self.model.parameters())
        return (len(params) != len(self._refs)
                or any(r() is not p for r, p in zip(self._refs, params))
                or _version(params) != self._version)
