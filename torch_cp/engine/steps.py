"""Planning and launching one engine step, eagerly or from a CUDA-graph bucket.

Planning is host work (``build_step_plan``, ``backend.plan``, copies into the bucket's static
buffers) and a launch only enqueues device work, so the engine can plan step n + 1 while step n
runs on the device (``Engine(overlap_planning=True)``): everything planning writes on the device
is a stream-ordered copy that lands after step n's kernels, and FlashInfer's pinned host buffers
are fenced (``flashinfer_common.PlanFence``). The host indptrs FlashInfer's plan copies are pinned
too (``plan._upload``): a copy from pageable memory would first wait for step n.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torch_cp.compat import cache_kwarg
from torch_cp.engine.feedback import max_positions, status
from torch_cp.engine.scheduler import Row
from torch_cp.hf.cache import PagedKVCache
from torch_cp.layers import decoder_layers
from torch_cp.plan import StepPlan, build_step_plan


def graph_runner(model, cache: PagedKVCache, rows: int, table_width: int | None,
                    mixed_buckets, compile: bool, progress: bool):
    """A ``CUDAGraphRunner`` with every decode bucket up to ``rows`` rows (and
    ``mixed_buckets``) captured, the decoder layers compiled first with ``compile``; status
    lines while it works (``progress``). ``table_width``: pages of a bucket's row (None:
    ``default_table_width``)."""
    from torch_cp.graphs import CUDAGraphRunner, compiled_layers, default_buckets

    width = table_width or default_table_width(model, cache.pool.num_pages, cache.pool.page_size)
    buckets = default_buckets(rows, width, mixed_buckets)
    runner = CUDAGraphRunner(model, cache, buckets)
    status(f"capturing CUDA graphs of {len(buckets)} step buckets" + (
        ", compiling the decoder layers first (torch.compile: minutes)" if compile else ""),
        progress)
    began = time.perf_counter()
    with compiled_layers(model) if compile else contextlib.nullcontext():
        runner.capture()
    status(f"captured in {time.perf_counter() - began:.1f} s", progress)
    return runner


def default_table_width(model, num_pages: int, page_size: int) -> int:
    """Pages of a captured bucket's row when the engine is not told: the model's positions
    (``feedback.max_positions``: ``max_position_embeddings``, or more with scaled RoPE) in
    pages, at most the pool; a longer row runs eagerly. The whole pool would size every
    bucket's static table and the backends' page-id buffers at rows x pool pages (64 rows over
    a pool of 540k pages: about 0.3 GB of int32 ids in the tables alone)."""
    limit = max_positions(model)
    return num_pages if not limit else min(num_pages, -(-limit // page_size))


def row_key(rows: Sequence[Row]) -> tuple[tuple[int, int, int], ...]:
    """What a step's plan depends on besides the page tables: (request, start, length) per row."""
    return tuple((r.request, r.start, r.length) for r in rows)


@dataclass(frozen=True)
class PlannedStep:
    """A step whose plan is loaded (``cache.begin_step`` ran): ready to launch.

    Attributes:
        key: ``row_key`` of the rows it was planned for.
        plan: its step plan; one with a bucket replays that bucket's graph (its tensors are
            the bucket's static buffers), one without runs eagerly.
    """

    key: tuple[tuple[int, int, int], ...]
    plan: StepPlan


