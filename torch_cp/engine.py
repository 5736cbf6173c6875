"""generate(): continuous batching over the placed paged pool of a patched model.

Each step the scheduler picks rows (decode rows, then prefill chunks as pages and the token budget
allow), the step plan is built from their logical lengths and page tables, the model runs once
on the packed tokens ``[1, N]``, and the last token of every row that reaches its sequence's end
is sampled. Every rank runs the same loop with the same decisions (lockstep). Rank 0's sampled
tokens are broadcast to the other ranks, so a last-bit difference in their logits can never split
the schedulers; with the same seed, sampling itself is also identical on every rank (see
``torch_cp.sampling``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from torch_cp.cache import PagedKVCache
from torch_cp.kv.allocator import PageAllocator
from torch_cp.memory import default_num_pages, lifetime_pages
from torch_cp.requests import (
    Prompt,
    Result,
    check_request,
    eos_ids,
    normalize_prompts,
    vocab_size,
)
from torch_cp.sampling import SamplingParams, sample
from torch_cp.scheduler import Request, Row, Scheduler, StepRefused
from torch_cp.steps import PlannedStep, StepLauncher, row_key

DEFAULT_TOKENS_PER_STEP = 2048
DEFAULT_PAGE_SIZE = 16
DEFAULT_GRAPH_ROWS = 64
GREEDY = SamplingParams()


def runtime_of(model):
    runtime = getattr(model, "torch_cp", None)
    if runtime is None:
        raise ValueError("the model is not patched: call torch_cp.patch_model(model, ...) first")
    return runtime


def _sync_group(runtime) -> bool:
    """Whether tokens must be broadcast: the model spans more than one rank (TP or partners)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    return runtime.placement.size > 1 or getattr(runtime, "tp", 1) > 1


