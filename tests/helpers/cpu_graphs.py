"""Captured buckets stood in for on the CPU: ``EagerReplayRunner`` is the engine's
``CUDAGraphRunner`` (its buckets, one ``StaticPlan`` per bucket, ``prepare`` loading each step's
plan into the bucket's static buffers and ``launch`` filling its static inputs) whose "capture"
makes the buffers and whose "replay" runs the model eagerly over them into a fixed logits buffer,
as a graph reads and writes its static tensors. As in a graph, the model's Python sees the
capture step's host-side plan fields (``HOST_FIELDS``: a graph keeps the shapes and host values
it was recorded with) and the live step only through the device buffers. What a CPU cannot show
(stream order, the kernels themselves) the GPU tests do; what it can (stale static buffers,
padding rows and columns, host values a replay cannot change, a step launched ahead over reused
buffers) the engine then meets on every CI run."""

from __future__ import annotations

import dataclasses

import torch

from torch_cp.engine.steps import StepLauncher
from torch_cp.graphs.runner import CUDAGraphRunner
from torch_cp.graphs.static_plan import StaticPlan

# What a captured graph froze at capture: host values its Python read then (helper 100: the
# hybrid state ops read qo_indptr_host in Python, so a multi-token step of a hybrid model
# cannot replay, which Engine refuses; the eager replay of the live plan had hidden it).
HOST_FIELDS = ("num_rows", "num_tokens", "context_host", "qo_indptr_host", "is_decode",
               "attends_context", "token_index")


class _EagerGraph:
    def __init__(self, runner: EagerReplayRunner, captured: _Captured):
        self.runner, self.captured = runner, captured

    def replay(self) -> None:
        c, cache = self.captured, self.runner.cache
        live = cache.plan
        seen = dataclasses.replace(live, **{f: getattr(c.static.plan, f) for f in HOST_FIELDS})
        cache.plan = seen
        if cache.state is not None:
            cache.state.step = seen
        # A graph replays with whatever the backend holds: the forward must not plan it again
        # (``claim_backend``), or a launch that failed to claim it would pass here (helper 111).
        held, cache.runtime.planned_for = cache.runtime.planned_for, seen
        try:
            logits = self.runner._forward(c)
        finally:
            cache.runtime.planned_for = held
            cache.plan = live
            if cache.state is not None:
                cache.state.step = live
        if c.logits is None:
            c.logits = logits.clone()
        else:
            c.logits.copy_(logits)


class _Captured:
    def __init__(self, runner: EagerReplayRunner, bucket, static: StaticPlan):
        self.bucket, self.static = bucket, static
        self.input_ids = torch.zeros(1, bucket.tokens, dtype=torch.long)
        self.logit_tokens = torch.zeros(bucket.rows, dtype=torch.long)
        self.logits = None
        self.graph = _EagerGraph(runner, self)


class EagerReplayRunner(CUDAGraphRunner):
    @torch.inference_mode()
    def capture(self) -> None:
        for bucket in sorted(self.buckets, reverse=True):
            self.cache.runtime.backend.add_bucket(bucket)
            c = _Captured(self, bucket, StaticPlan(self._plan(bucket, [], [], [])))
            self.cache.begin_step(c.static.plan)
            c.graph.replay()  # a capture step: every row padding, writing the sink page only
            self.captured[bucket] = c


def with_eager_buckets(engine, buckets) -> EagerReplayRunner:
    """``engine`` (made without ``cuda_graphs``) stepping through ``buckets`` as a captured
    engine does: steps a bucket fits replay it, the others run eagerly."""
    runner = EagerReplayRunner(engine.model, engine.cache, buckets)
    runner.capture()
    engine.runner = runner
    engine.launcher = StepLauncher(engine.model, engine.cache, runner)
    return runner
