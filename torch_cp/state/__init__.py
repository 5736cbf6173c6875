"""Linear-attention state of hybrid models (gated DeltaNet): the preallocated state pool and the
kernels that read and write it through a step plan's state slots."""

from torch_cp.state.pool import LinearGeometry, StatePool

__all__ = ["LinearGeometry", "StatePool"]
