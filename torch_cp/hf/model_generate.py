"""``model.generate`` on a patched model: a paged cache that plans each step from the padded input.

Hugging Face ``generate`` feeds the model ``[B, S]`` input ids (left-padded in a batch) with a
``[B, past + S]`` attention mask. ``GenerateCache`` (``hf.generate_cache``) keeps each row's
logical length and pages; a forward pre-hook on the model turns each call's ids and mask into a
step plan whose ``token_index`` picks the real tokens out of the flattened ``[B * S]`` input, and
drops the mask (the patched attention reads the plan, not the mask, so transformers need not
build one).

    install_generate(model)        # patch_model calls it; idempotent
    model.generate(input_ids, attention_mask=mask, max_new_tokens=32)       # cache made for you
    model.generate(..., cache=torch_cp.new_cache(model, batch_size=4, max_length=4096))

``generate`` refuses unknown keyword arguments, so the pool cannot be sized through it: it is sized
from generate's own batch size and ``max_length`` (``new_cache`` sizes it explicitly). A cache
given back for a conversation's next turn (the last call's ``cache`` / ``past_key_values``, with
the whole conversation or only the tokens the cache does not hold as ``input_ids``: the last
call's final token, never fed, leads them; and the whole conversation's mask) grows as the
call needs; a mask that zeros a column the cache holds as real, or marks real one it holds as
padding, is refused (the pool attends every cached token and nothing else). Padding between
the cached columns and a row's new tokens is skipped on hybrid models too, so each row's tokens
are those of its unpadded conversation (Hugging Face's gated DeltaNet layers advance their
state over such padding: other tokens there). As with transformers' caches, a prompt's cache can be
filled by a plain forward (``model(ids, cache=cache)``) and generated from, ``copy.deepcopy``
gives a cache its own pool (one prompt, several continuations), and ``inputs_embeds`` may
stand for the prompt's ids. Beam search is not supported (a paged cache does not reorder
rows).

Under torchrun every rank calls ``generate`` with the same inputs (``hf.generate_agreement``:
one gather of the arguments' digest, and a ValueError on every rank naming those that differ),
and each rank's own loop picks its tokens: greedy decoding agrees on every rank (the tests check
it), but sampling agrees only when every rank seeds alike (``torch.manual_seed``) and the logits
agree to the last bit. Where that is not certain, ``torch_cp.generate`` samples on rank 0 and
broadcasts the tokens.
"""

from __future__ import annotations

import inspect
import types

import torch

from torch_cp import compat
from torch_cp.agreement import agree_over, fingerprint
from torch_cp.hf.cache import PagedKVCache
from torch_cp.hf.generate_agreement import agreed_generate
from torch_cp.hf.generate_cache import GenerateCache, finished_forward
from torch_cp.hf.generate_checks import (
    NO_ATTENTION_WEIGHTS,
    cache_fit_problems,
    check_cache_model,
    check_token_ids,
    generation_problems,
)
from torch_cp.runtime import new_pools, runtime_and_problems
from torch_cp.values import positive_int


