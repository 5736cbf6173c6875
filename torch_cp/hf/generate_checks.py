"""What ``model.generate`` on a patched model refuses, and why, before its cache is allocated."""

from __future__ import annotations

import torch
from transformers.generation.configuration_utils import GenerationMode

from torch_cp.engine.memory import pool_fit_problems
from torch_cp.state import StatePool

NO_ATTENTION_WEIGHTS = ("torch_cp's attention computes no attention weights: "
                        "output_attentions=True needs the unpatched model (unpatch_model)")


def generation_problems(generation_config, generation_mode, mask: torch.Tensor | None
                        ) -> list[str]:
    """What a patched model cannot generate with these settings and this [B, columns] mask
    (on the host): every problem, so one ValueError names them all."""
    problems = []
    if mask is not None and mask.dim() == 2:  # the whole prompt's, whatever the chunks
        right_padded = (mask.any(1) & ~mask[:, -1]).nonzero().flatten().tolist()
        if right_padded:  # generate reads each row's next token at its last column
            problems.append(f"rows {right_padded} are padded on the right: generate would read "
                            f"their next token at a padding column; pad on the left "
                            f"(tokenizer.padding_side = 'left')")
        if not mask.any():
            problems.append("the input has no real token (its attention mask is all zeros)")
    if generation_config.output_attentions:
        problems.append(NO_ATTENTION_WEIGHTS)
    if generation_config.guidance_scale not in (None, 1, 1.0):
        problems.append("guidance_scale (classifier-free guidance) runs the model again without "
                        "a cache, which a torch_cp-patched model cannot; leave it unset")
    if generation_config.num_beams > 1:
        problems.append("torch_cp's paged cache does not support beam search (num_beams > 1)")
    if generation_mode == GenerationMode.ASSISTED_GENERATION:
        problems.append("assisted decoding (assistant_model, prompt_lookup_num_tokens) crops the "
                        "cache after each step, which torch_cp's paged cache cannot; leave them "
                        "unset")
    return problems


def check_cache_model(model, cache) -> None:
    """Refuse a cache made for another patched model, or for this one before it was patched
    again: its pool and plan are not the ones this model's attention reads (helper 109: wrong
    tokens, or an assertion in the backend)."""
    if cache.runtime is not getattr(model, "torch_cp", None):
        raise ValueError("the cache passed was made for another patched model, or for this one "
                         "before it was patched again: make a new one with "
                         "torch_cp.new_cache(model, batch_size, max_length)")


def check_token_ids(model, input_ids: torch.Tensor) -> None:
    """Refuse ids outside the model's embedding before a cache plans them: the embedding would
    raise inside the forward (on a GPU, a device-side assert that ends the process), leaving a
    conversation's cache counting tokens its layers never wrote (helper 116). One reduction
    and one read on the host a forward."""
    vocab = model.get_input_embeddings().num_embeddings
    bad = ((input_ids < 0) | (input_ids >= vocab)).any(dim=-1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"input_ids rows {rows} hold ids outside the model's vocabulary "
                         f"[0, {vocab})")


def cache_fit_problems(runtime, num_pages: int, page_size: int, state_slots: int) -> list[str]:
    """Why a generate cache of ``num_pages`` pages (and a hybrid model's state pool of
    ``state_slots`` slots) cannot fit in this rank's free memory, before it is allocated."""
    state = 0 if runtime.linear is None else StatePool.bytes_for(runtime.linear, state_slots,
                                                                 runtime.dtype)
    return pool_fit_problems(runtime, page_size, num_pages, state)
