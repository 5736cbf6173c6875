"""Prompts as the user gives them -> token-id lists, the checks a request must pass, its stop
tokens, and what it produced (``Result``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Prompt = Sequence[int] | torch.Tensor | str


def _is_token_list(x) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def normalize_prompts(prompts, tokenizer=None) -> list[list[int]]:
    """Token-id lists from token lists, 1-D tensors or strings (with ``tokenizer``).

    A single prompt (a string, a non-empty token list or a 1-D tensor) is a batch of one. An
    empty list inside the batch stays empty: the engine reports it as a bad request.
    """
    if isinstance(prompts, str) or (isinstance(prompts, torch.Tensor) and prompts.dim() == 1):
        prompts = [prompts]
    elif isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        prompts = list(prompts)
    elif _is_token_list(prompts) and len(prompts) > 0:
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is a string: pass tokenizer= to encode it")
            out.append(list(tokenizer(p, add_special_tokens=False)["input_ids"]))
        elif isinstance(p, torch.Tensor):
            if p.dim() != 1 or p.is_floating_point():
                raise ValueError(f"prompt {i}: a tensor prompt must be 1-D integer token ids")
            out.append([int(t) for t in p.tolist()])
        else:
            out.append([int(t) for t in p])
    return out


def check_request(prompt: Sequence[int], max_new_tokens: int, vocab: int, capacity: int
                  ) -> str | None:
    """Why a request cannot run (every problem found), or ``None`` when it can.

    ``capacity``: tokens the whole pool holds; a request caches
    ``len(prompt) + max_new_tokens - 1`` tokens at most.
    """
    problems = []
    if len(prompt) == 0:
        problems.append("empty prompt")
    bad = sorted({t for t in prompt if not 0 <= t < vocab})
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
        problems.append(f"token ids outside the vocabulary [0, {vocab}): {shown}")
    if max_new_tokens <= 0:
        problems.append(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    needed = len(prompt) + max(max_new_tokens, 1) - 1
    if needed > capacity:
        problems.append(f"prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) "
                        f"needs {needed} cached tokens, more than the pool can ever hold "
                        f"({capacity})")
    return "; ".join(problems) or None


@dataclass(frozen=True)
class Result:
    """What one request produced.

    Attributes:
        index: the request's position in the ``prompts`` given to ``generate``.
        token_ids: generated tokens (an EOS token that ended the request included).
        finish_reason: ``"eos"``, ``"length"`` (max_new_tokens reached) or ``"error"``.
        text: the decoded tokens when a tokenizer was given, else ``None``.
        error: why the request failed (``finish_reason == "error"``), else ``None``.
    """

    index: int
    token_ids: tuple[int, ...]
    finish_reason: Literal["eos", "length", "error"]
    text: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error"


def vocab_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    return config.vocab_size


def eos_ids(model, eos_token_id, tokenizer) -> tuple[int, ...]:
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
