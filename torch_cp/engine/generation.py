"""generate(): one batch of prompts through an ``Engine`` sized for it."""

from __future__ import annotations

from collections.abc import Sequence

from torch_cp.engine.engine import DEFAULT_TOKENS_PER_STEP, Engine
from torch_cp.engine.memory import default_num_pages, lifetime_pages
from torch_cp.engine.requests import Prompt, Result, eos_ids, normalize_prompts
from torch_cp.engine.sampling import SamplingParams
from torch_cp.runtime import runtime_of


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
        page_size: tokens per page (default: the one given to ``patch_model``).
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
    page_size = runtime.page_size if page_size is None else page_size
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
