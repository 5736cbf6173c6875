"""Backend kernels behind torch.library custom ops, so torch.compile sees them as opaque calls
with known output shapes (the fake implementations) while the exchange and merge around them
trace as ordinary torch code.

A backend is stateful (it was planned for the step on the host), so the ops take an integer
handle to it. The pool's tensors are inputs of the ops, which orders them after the step's pool
write in a compiled graph; they are the whole pool with the layer's index, not a view of the
layer, so compiled decoder layers can share one graph (``torch_cp.graphs.compile``); backends
take them as they come (``AttentionBackend.run_context``).
"""

from __future__ import annotations

import weakref

import torch

from torch_cp.attention.backend import AttentionBackend

# Weak: a backend (and its FlashInfer workspaces) lives as long as the modules that use it.
_BACKENDS: weakref.WeakValueDictionary[int, AttentionBackend] = weakref.WeakValueDictionary()


def register_backend(backend: AttentionBackend) -> int:
    """The handle the custom ops know ``backend`` by."""
    handle = id(backend)
    _BACKENDS[handle] = backend
    return handle


@torch.library.custom_op("torch_cp::context_partial", mutates_args=())
def context_partial(q: torch.Tensor, caches: list[torch.Tensor], handle: int,
                    layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``backend.run_context``: q [N, H, Dk] over this partner's slots -> out [N, H, Dv], lse."""
    out, lse = _BACKENDS[handle].run_context(q, caches, layer_idx)
    return out.contiguous(), lse.contiguous()


# The fakes take Dv from the tensors, never from the backend: under regional compilation the
# handle is traced as a symbol once a second model's layers run the shared graphs.
@context_partial.register_fake
def _(q, caches, handle, layer_idx):
    return _fake_partial(q, caches[0].shape[-1])  # GQA kv [..., D]; MLA ckv [..., R]


@torch.library.custom_op("torch_cp::own_partial", mutates_args=())
def own_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                handle: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``backend.run_own``: q [N, H, Dk] over the step's own tokens, causally."""
    out, lse = _BACKENDS[handle].run_own(q, k, v)
    return out.contiguous(), lse.contiguous()


@own_partial.register_fake
def _(q, k, v, handle):
    return _fake_partial(q, v.shape[-1] if k.dim() == 3 else k.shape[-1])  # MLA: k = ckv [N, R]


def _fake_partial(q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, _ = q.shape
    return q.new_empty(n, h, dv), q.new_empty(n, h, dtype=torch.float32)
