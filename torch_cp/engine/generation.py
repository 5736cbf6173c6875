"""generate(): one batch of prompts through an ``Engine`` sized for it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from torch_cp.agreement import agree, fingerprint
from torch_cp.engine.checks import checked, engine_problems, flag_problems, model_problems
from torch_cp.engine.engine import DEFAULT_TOKENS_PER_STEP, Engine
from torch_cp.engine.feedback import warn_ignored_sampling, warn_past_positions
from torch_cp.engine.memory import (
    DEFAULT_GRAPH_ROWS,
    default_num_pages,
    engine_fit_problems,
    lifetime_pages,
    memory_cap_pages,
    state_pool_bytes,
)
from torch_cp.engine.requests import (
    Request,
    RequestOutput,
    Result,
    eos_ids,
    logprobs_problem,
    new_tokens_per_request,
    normalize_prompts,
    pad_token_ids,
    vocab_size,
)
from torch_cp.engine.sampling import SamplingParams
from torch_cp.runtime import runtime_of
from torch_cp.values import as_int, plain_int


def engine_for(model, prompts: Sequence[Sequence[int]], news: Sequence[int], page_size: int,
               num_pages: int | None = None, **engine_kwargs) -> tuple[Engine, int | None]:
    """An ``Engine`` for token-id ``prompts`` with ``news`` new tokens each: a pool of
    ``num_pages`` (default: every request's whole lifetime, capped by free memory) and captured
    buckets as wide as the longest request, rounded up to a power of two: the backend keeps one
    kernel set per bucket shape for the model's life, so calls whose longest requests differ a
    little share them. ``engine_kwargs`` go to ``Engine``. Returns the engine and the cap free
    memory put on its pool, in pages (None: ``num_pages`` given, or the free memory unknown),
    for ``never_fit_hints``."""
    cap = None
    if num_pages is None:
        cap = memory_cap_pages(runtime_of(model), page_size,
                               _state_reserve(model, engine_kwargs))
        num_pages = default_num_pages(prompts, news, page_size, cap)
    widest = max((lifetime_pages(p, n, page_size) for p, n in zip(prompts, news)), default=1)
    width = 1 << (widest - 1).bit_length()
    return Engine(model, num_pages, page_size, max_pages_per_row=min(width, num_pages),
                  **engine_kwargs), cap


def batch_rows(prompts: Sequence | None) -> int | None:
    """``max_rows`` of the engine ``generate`` makes for ``prompts``: their count where it is
    below ``DEFAULT_GRAPH_ROWS`` (captured buckets, and a hybrid model's state slots, for the
    batch: one prompt took 66 state slots, about 1.6 GB for Qwen3.5-9B), else None (no limit;
    a hybrid model's default)."""
    return len(prompts) if prompts and len(prompts) < DEFAULT_GRAPH_ROWS else None


def _state_reserve(model, engine_kwargs: dict) -> int:
    """Bytes the engine's state pool will take beside the KV pool (hybrid models)."""
    return state_pool_bytes(runtime_of(model), engine_kwargs.get("max_rows"),
                            engine_kwargs.get("prefix_caching", False),
                            engine_kwargs.get("state_checkpoints"))


def generate(model, prompts, max_new_tokens: int | Sequence[int] = 32, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, eos_token_id: int | Sequence[int] | None = None, tokenizer=None,
             attention_mask=None, num_pages: int | None = None, page_size: int | None = None,
             max_tokens_per_step: int = DEFAULT_TOKENS_PER_STEP, progress: bool = True,
             cuda_graphs: bool = False, compile: bool = False,
             overlap_planning: bool = False, prefix_caching: bool = False,
             stream: bool = False, logprobs: int | None = None
             ) -> list[Result] | Iterator[RequestOutput]:
    """Generate continuations of ``prompts`` with a patched model.

    Call it on every rank of the model's mesh with the same arguments (lockstep).

    Args:
        model: a model patched by ``torch_cp.patch_model``.
        prompts: one prompt (a batch of one) or a batch, in any of these forms (L: a prompt's
            tokens, B: prompts):

            - token ids: ``list[int]`` or an integer tensor ``[L]``; a batch: a list of them
              (lengths may differ);
            - text: ``str`` or ``list[str]``, encoded by ``tokenizer`` (no special tokens);
            - chat: a list of messages ``[{"role": "user", "content": "..."}, ...]``, or a
              list of such conversations, rendered by ``tokenizer.apply_chat_template(...,
              add_generation_prompt=True)`` (the tokenizer needs a chat template);
            - an encoding: a ``BatchEncoding`` or dict with ``input_ids`` and
              ``attention_mask`` (what ``tokenizer(texts, padding=True)`` or
              ``apply_chat_template(..., return_dict=True)`` return), lists, tensors or NumPy
              arrays, ``[L]`` or ``[B, L]``, left or right padded;
            - padded ids ``[B, L]`` (tensor or lists) with ``attention_mask=`` ``[B, L]``.

            With a mask each prompt is exactly its ids where the mask is 1 (Hugging Face's
            convention); requests are packed, so padding never reaches the model. A ``[B, L]``
            tensor (or two or more token lists of one length) without a mask whose rows start
            or end with the pad id (the model's or the tokenizer's) is refused: pass its
            ``attention_mask``.
        max_new_tokens: per request (an int for all, or one per prompt).
        temperature, top_k, top_p, seed: sampling (temperature 0: greedy, and top_k / top_p
            are then ignored, with a warning); see ``SamplingParams``.
        eos_token_id: token id(s) that end a request (default: the model's generation config,
            else the tokenizer's).
        tokenizer: encodes text and chat prompts, decodes ``Result.text``, and names a pad id.
        attention_mask: the mask of padded ``input_ids`` given as ``prompts`` (1: a real
            token, 0: padding), the same shape as them.
        num_pages: logical pages of the pool (default: enough for every request's whole
            lifetime, at most 90% of a GPU's free memory or half the host's on CPU; a request
            whose lifetime alone exceeds that gets an error result and adds nothing to the
            pool). Requests wait for pages.
        page_size: tokens per page (default: the one given to ``patch_model``).
        max_tokens_per_step: token budget of a step; longer prompts are prefilled in chunks.
        progress: on rank 0, one tqdm bar over prompt tokens prefilled and tokens generated
            (not with ``stream``: the stream shows them), and a line while CUDA graphs are
            captured and layers compiled.
        cuda_graphs: replay decode steps from CUDA graphs captured per batch-size bucket (CUDA;
            captured before the first step, with page tables as wide as the longest request).
        compile, overlap_planning: see ``Engine``.
        prefix_caching: prompts sharing a prefix of full pages prefill it once (see
            ``Engine``): a prompt whose prefix another is prefilling waits until those pages
            are written, then shares them (a hybrid model's prompts share only prefixes
            already cached, at a state checkpoint). The tokens are the same.
        logprobs: k: each generated token's log-probability and the k most likely tokens'
            (``Result.logprobs``, ``RequestOutput.logprobs``).
        stream: return an iterator of ``RequestOutput`` (``request_id``: the prompt's index)
            that yields each request's new tokens as every step completes (``Engine.stream``);
            an EOS token ends its request with ``finish_reason="stop"``.
    Returns:
        One ``Result`` per prompt, in order. A bad request (empty prompt, ids outside the
        vocabulary, more tokens than the pool can ever hold, max_new_tokens <= 0) gets
        ``finish_reason="error"`` and the others still complete. A request whose prompt +
        max_new_tokens runs past the model's positions (``max_position_embeddings``, or a scaled
        RoPE's factor times its original length when longer) runs, with a warning.
    Raises:
        ValueError: every problem at once, before anything is allocated: prompts in no form
            above, strings or chats without a (chat-capable) tokenizer, a mask that does not
            fit, a padded tensor without its mask, sampling parameters, ``max_new_tokens``
            entries that are not ints, a page size, ``logprobs`` or engine settings that cannot
            be; under torchrun on every rank alike, with the other ranks' problems and the
            arguments that differ between ranks (every rank passes the same).
    """
    # every problem named at once, before anything is allocated (on every rank: agree below)
    runtime = runtime_of(model)
    problems = model_problems(model, runtime)
    page_size = runtime.page_size if page_size is None else page_size
    num_pages, page_size, max_tokens_per_step = map(plain_int, (num_pages, page_size,
                                                                max_tokens_per_step))
    sampling = checked(problems, SamplingParams, temperature, top_k, top_p, seed)
    token_prompts = checked(problems, normalize_prompts, prompts, tokenizer, attention_mask,
                             pad_token_ids(model, tokenizer))
    news = checked(problems, new_tokens_per_request, max_new_tokens,
                    None if token_prompts is None else len(token_prompts))
    problems += filter(None, [logprobs_problem(logprobs, vocab_size(model))])
    problems += engine_problems(
        1 if num_pages is None else num_pages,  # None: sized below from the requests
        page_size, runtime.placement.size, max_tokens_per_step, None, None, (), cuda_graphs,
        compile, runtime.device, prefix_caching, runtime.linear is not None,
        overlap_planning=overlap_planning, progress=progress) + flag_problems(stream=stream)
    rows = batch_rows(token_prompts)
    # this rank's memory, no collective; None: the default pool's first page must fit beside
    # the state pool (helper 87: it was allocated, and failed, instead)
    problems += engine_fit_problems(runtime, page_size, 1 if num_pages is None else num_pages,
                                    rows, prefix_caching, None, default=num_pages is None)
    eos = checked(problems, eos_ids, model, eos_token_id, tokenizer) or ()
    agree(runtime, "generate", problems, lambda: fingerprint(
        prompts=token_prompts, max_new_tokens=news, sampling=sampling, logprobs=as_int(logprobs),
        eos_token_id=eos_token_id, eos_token_ids=sorted(eos), num_pages=num_pages,
        page_size=page_size, max_tokens_per_step=max_tokens_per_step, cuda_graphs=cuda_graphs,
        compile=compile, overlap_planning=overlap_planning, prefix_caching=prefix_caching,
        stream=stream))
    if not token_prompts:  # nothing to allocate a pool (nor a hybrid model's state) for
        return iter(()) if stream else []
    lives = [max(n, 1) for n in news]
    engine, cap = engine_for(model, token_prompts, lives, page_size, num_pages,
                             max_tokens_per_step=max_tokens_per_step,
                             max_rows=rows, cuda_graphs=cuda_graphs,
                             compile=compile, overlap_planning=overlap_planning,
                             progress=progress, prefix_caching=prefix_caching,
                             _agreed=True)  # its arguments: agreed above
    if stream:  # the warnings run() gives
        warn_ignored_sampling(sampling)
        warn_past_positions(model, [Request(i, p, n) for i, (p, n) in
                                    enumerate(zip(token_prompts, news))])
        for prompt, new in zip(token_prompts, news):
            engine.submit(prompt, new, sampling, stop_token_ids=eos, logprobs=logprobs,
                          warn=False)
        return engine.stream()
    # Agreed above, on a fresh engine: not again (run_tokens would gather once more).
    results = engine.run_agreed(token_prompts, news, sampling, eos, progress, tokenizer,
                                logprobs)
    return never_fit_hints(results, token_prompts, lives, page_size, cap)


def never_fit_hints(results: Sequence[Result], prompts: Sequence[Sequence[int]],
                    news: Sequence[int], page_size: int, cap: int | None) -> list[Result]:
    """``results`` with the reason added to each refusal of a request that can never fit: its
    lifetime needs more than the ``cap`` pages free memory gave the pool (``engine_for``)."""
    if cap is None:
        return list(results)
    why = (f"; it can never fit: free memory holds a pool of at most {cap} pages "
           f"({cap * page_size} tokens)")
    return [dataclasses.replace(r, error=r.error + why)
            if not r.ok and lifetime_pages(p, max(n, 1), page_size) > cap else r
            for r, p, n in zip(results, prompts, news)]