class Engine:
    """A patched model with one placed pool, reused across ``run`` calls.

    Args:
        model: a model patched by ``torch_cp.patch_model`` (``model.torch_cp`` is its runtime).
        num_pages: logical pages of the pool (the sink page is extra).
        page_size: tokens per logical page, a multiple of P (default: the runtime's, else 16).
        max_tokens_per_step: token budget of one step; longer prompts prefill in chunks.
        max_rows: most rows of one step (``None``: no limit).
        cuda_graphs: replay decode steps (and any ``mixed_buckets``) from CUDA graphs captured
            once per bucket; steps no bucket fits run eagerly. CUDA only.
        max_pages_per_row: page-table width of the captured buckets (default: the whole pool);
            a step with a longer row runs eagerly.
        mixed_buckets: (rows, tokens) shapes of multi-token steps to capture too.
        compile: capture ``torch.compile(model.forward, fullgraph=True)`` instead of the eager
            forward (fuses the model's small kernels; needs ``cuda_graphs``).
        overlap_planning: while a decode step runs on the device, plan the next one on the host
            for the rows it will have unless a request stops at EOS (re-planned if one does).
            Tokens are the same either way.
    """

    def __init__(self, model, num_pages: int, page_size: int | None = None,
                 max_tokens_per_step: int = DEFAULT_TOKENS_PER_STEP, max_rows: int | None = None,
                 cuda_graphs: bool = False, max_pages_per_row: int | None = None,
                 mixed_buckets: Sequence[tuple[int, int]] = (), compile: bool = False,
                 overlap_planning: bool = False):
        self.model = model
        self.runtime = runtime_of(model)
        page_size = page_size or getattr(self.runtime, "page_size", None) or DEFAULT_PAGE_SIZE
        problems = []
        if num_pages < 1:
            problems.append(f"num_pages must be >= 1, got {num_pages}")
        if page_size % self.runtime.placement.size:
            problems.append(f"page_size {page_size} is not a multiple of P = "
                            f"{self.runtime.placement.size}")
        if max_tokens_per_step < 1:
            problems.append(f"max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        if cuda_graphs and torch.device(self.runtime.device).type != "cuda":
            problems.append(f"cuda_graphs needs a model on CUDA, not {self.runtime.device}")
        if compile and not cuda_graphs:
            problems.append("compile=True compiles the captured step: it needs cuda_graphs=True")
        if problems:
            raise ValueError("invalid engine: " + "; ".join(problems))
        self.page_size = page_size
        self.max_tokens_per_step = max_tokens_per_step
        self.max_rows = max_rows
        self.allocator = PageAllocator(num_pages, page_size)
        self.pool = self.runtime.new_pool(num_pages, page_size)
        self.cache = PagedKVCache(self.runtime, self.pool)
        self.broadcast = _sync_group(self.runtime)
        self.overlap_planning = overlap_planning
        self.steps = 0
        self.replayed_steps = 0
        self.planned_ahead_steps = 0  # steps launched from a plan made during the previous one
        self._ahead: PlannedStep | None = None
        self.runner = None
        if cuda_graphs:
            from torch_cp.graphs import CUDAGraphRunner, default_buckets

            rows = min(max_rows or DEFAULT_GRAPH_ROWS, DEFAULT_GRAPH_ROWS)
            forward = torch.compile(model.forward, fullgraph=True) if compile else None
            self.runner = CUDAGraphRunner(model, self.cache,
                                          default_buckets(rows, mixed_buckets),
                                          max_pages_per_row or num_pages, forward=forward)
            self.runner.capture()
        self.launcher = StepLauncher(model, self.cache, self.runner)

    @property
    def kv_bytes(self) -> int:
        """Bytes of this rank's pool (every layer, the sink page included)."""
        return self.pool.bytes

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
            sampling: SamplingParams = GREEDY, eos_token_ids: Sequence[int] = (),
            progress: bool = False) -> list[Result]:
        """Generate for token-id prompts; bad requests get error results, the others complete."""
        news = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
                else list(max_new_tokens))
        if len(news) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(news)} entries for {len(prompts)} prompts")
        vocab = vocab_size(self.model)
        self._ahead = None  # request indices restart with every run
        results: dict[int, Result] = {}
        scheduler = Scheduler(self.allocator, self.max_tokens_per_step, self.max_rows)
        capacity = self.allocator.num_pages * self.page_size
        for i, (prompt, new) in enumerate(zip(prompts, news)):
            error = check_request(prompt, new, vocab, capacity)
            if error:
                results[i] = Result(i, (), "error", error=error)
            else:
                scheduler.add(Request(i, list(prompt), new))
        eos = frozenset(eos_token_ids)
        generators = {r.index: sampling.generator(r.index) for r in scheduler.waiting}
        total = sum(r.max_new_tokens for r in scheduler.waiting)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        show = progress and rank0
        with tqdm(total=total, unit="tok", desc="generate", disable=not show) as bar:
            while not scheduler.done:
                new, finished, failed = self._step(scheduler, sampling, generators, eos)
                bar.update(new)
                for request, reason in finished:
                    results[request.index] = Result(request.index, tuple(request.generated),
                                                    reason)
                for request, error in failed:
                    results[request.index] = Result(request.index, tuple(request.generated),
                                                     "error", error=error)
                for request in [r for r, _ in finished] + [r for r, _ in failed]:
                    bar.total -= request.max_new_tokens - len(request.generated)  # stopped early
        assert self.allocator.free_pages == self.allocator.num_pages, "every page returns"
        return [results[i] for i in range(len(prompts))]

    def _step(self, scheduler: Scheduler, sampling: SamplingParams, generators, eos):
        """Run one step, retrying smaller when the backend refuses it.

        Returns (tokens sampled, finished requests with their reason, failed requests with why).
        """
        rows = scheduler.schedule()
        assert rows, "a scheduler with running or waiting requests always has a row"
        while True:
            try:
                tokens = self._forward(rows, scheduler, sampling, generators)
                break
            except StepRefused as refusal:
                if len(rows) > 1:
                    rows = scheduler.schedule(max_rows=len(rows) // 2)
                elif rows[0].length > 1:
                    rows = scheduler.schedule(max_rows=1, max_tokens=rows[0].length // 2)
                else:
                    request = scheduler.abort(rows[0].request)
                    return 0, [], [(request, f"the attention backend refused even one token: "
                                          f"{refusal}")]
        self.steps += 1
        return len(tokens), scheduler.commit(rows, tokens, eos), []

    def _forward(self, rows: list[Row], scheduler: Scheduler, sampling: SamplingParams,
                 generators) -> dict[int, int]:
        """One model step over ``rows``; returns the sampled token of each sampling row."""
        requests = [scheduler.running[r.request] for r in rows]
        ids = [t for r, q in zip(rows, requests) for t in q.tokens[r.start:r.start + r.length]]
        sampled = [b for b, r in enumerate(rows) if r.samples]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.key == row_key(rows):
            step = ahead
            self.planned_ahead_steps += 1
        else:
            step = self._plan(rows)
        logits = self.launcher.launch(step, ids, sampled)
        self.replayed_steps += step.bucket is not None
        if self.overlap_planning:
            self._ahead = self._plan_ahead(rows, scheduler)
        if not sampled:
            return {}
        device = self.runtime.device
        gens = None if sampling.greedy else [generators[rows[b].request] for b in sampled]
        tokens = sample(logits, sampling, gens)
        if self.broadcast:
            tokens = _broadcast_from_rank0(tokens, device)
        return {rows[b].request: int(t) for b, t in zip(sampled, tokens.tolist())}

    def _plan(self, rows: list[Row]) -> PlannedStep:
        return self.launcher.plan(rows, [self.allocator.table_tensor(r.request) for r in rows])

    def _plan_ahead(self, rows: list[Row], scheduler: Scheduler) -> PlannedStep | None:
        """Plan the step after ``rows`` while they run, if the scheduler can foresee it."""
        following = scheduler.next_decode_rows(rows)
        if following is None:
            return None
        try:
            return self._plan(following)
        except StepRefused:
            return None  # planned again (and refused again, then retried smaller) next step


def _broadcast_from_rank0(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = tokens.to(on)
    dist.broadcast(t, src=0)
    return t.cpu()


def engine_for(model, prompts: Sequence[Sequence[int]], news: Sequence[int], page_size: int,
               num_pages: int | None = None, **engine_kwargs) -> Engine:
    """An ``Engine`` for token-id ``prompts`` with ``news`` new tokens each: a pool of
    ``num_pages`` (default: every request's whole lifetime, capped by free memory) and captured
    buckets as wide as the longest request. ``engine_kwargs`` go to ``Engine``."""
    if num_pages is None:
        num_pages = default_num_pages(runtime_of(model), prompts, news, page_size)
    widest = max((lifetime_pages(p, n, page_size) for p, n in zip(prompts, news)), default=1)
    return Engine(model, num_pages, page_size, max_pages_per_row=min(widest, num_pages),
                  **engine_kwargs)


def generate(model, prompts: Sequence[Prompt] | Prompt, max_new_tokens: int | Sequence[int] = 32,
             *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, eos_token_id: int | Sequence[int] | None = None, tokenizer=None,
             num_pages: int | None = None, page_size: int | None = None,
             max_tokens_per_step: int = DEFAULT_TOKENS_PER_STEP, progress: bool = True,
             cuda_graphs: bool = False, compile: bool = False,
             overlap_planning: bool = False) -> list[Result]:
    """Generate continuations of ``prompts`` with a patched model.

    Call it on every rank of the model's mesh with the same arguments (lockstep).

    Args:
        model: a model patched by ``torch_cp.patch_model``.
        prompts: token-id lists (or 1-D tensors), or strings when ``tokenizer`` is given; one
            such prompt alone is taken as a batch of one.
        max_new_tokens: per request (an int for all, or one per prompt).
        temperature, top_k, top_p, seed: sampling (temperature 0: greedy); see ``SamplingParams``.
        eos_token_id: token id(s) that end a request (default: the model's generation config,
            else the tokenizer's).
        tokenizer: encodes string prompts and decodes ``Result.text``.
        num_pages: logical pages of the pool (default: enough for every request's whole
            lifetime; on CUDA at most 90% of free memory). Requests wait for pages.
        page_size: tokens per page (default: the patched model's, else 16).
        max_tokens_per_step: token budget of a step; longer prompts are prefilled in chunks.
        progress: a tqdm bar of generated tokens on rank 0.
        cuda_graphs: replay decode steps from CUDA graphs captured per batch-size bucket (CUDA;
            captured before the first step, with page tables as wide as the longest request).
        compile, overlap_planning: see ``Engine``.
    Returns:
        One ``Result`` per prompt, in order. A bad request (empty prompt, ids outside the
        vocabulary, more tokens than the pool can ever hold, max_new_tokens <= 0) gets
        ``finish_reason="error"`` and the others still complete.
    """
    runtime = runtime_of(model)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    token_prompts = normalize_prompts(prompts, tokenizer)
    news = ([max_new_tokens] * len(token_prompts) if isinstance(max_new_tokens, int)
            else list(max_new_tokens))
    if len(news) != len(token_prompts):
        raise ValueError(f"max_new_tokens has {len(news)} entries for {len(token_prompts)} prompts")
    page_size = page_size or getattr(runtime, "page_size", None) or DEFAULT_PAGE_SIZE
    engine = engine_for(model, token_prompts, [max(n, 1) for n in news], page_size, num_pages,
                        max_tokens_per_step=max_tokens_per_step, cuda_graphs=cuda_graphs,
                        compile=compile, overlap_planning=overlap_planning)
    eos = eos_ids(model, eos_token_id, tokenizer)
    results = engine.run(token_prompts, news, sampling, eos, progress)
    if tokenizer is None:
        return results
    return [Result(r.index, r.token_ids, r.finish_reason,
                   tokenizer.decode(list(r.token_ids), skip_special_tokens=True), r.error)
            for r in results]
