"""Engine: continuous batching over the placed paged pool of a patched model.

Each step the scheduler picks rows (decode rows, then prefill chunks as pages and the token budget
allow), the step plan is built from their logical lengths and page tables, the model runs once
on the packed tokens ``[1, N]``, and the last token of every row that reaches its sequence's end
is sampled. Every rank runs the same loop with the same decisions (lockstep). Rank 0's sampled
tokens are broadcast to the other ranks, so a last-bit difference in their logits can never split
the schedulers; with the same seed, sampling itself is also identical on every rank (see
``torch_cp.engine.sampling``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from torch_cp.agreement import across_ranks, agree_over, fingerprint
from torch_cp.engine.ahead import ahead_ids
from torch_cp.engine.batch import BatchRuns
from torch_cp.engine.checks import engine_problems, model_problems
from torch_cp.engine.feedback import status
from torch_cp.engine.memory import DEFAULT_GRAPH_ROWS, engine_fit_problems, state_slot_counts
from torch_cp.engine.sampling import (
    SamplingParams,
    all_greedy,
    broadcast_from_rank0,
    greedy_tokens,
    sample_rows,
)
from torch_cp.engine.scheduler import Row, Scheduler, writes_shared_page
from torch_cp.engine.serving import Serving
from torch_cp.engine.steps import LaunchedStep, PlannedStep, StepLauncher, graph_runner, row_key
from torch_cp.engine.weights import WeightsWatch
from torch_cp.hf.cache import PagedKVCache
from torch_cp.kv.allocator import PageAllocator
from torch_cp.kv.prefix_cache import PrefixCachingAllocator
from torch_cp.plan import StepRefused
from torch_cp.runtime import new_pools, runtime_of
from torch_cp.values import plain_int

DEFAULT_TOKENS_PER_STEP = 2048


class Engine(BatchRuns, Serving):
    """A patched model with one placed pool, reused across ``run`` calls (a whole batch,
    ``engine/batch.py``) and requests submitted as they come (``submit`` / ``step`` /
    ``stream`` / ``abort``, ``engine/serving.py``).

    Args:
        model: a model patched by ``torch_cp.patch_model`` (``model.torch_cp`` is its runtime).
        num_pages: logical pages of the pool (the sink page is extra).
        page_size: tokens per logical page, a multiple of P (default: the one given to
            ``patch_model``).
        max_tokens_per_step: token budget of one step; longer prompts prefill in chunks.
        max_rows: most rows of one step, and most requests running at once (``None``: no limit;
            for a hybrid model, whose running requests each hold a state slot, 64).
        cuda_graphs: replay decode steps (and any ``mixed_buckets``) from CUDA graphs captured
            once per bucket; steps no bucket fits run eagerly. CUDA only.
        max_pages_per_row: page-table width of the captured buckets (default: the model's
            positions in pages, at most the pool: ``max_position_embeddings``, or the scaled
            RoPE's factor times its original length); a step with a longer row runs eagerly.
        mixed_buckets: (rows, tokens) shapes of multi-token steps to capture too.
        compile: run every decoder layer compiled (``torch.compile``, fullgraph; the layers
            share their compiled graphs, see ``compiled_layers``), in the captured steps and in
            the steps that run eagerly (long prefills): fuses the model's small kernels. Needs
            ``cuda_graphs``.
        overlap_planning: while a decode step runs on the device, plan the next one on the host
            for the rows it will have unless a request stops at EOS and, with greedy sampling,
            launch it at once, fed this step's tokens on the device; the host then takes this
            step's tokens while the next one runs. A request that stopped at EOS has its row
            in that next step dropped; any other wrong guess is re-planned. Tokens are the same
            either way.
        progress: print a line (rank 0, stderr) while graphs are captured and layers compiled.
        prefix_caching: keep the KV of full pages after their request ends (keyed by a hash
            chain from the first token) so that later requests sharing that prefix, in this or
            a later ``run``, skip its prefill; cached pages no request holds are evicted, least
            recently used first, when the pool needs them. Tokens are the same either way.
            A hybrid model (linear attention) reuses a prefix only up to a state checkpoint:
            its prompts prefill in chunks that end at page boundaries (and at the last one a
            later prompt could share, and where its cached prefix ends), and the state at each
            chunk's end is kept.
        state_checkpoints: state-pool slots that keep those checkpoints, each a request's
            whole state (``state_bytes``); the least recently used gives way (default, with
            ``prefix_caching`` on a hybrid model: as many as requests may run).
    Raises:
        ValueError naming every problem, before anything is allocated; under torchrun on every
        rank alike, naming another rank's problems (a pool its free memory cannot hold) or the
        arguments that differ between ranks (``progress`` may differ; nothing else). Where the
        pools then run out of memory on one rank, every rank raises (``agreement.together``).
    """

    def __init__(self, model, num_pages: int, page_size: int | None = None,
                 max_tokens_per_step: int = DEFAULT_TOKENS_PER_STEP, max_rows: int | None = None,
                 cuda_graphs: bool = False, max_pages_per_row: int | None = None,
                 mixed_buckets: Sequence[tuple[int, int]] = (), compile: bool = False,
                 overlap_planning: bool = False, progress: bool = False,
                 prefix_caching: bool = False, state_checkpoints: int | None = None, *,
                 _agreed: bool = False):
        self.model, self.runtime = model, runtime_of(model)
        num_pages, page_size, max_tokens_per_step, max_rows, max_pages_per_row, \
            state_checkpoints = map(plain_int, (  # NumPy's ints and 0-d tensors' too
                num_pages, self.runtime.page_size if page_size is None else page_size,
                max_tokens_per_step, max_rows, max_pages_per_row, state_checkpoints))
        hybrid = self.runtime.linear is not None
        arguments = dict(num_pages=num_pages, page_size=page_size,
                         max_tokens_per_step=max_tokens_per_step, max_rows=max_rows,
                         cuda_graphs=cuda_graphs, max_pages_per_row=max_pages_per_row,
                         mixed_buckets=mixed_buckets, compile=compile,
                         overlap_planning=overlap_planning, prefix_caching=prefix_caching,
                         state_checkpoints=state_checkpoints)
        problems = model_problems(model, self.runtime) + engine_problems(
            **arguments, partners=self.runtime.placement.size, device=self.runtime.device,
            hybrid=hybrid, backend=self.runtime.backend, progress=progress)
        if not _agreed:  # this rank's free memory, named beside the other problems (the gather
            # below names a rank it does not fit; ``generate`` checked it before its own)
            problems += engine_fit_problems(self.runtime, page_size, num_pages, max_rows,
                                            prefix_caching, state_checkpoints)
        # Every rank's problems and arguments, before anything is allocated (``generate``, whose
        # gather covered these arguments, passes ``_agreed``).
        agree_over(self.runtime.spans_ranks and not _agreed, self.runtime.device, "Engine(...)",
                   ["invalid engine: " + "; ".join(problems)] if problems else [],
                   lambda: fingerprint(**arguments))
        self.page_size = page_size
        self.max_tokens_per_step = max_tokens_per_step
        self.max_rows = max_rows
        state_slots, checkpoints = state_slot_counts(hybrid, max_rows, prefix_caching,
                                                     state_checkpoints)
        self.allocator = (PrefixCachingAllocator(num_pages, page_size, state_slots, checkpoints)
                          if prefix_caching else PageAllocator(num_pages, page_size, state_slots))
        self.pool, self.state = new_pools(  # state: None unless hybrid, checkpoints' slots last
            self.runtime, num_pages, page_size, state_slots + checkpoints,
            "allocating the engine's pools")
        self.cache = PagedKVCache(self.runtime, self.pool, self.state)
        self._weights = WeightsWatch(model, prefix_caching)
        self.broadcast = across_ranks(self.runtime.spans_ranks)
        self.decides = not self.broadcast or dist.get_rank() == 0  # serving's: rank 0, or alone
        self.overlap_planning = overlap_planning
        self.steps = 0
        self.prefilled_tokens = 0  # prompt tokens the model ran (prefix-cached ones excluded)
        self.reused_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.replayed_steps = 0
        self.planned_ahead_steps = 0  # steps launched from a plan made during the previous one
        self.launched_ahead_steps = 0  # ... and launched before its tokens reached the host
        self._ahead: PlannedStep | None = None  # planned, launched after the host samples
        self._inflight: LaunchedStep | None = None  # launched, not yet committed
        self._announce = progress  # status lines
        self._announce_compile = compile  # the first step outside the buckets compiles again
        self.runner = graph_runner(
            model, self.cache, min(max_rows or DEFAULT_GRAPH_ROWS, DEFAULT_GRAPH_ROWS),
            max_pages_per_row, mixed_buckets, compile, progress) if cuda_graphs else None
        self.launcher = StepLauncher(model, self.cache, self.runner, compile=compile)
        self._serving_init()

    @property
    def kv_bytes(self) -> int:
        """Bytes of this rank's pool (every layer, the sink page included)."""
        return self.pool.bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of this rank's linear-attention state pool (hybrid models; else 0)."""
        return self.state.bytes if self.state is not None else 0

    def _settle_ahead(self) -> None:
        """Once nothing runs: wait for the step launched ahead (its requests ended by an EOS, a
        stop or an abort: nothing will commit it) and drop it and any step planned ahead, and
        the last step's logits (an idle engine held [rows, vocab] of them: helper 119)."""
        if self._inflight is not None:
            self._inflight.host_ids()
        self._ahead = self._inflight = self._committed = None

    def _step(self, scheduler: Scheduler, sampling: SamplingParams, generators, eos):
        """Finish one step: the one launched ahead during the previous step, else the
        scheduler's next (retried smaller when the backend refuses it). With
        ``overlap_planning`` the step after it is planned, and with greedy sampling launched,
        before this step's tokens are awaited. Returns (prompt tokens prefilled, tokens
        sampled, ended requests with their finish reason and error)."""
        current, self._inflight = self._inflight, None
        if current is None:
            current, failed = self._launch_scheduled(scheduler, sampling)
            if failed:
                self._committed = None
                return 0, 0, failed
        self._logprob_rows(current)  # before a step launched ahead reuses its logits buffer
        if self.overlap_planning:
            self._overlap(current, scheduler, sampling)
        tokens = self._tokens(current, sampling, generators)
        self.steps += 1
        # A step launched ahead may hold rows of requests that stopped at EOS meanwhile.
        rows = [r for r in current.rows if r.request in scheduler.running]
        tokens = {i: t for i, t in tokens.items() if i in scheduler.running}
        prompts = [len(scheduler.running[r.request].prompt) for r in rows]
        prefilled = sum(max(0, min(r.start + r.length, n) - r.start) for r, n in zip(rows, prompts))
        finished = scheduler.commit(rows, tokens, eos)
        self._committed = (current, tokens)
        return prefilled, len(tokens), [(r, reason, None) for r, reason in finished]

    def _launch_scheduled(self, scheduler: Scheduler, sampling: SamplingParams):
        """Plan and launch the scheduler's next step: (launched step, []) or (None, failures)."""
        rows = scheduler.schedule()
        assert rows, "a scheduler with running or waiting requests always has a row"
        max_rows = max_tokens = None
        while True:
            try:
                step = self._planned(rows)
                break
            except StepRefused as refusal:
                # Prefill tokens shrink first: cutting rows would drop the decode rows (first
                # in a step) and keep the prefill rows out until those requests finish.
                tokens = sum(r.length for r in rows)
                if tokens > len(rows):
                    max_tokens = tokens // 2
                elif len(rows) > 1:
                    max_rows = len(rows) // 2
                else:
                    request = scheduler.abort(rows[0].request)
                    return None, [(request, "error", f"the attention backend refused even one "
                                                     f"token: {refusal}")]
                rows = scheduler.schedule(max_rows=max_rows, max_tokens=max_tokens)
        requests = [scheduler.running[r.request] for r in rows]
        ids = [t for r, q in zip(rows, requests) for t in q.tokens[r.start:r.start + r.length]]
        if scheduler.checkpointing:  # rows admitted onto a checkpoint start from its state
            for source, slot in self.allocator.take_restores():
                self.state.copy_slot(source, slot)
        launched = self._launch(step, rows, ids, sampling)
        for request, key in scheduler.checkpoint_keys(rows):
            try:  # queued after the step, before anything that reads it
                copy = self.allocator.save_checkpoint(request, key)
                if copy is not None:
                    self.state.copy_slot(*copy)
            except BaseException:
                self.allocator.checkpoints.drop(key)  # never a key over a stale slot
                raise
        return launched, []

    def _planned(self, rows: list[Row]) -> PlannedStep:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.key == row_key(rows):
            self.planned_ahead_steps += 1
            return ahead
        return self._plan(rows)

    def _plan(self, rows: list[Row]) -> PlannedStep:
        slots = ([self.allocator.state_slot(r.request) for r in rows] if self.state is not None
                 else None)
        return self.launcher.plan(rows, [self.allocator.table_tensor(r.request) for r in rows],
                                  slots)

    def _launch(self, step: PlannedStep, rows: list[Row], ids, sampling: SamplingParams):
        if self._announce_compile and step.plan.bucket is None:
            self._announce_compile = False
            status("compiling the decoder layers for steps outside the captured buckets (a "
                   "long prefill; once)", self._announce)
        assert not writes_shared_page(self.allocator, rows), "a step writes a cached page"
        sampled = [b for b, r in enumerate(rows) if r.samples]
        launched = LaunchedStep(rows, sampled, self.launcher.launch(step, ids, sampled))
        self.replayed_steps += step.plan.bucket is not None
        if sampled and all_greedy(sampling, [rows[b].request for b in sampled]):
            tokens = greedy_tokens(launched.logits)
            launched.send_ids_home(broadcast_from_rank0(tokens) if self.broadcast else tokens)
        return launched

    def _overlap(self, current: LaunchedStep, scheduler: Scheduler, sampling: SamplingParams):
        """While ``current`` runs, plan the step after it if the scheduler can foresee it, and
        launch it at once when its input ids are already on the device (greedy sampling)."""
        live = [r for r in current.rows if r.request in scheduler.running]
        following = scheduler.next_decode_rows(live)
        if following is None:
            return
        try:
            step = self._plan(following)
        except StepRefused:
            return  # planned again (and refused again, then retried smaller) next step
        if current.device_ids is None:
            self._ahead = step  # launched once the host has sampled current's tokens
            return
        self._inflight = self._launch(step, following, ahead_ids(current, following), sampling)
        self.planned_ahead_steps += 1
        self.launched_ahead_steps += 1

    def _tokens(self, step: LaunchedStep, sampling: SamplingParams, generators) -> dict[int, int]:
        """The sampled token of each sampling row of ``step``, on the host."""
        if not step.sampled:
            return {}
        if step.device_ids is not None:
            ids = step.host_ids()
        else:
            requests = [step.rows[b].request for b in step.sampled]
            tokens = sample_rows(step.logits, sampling, requests, generators)
            ids = (broadcast_from_rank0(tokens) if self.broadcast else tokens).tolist()
        return {step.rows[b].request: t for b, t in zip(step.sampled, ids)}