class StepLauncher:
    """Plans and launches a patched model's steps over one pool.

    Args:
        model: the patched model; cache: its ``PagedKVCache``.
        runner: a ``CUDAGraphRunner`` over the same cache, or None (every step eager).
        compile: run the steps no bucket fits (long prefills) through the compiled decoder
            layers too (``compiled_layers``): Inductor fuses their norms, RoPE and activations,
            which take a third of an eager prefill's kernel time. Token counts vary, so the
            layers compile once more with a dynamic token dimension (Dynamo's automatic dynamic
            shapes) and then serve every length.
    """

    def __init__(self, model, cache: PagedKVCache, runner=None, compile: bool = False):
        self.model = model
        self.cache = cache
        self.runner = runner
        self._layers_to_compile = decoder_layers(model) if compile else None
        self.runtime = cache.runtime
        self._cache_kwarg = cache_kwarg(model)

    def plan(self, rows: Sequence[Row], tables: Sequence[Sequence[int]],
             state_slots: Sequence[int] | None = None) -> PlannedStep:
        """Plan ``rows`` (page tables ``tables``; a hybrid model's state slots
        ``state_slots``): into a captured bucket when one fits."""
        q_lens, ctx_lens = [r.length for r in rows], [r.start for r in rows]
        plan = (self.runner.prepare(q_lens, ctx_lens, tables, state_slots) if self.runner
                else None)
        if plan is None:
            pool, state = self.cache.pool, self.cache.state
            plan = build_step_plan(q_lens, ctx_lens, tables, page_size=pool.page_size,
                                   sink_page=pool.sink_page, placement=self.runtime.placement,
                                   device=self.runtime.device, state_slots=state_slots,
                                   sink_slot=None if state is None else state.sink_slot)
            self.cache.begin_step(plan)
        return PlannedStep(row_key(rows), plan)

    def launch(self, step: PlannedStep, token_ids: Sequence[int] | torch.Tensor,
               logit_rows: Sequence[int]) -> torch.Tensor:
        """Run a planned step: [len(logit_rows), V] logits of those rows' last tokens ([1, V]
        of row 0 when ``logit_rows`` is empty), computed asynchronously on a GPU.

        ``token_ids``: the step's tokens, row after row, as host ints or as a 1-D tensor on the
        device (a decode step fed the previous step's sampled ids without a host round trip).
        """
        assert self.cache.plan is step.plan, "a launch runs the step planned last"
        self.cache.claim_backend()  # if another engine or a generate planned the backend since
        if step.plan.bucket is not None:
            return self.runner.launch(step.plan, token_ids, logit_rows)
        device = self.runtime.device
        if isinstance(token_ids, torch.Tensor):
            input_ids = token_ids.to(device=device, dtype=torch.long).reshape(1, -1)
        else:
            input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
        ends = step.plan.qo_indptr_host[1:].to(torch.long) - 1
        keep = ends[list(logit_rows)] if logit_rows else ends[:1]
        with torch.inference_mode(), self._layers():
            out = self.model(input_ids=input_ids,
                             position_ids=step.plan.positions[None, :len(token_ids)],
                             use_cache=True, logits_to_keep=keep.to(device),
                             **{self._cache_kwarg: self.cache})
        return out.logits[0]

    def _layers(self):
        if self._layers_to_compile is None:
            return contextlib.nullcontext()
        from torch_cp.graphs import compiled_layers

        return compiled_layers(self.model, self._layers_to_compile)


@dataclass
class LaunchedStep:
    """A step whose device work is queued and whose tokens have not reached the host yet.

    Attributes:
        rows: the step's rows; ``sampled``: indices of the rows that sample.
        logits: [len(sampled), V] logits of the sampling rows (computed asynchronously).
        device_ids: [len(sampled)] greedy token ids on the model's device (rank 0's where
            ranks broadcast), or None when tokens are sampled on the host.
    """

    rows: list[Row]
    sampled: list[int]
    logits: torch.Tensor
    device_ids: torch.Tensor | None = None
    logprob_rows: object | None = None  # serving's log-probabilities of rows that ask
    _host_ids: HomeBound | None = None

    def send_ids_home(self, ids: torch.Tensor) -> None:
        """Keep ``ids`` as ``device_ids`` and queue their copy to the host."""
        self.device_ids = ids
        self._host_ids = HomeBound(ids)

    def host_ids(self) -> list[int]:
        """The greedy ids on the host; waits for this step only, not for steps queued after."""
        assert self._host_ids is not None, "send_ids_home ran"
        return self._host_ids.arrived()[0].tolist()


class HomeBound:
    """Device tensors on their way to the host: a copy into pinned memory queued on the
    stream, and an event after it. ``arrived`` waits for that event only: a plain ``.tolist()``
    or ``.item()`` of a CUDA tensor would wait for every step queued after (a step launched
    ahead), and a copy from pageable memory likewise."""

    def __init__(self, *tensors: torch.Tensor):
        self._event = None
        if not tensors or tensors[0].device.type != "cuda":
            self._host = tensors
            return
        self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
        for host, t in zip(self._host, tensors):
            host.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensors[0].device))

    def arrived(self) -> tuple[torch.Tensor, ...]:
        """The tensors on the host, once their copies have landed."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


def to_device(values: list[int], device) -> torch.Tensor:
    """``values`` as a long tensor on ``device``, copied from pinned memory (stream-ordered: a
    copy from pageable memory would first wait for every step still queued)."""
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
