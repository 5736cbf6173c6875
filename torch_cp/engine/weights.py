"""Whether the weights changed since an engine's prefix cache was filled.

A cached page holds KV that the weights of its time computed. Loading other weights in place
(``load_state_dict``, ``param.copy_``: the fused linears keep reading them) would leave the
cache serving that KV to the next prompt with the same prefix (helper 110: other tokens than a
fresh engine's). Every in-place write bumps a tensor's version counter, so the sum of the
parameters' counters is a cheap watch (58 us for 400 parameters on this project's 2-core CPU
machine; read at each ``Engine.run`` and at serving steps with no request running). Parameters
replaced rather than written (``load_state_dict(assign=True)``) are seen at the next
``Engine.run``, which lists them again; ``Engine.reset_prefix_cache`` covers any other change.
"""

from __future__ import annotations

import torch
from torch import nn


def _version(params: list[torch.Tensor]) -> int:
    # Inference tensors (a model built under inference mode) keep no version counter.
    return sum(0 if p.is_inference() else p._version for p in params)


class WeightsWatch:
    """The parameters of ``model`` and their versions when last ``seen`` (nothing to watch
    when ``watching`` is False: an engine without a prefix cache)."""

    def __init__(self, model: nn.Module, watching: bool):
        self.model, self.watching = model, watching
        self.seen()

    def seen(self, relist: bool = True) -> None:
        """Record the weights as they are now (``relist``: list the parameters again)."""
        if relist:
            self._params = list(self.model.parameters()) if self.watching else []
        self._version = _version(self._params)

    def changed(self, relist: bool = False) -> bool:
        """Whether a watched parameter was written since ``seen`` (``relist``: or replaced)."""
        if not self.watching:
            return False
        if relist and [id(p) for p in self.model.parameters()] != [id(p) for p in self._params]:
            return True
        return _version(self._params) != self._version
