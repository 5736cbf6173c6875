"""One backend per captured CUDA-graph bucket, chosen by the step plan's bucket.

Graph-ready FlashInfer wrappers own fixed buffers sized for one bucket, and a captured graph
replays the kernels of the wrappers it was captured with; so each bucket needs its own backend,
and planning a step must reach the backend its bucket's graph reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from torch_cp.attention.backend import AttentionBackend
from torch_cp.attention.partial import Partial
from torch_cp.plan import StepPlan

if TYPE_CHECKING:
    from torch_cp.graphs.buckets import Bucket


class BucketedBackend:
    """Routes each step to the backend of ``plan.graph_bucket``, or to the eager backend.

    Args:
        eager: the backend of steps that run eagerly.
        for_bucket: builds a graph-ready backend for a bucket and its page capacity; ``None``
            when the eager backend can be captured as it is (the torch reference reads only the
            plan's tensors).
    """

    def __init__(self, eager: AttentionBackend,
                 for_bucket: Callable[[Bucket, int], AttentionBackend] | None = None):
        self.eager = eager
        self.for_bucket = for_bucket
        self.buckets: dict[tuple[int, int, int], AttentionBackend] = {}
        self.active: AttentionBackend = eager

    @property
    def name(self) -> str:
        return self.eager.name

    @property
    def geometry(self):
        return self.eager.geometry

    @property
    def dtype(self):
        return getattr(self.eager, "dtype", None)

    def add_bucket(self, bucket: Bucket, max_pages: int) -> None:
        """Make a backend for ``bucket`` whose steps hold up to ``max_pages`` page ids (a no-op
        when the eager backend serves every shape). Keyed by all three: a later engine with
        wider page tables gets its own, and an earlier engine's graphs keep theirs."""
        key = (bucket.rows, bucket.tokens, max_pages)
        if self.for_bucket is not None and key not in self.buckets:
            self.buckets[key] = self.for_bucket(bucket, max_pages)

    def plan(self, plan: StepPlan) -> None:
        self.active = self.buckets.get(plan.graph_bucket, self.eager)
        self.active.plan(plan)

    def run_context(self, q: torch.Tensor, pool, layer_idx: int) -> Partial:
        return self.active.run_context(q, pool, layer_idx)

    def run_own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        return self.active.run_own(q, k, v)