def new_cache(model, batch_size: int, max_length: int, page_size: int | None = None, *,
              _agreed: bool = False, _deferred: bool = False) -> GenerateCache:
    """A cache for ``model.generate(..., cache=...)`` on a patched model.

    Args:
        model: patched by ``torch_cp.patch_model``.
        batch_size: rows of the generate call (``num_return_sequences`` included).
        max_length: the longest row, prompt (with its padding) and new tokens. The size it
            starts at, not a cap: a call that needs more (a conversation's next turn, given
            this cache back) grows the pool, keeping what it holds.
        page_size: tokens per page (default: the one given to ``patch_model``).
    Raises:
        ValueError naming every problem (a pool the free memory cannot hold among them, before
        it is allocated); under torchrun on every rank alike, with another rank's problems or
        the arguments that differ (``model.generate``, whose own gather agreed on the arguments,
        passes ``_agreed``: only each rank's free memory is gathered; and ``_deferred``: the
        pools allocated at the first forward).
    """
    runtime, problems = runtime_and_problems(model)
    size = runtime.page_size if page_size is None else page_size
    rows, length = positive_int(batch_size), positive_int(max_length)
    problems += [f"{name} must be a positive int, got {v!r}" for name, v, n in
                 (("batch_size", batch_size, rows), ("max_length", max_length, length))
                 if n is None]
    problems += runtime.placement.page_size_problems(size)
    pages = None
    if not problems:
        pages = rows * -(-length // size)
        problems += cache_fit_problems(runtime, pages, size, rows)
    # Gathered even where the arguments agreed: each rank's free memory is its own (helper 118:
    # the rank short of it raised alone, the others waited at the first forward's allocation).
    agree_over(runtime.spans_ranks, runtime.device, "new_cache", problems,
               lambda: {} if _agreed else fingerprint(batch_size=batch_size,
                                                      max_length=max_length, page_size=size))
    install_generate(model)
    if _deferred:
        return GenerateCache.deferred(runtime, rows, pages, size)
    pool, state = new_pools(runtime, pages, size, rows, "allocating the generate cache")
    return GenerateCache(runtime, pool, rows, state)


def _plan_before_forward(module, args, kwargs):
    """Forward pre-hook: plan the step of a ``GenerateCache`` and drop the attention mask; give
    the plan's positions when the call gives none (``generate`` gives them; a forward called
    directly, filling a cache with a prompt, does not)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, PagedKVCache):
        check_cache_model(module, cache)
    if kwargs.get("output_attentions") and isinstance(cache, PagedKVCache):
        raise ValueError(NO_ATTENTION_WEIGHTS)
    if isinstance(cache, PagedKVCache) and not isinstance(cache, GenerateCache):
        cache.claim_backend()
        return _with_plan_positions(cache.plan, args, kwargs)
    if not isinstance(cache, GenerateCache):
        return None
    # generate() passes keywords; a direct call may pass (input_ids, attention_mask,
    # position_ids, ...) positionally: named by the forward's signature
    if args:  # not generate's steps: no signature read on their path
        names = [name for name, p in inspect.signature(module.forward).parameters.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(args)]
        kwargs.update(zip(names, args))
        args = args[len(names):]
    ids = kwargs.get("input_ids")
    if ids is not None:
        if not module.__dict__.get("_torch_cp_generating"):  # generate checked its whole input
            check_token_ids(module, ids)
    elif kwargs.get("inputs_embeds") is not None:
        ids = kwargs["inputs_embeds"][..., 0]  # [B, S]: the plan needs only the shape
    if ids is None:
        raise ValueError("a forward given a torch_cp cache needs input_ids or inputs_embeds")
    cache.prepare(ids, kwargs.get("attention_mask"))
    kwargs["attention_mask"] = None
    # transformers would count a direct call's positions from get_seq_length (the columns
    # already planned, this call's included): the plan's are each row's own
    return _with_plan_positions(cache.plan, args, kwargs) or (args, kwargs)


def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode,
                                  batch_size, max_cache_length):
    """Make a ``GenerateCache`` unless the caller passed one (``new_cache``; any other cache is
    refused). ``use_cache=False`` (as a call's argument or a checkpoint's config) is overridden:
    the patched attention runs from the paged cache alone, and the tokens are the ones
    generating without a cache gives."""
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:  # the whole prompt's, whatever the chunks
        mask = mask.to("cpu", torch.bool)
    problems = generation_problems(generation_config, generation_mode, mask)
    if problems:
        raise ValueError("; ".join(problems))
    generation_config.use_cache = True  # generate's own copy; it passes this to each forward
    rows = max(generation_config.num_return_sequences or 1, 1) * batch_size
    user = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if user is not None:
        if not isinstance(user, GenerateCache):
            raise ValueError(f"model.generate on a torch_cp-patched model takes a cache made by "
                             f"torch_cp.new_cache(model, batch_size, max_length), got "
                             f"{type(user).__name__}")
        check_cache_model(self, user)
        user.check_not_interrupted()
        if user.rows != rows:
            raise ValueError(f"the cache passed serves {user.rows} rows, this call has {rows} "
                             f"(batch size x num_return_sequences)")
        user.check_cached_columns(mask)  # the whole conversation's, read above
        compat.prepare_cache_default(self, generation_config, model_kwargs, generation_mode,
                                     batch_size, max_cache_length)
        user.hold(max_cache_length)  # before the prefill reserves a page
        return
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not "
                         f"supported by a torch_cp-patched model; leave it unset")
    # allocated at the first forward, after transformers has checked the rest of the settings
    model_kwargs["cache"] = new_cache(self, rows, max_cache_length, _agreed=True, _deferred=True)


_REPLACED = ("generate", compat.PREPARE_CACHE)  # instance attributes install_generate sets


def install_generate(model) -> None:
    """Make ``model.generate`` use a ``GenerateCache`` (idempotent; ``patch_model`` calls it)."""
    if getattr(model, "_torch_cp_generate_installed", False):
        return
    model._torch_cp_generate_hook = model.register_forward_pre_hook(_plan_before_forward,
                                                                    with_kwargs=True)
    model._torch_cp_finished_hook = model.register_forward_hook(finished_forward,
                                                                with_kwargs=True)
    # What the instance had under the names replaced (a wrapper set on it), for unpatch_model.
    model._torch_cp_generate_before = {name: model.__dict__[name] for name in _REPLACED
                                       if name in model.__dict__}
    compat.override_prepare_cache(model, _prepare_cache_for_generation)
    model.generate = types.MethodType(agreed_generate, model)
    model._torch_cp_generate_installed = True


def uninstall_generate(model) -> None:
    """Undo ``install_generate`` (``unpatch_model`` calls it); a no-op when not installed."""
    for name in ("_torch_cp_generate_hook", "_torch_cp_finished_hook"):
        hook = model.__dict__.pop(name, None)
        if hook is not None:
            hook.remove()
    compat.restore_prepare_cache(model)
    model.__dict__.pop("generate", None)
    model.__dict__.update(model.__dict__.pop("_torch_cp_generate_before", {}))
    model.__dict__.pop("_torch_cp_generate_installed", None)


def _with_plan_positions(plan, args, kwargs):
    """``position_ids`` [B, S] from the plan's per-token positions when the call passes none:
    transformers would count them from ``get_seq_length`` alone, one offset for every row, so a
    packed step whose rows have different contexts would rotate them wrongly."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if plan is None or ids is None or kwargs.get("position_ids") is not None:
        return None
    b, s = ids.shape[:2]
    index, positions = plan.token_index, plan.positions
    if index is None:
        if positions.shape[0] != b * s:
            return None  # the attention names the mismatch
        position_ids = positions.view(b, s)
    else:
        position_ids = positions.new_zeros(b * s).index_copy(
            0, index, positions[: index.shape[0]]).view(b, s)
    return args, kwargs | {"position_ids": position_ids}

