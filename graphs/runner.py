"""Capture a patched model's whole step per bucket and replay it after planning on the host.

Padding rows and tokens of a bucket point at the sink page (see ``build_step_plan``), so their
writes never touch a real page and their keys are masked from every real row.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from torch_cp.agreement import together
from torch_cp.compat import cache_kwarg
from torch_cp.graphs.buckets import pick_bucket
from torch_cp.graphs.experts import capturable_experts
from torch_cp.graphs.static_plan import StaticPlan
from torch_cp.plan import Bucket, StepPlan, build_step_plan

log = logging.getLogger("torch_cp")


def capture_stream(device) -> torch.cuda.Stream:
    """One side stream per device for every capture: cuBLAS keeps a workspace (32 MiB on
    Hopper) for each stream it ran on until the process ends, so a new stream per engine would
    leak one workspace per engine."""
    device = torch.device(device)
    return _stream_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _stream_of(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))


class _Captured:
    """One bucket's graph and its static inputs and outputs."""

    def __init__(self, bucket: Bucket, static: StaticPlan, device):
        self.bucket = bucket
        self.static = static
        self.input_ids = torch.zeros(1, bucket.tokens, dtype=torch.long, device=device)
        self.logit_tokens = torch.zeros(bucket.rows, dtype=torch.long, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None


class CUDAGraphRunner:
    """Runs a patched model's steps from CUDA graphs captured per bucket.

    Args:
        model: a model patched by ``torch_cp.patch_model`` on CUDA.
        cache: its ``PagedKVCache`` (the pool the graphs write and read).
        buckets: shapes to capture (``default_buckets``).

    Attributes:
        pad_token_id: the input id of padding tokens (their outputs are never read).
    """

    def __init__(self, model, cache, buckets: Sequence[Bucket]):
        if not buckets:
            raise ValueError("CUDAGraphRunner needs at least one bucket")
        capturable_experts(model)  # MoE experts a capture can hold, before any capture
        self.model = model
        self.cache = cache
        self.buckets = sorted(set(buckets))
        self.device = cache.runtime.device
        self.captured: dict[Bucket, _Captured] = {}
        self.pad_token_id = 0
        self.cache_kwarg = cache_kwarg(model)

    def _plan(self, bucket: Bucket, q_lens, ctx_lens, tables, state_slots=None) -> StepPlan:
        pool, state = self.cache.pool, self.cache.state
        if state is not None and state_slots is None:
            state_slots = []  # a capture step: every row is padding, on the sink slot
        return build_step_plan(q_lens, ctx_lens, tables, page_size=pool.page_size,
                               sink_page=pool.sink_page, placement=self.cache.runtime.placement,
                               device=self.device, bucket=bucket, state_slots=state_slots,
                               sink_slot=None if state is None else state.sink_slot)

    def _forward(self, c: _Captured) -> torch.Tensor:
        out = self.model(input_ids=c.input_ids, position_ids=c.static.plan.positions[None],
                         use_cache=False, logits_to_keep=c.logit_tokens,
                         **{self.cache_kwarg: self.cache})
        return out.logits[0]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool. Every row of a capture step is
        padding, so its writes land on the sink page.

        Under torchrun a capture that fails on one rank (out of memory: the graphs' pool is new
        memory beside what the warm-up steps cached) raises on every rank before the next
        bucket's warm-up (``agreement.together``): a capture only records its collectives, so the
        other ranks finish theirs, while a warm-up runs them and would wait for ever."""
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        runtime = self.cache.runtime
        for bucket in sorted(self.buckets, reverse=True):
            c = self._warmed(bucket, stream)
            together(runtime.spans_ranks, runtime.device,
                     f"capturing the CUDA graph of {bucket}",
                     functools.partial(self._record, c, pool, stream))
            self.captured[bucket] = c
        torch.cuda.synchronize(self.device)
        log.info("torch_cp: captured %d CUDA-graph buckets", len(self.captured))

    def _warmed(self, bucket: Bucket, stream: torch.cuda.Stream) -> _Captured:
        """``bucket``'s static buffers and kernels, its step run twice outside any capture (lazy
        initialisation, compilation)."""
        self.cache.runtime.backend.add_bucket(bucket)
        static = StaticPlan(self._plan(bucket, [], [], []))
        c = _Captured(bucket, static, self.device)
        self.cache.begin_step(static.plan)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(c)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return c

    def _record(self, c: _Captured, pool, stream: torch.cuda.Stream) -> None:
        with torch.cuda.graph(c.graph, pool=pool, stream=stream):
            c.logits = self._forward(c)

    def bucket_for(self, q_lens: Sequence[int], table_width: int) -> Bucket | None:
        decode = all(q == 1 for q in q_lens)
        return pick_bucket(list(self.captured), len(q_lens), sum(q_lens), decode, table_width)

    @torch.inference_mode()
    def step(self, token_ids: Sequence[int], q_lens: Sequence[int], ctx_lens: Sequence[int],
             tables: Sequence[Sequence[int]], logit_rows: Sequence[int],
             state_slots: Sequence[int] | None = None) -> torch.Tensor | None:
        """Run one step from its bucket's graph (``prepare``, then ``launch``).

        Args:
            token_ids: the step's new tokens, row after row.
            q_lens, ctx_lens, tables: per row, as for ``build_step_plan``.
            logit_rows: rows whose last token's logits are wanted.
            state_slots: a hybrid model's state slot of each row.
        Returns:
            [len(logit_rows), vocab] logits, or None when no captured bucket fits (run eagerly).
        """
        plan = self.prepare(q_lens, ctx_lens, tables, state_slots)
        if plan is None:
            return None
        return self.launch(plan, token_ids, logit_rows)

    @torch.inference_mode()
    def prepare(self, q_lens: Sequence[int], ctx_lens: Sequence[int],
                tables: Sequence[Sequence[int]],
                state_slots: Sequence[int] | None = None) -> StepPlan | None:
        """Plan a step into its bucket's static buffers and plan the backend: the plan (on the
        buffers, carrying its bucket), or None when no captured bucket fits. Host work plus
        stream-ordered copies: it may run while an earlier replay still executes (the copies
        land after it; their host sources are pinned, so they do not wait for it)."""
        bucket = self.bucket_for(q_lens, max((len(t) for t in tables), default=0))
        if bucket is None:
            return None
        plan = self.captured[bucket].static.load(
            self._plan(bucket, q_lens, ctx_lens, tables, state_slots))
        self.cache.begin_step(plan)
        return plan

    @torch.inference_mode()
    def launch(self, plan: StepPlan, token_ids: Sequence[int] | torch.Tensor,
               logit_rows: Sequence[int]) -> torch.Tensor:
        """Replay a prepared step: [len(logit_rows), vocab] logits (computed asynchronously).
        ``token_ids``: host ints, or a 1-D tensor on the device (copied on the stream)."""
        c = self.captured[plan.bucket]
        ends = plan.qo_indptr_host[1:].long() - 1
        c.input_ids.fill_(self.pad_token_id)
        _copy_in(c.input_ids[0, : len(token_ids)], token_ids)
        c.logit_tokens.zero_()
        _copy_in(c.logit_tokens[: len(logit_rows)], ends[list(logit_rows)])
        c.graph.replay()
        return c.logits[: len(logit_rows)]


def _copy_in(dst: torch.Tensor, values: Sequence[int] | torch.Tensor) -> None:
    """A stream-ordered copy into a static input. Host values go through pinned memory: a copy
    from pageable memory would first wait for every replay still queued on the stream."""
    src = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    if src.device.type == "cpu" and dst.device.type == "cuda":
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)
