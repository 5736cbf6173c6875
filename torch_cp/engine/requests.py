"""Requests: prompts as the user gives them (``normalize_prompts``, see ``prompts.py``), the
checks a request must pass, its stop tokens, its progress through the scheduler (``Request``),
and what it produced (``Result`` for a whole run, ``RequestOutput`` for one step of the serving
API)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch_cp.engine.prompts import (
    Prompt,
    normalize_prompts,
    pad_token_ids,
    token_ids_of,
    token_prompts,
)
from torch_cp.values import as_int

# Prompt forms live in prompts.py; re-exported here, where requests are made of them.
__all__ = ["Prompt", "Request", "RequestOutput", "Result", "check_request", "eos_ids",
           "make_requests", "new_tokens_per_request", "normalize_prompts", "pad_token_ids",
           "token_ids_of", "token_prompts", "vocab_size", "with_text"]


@dataclass
class Request:
    """One request's progress. ``cached`` tokens of ``tokens`` have their KV in the pool."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    cached: int = 0
    prompt_keys: list[bytes] | None = field(default=None, repr=False)  # prefix-cache keys
    cached_prefix_end: int = 0  # hybrid: where the cached prefix ends (past its checkpoint)
    # prompt + generated, grown with them: built again on each read, it cost every row of every
    # step its whole context (49 ms a step at 64 rows of 128k; helper 94).
    _sequence: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._sequence = self.prompt + self.generated

    @property
    def tokens(self) -> list[int]:
        """The prompt, then the generated tokens (read-only: ``append`` adds to it)."""
        return self._sequence

    def append(self, token: int) -> None:
        """Record a generated token."""
        self.generated.append(token)
        self._sequence.append(token)

    @property
    def pending(self) -> int:
        """Tokens whose KV is not in the pool yet (the next row's tokens)."""
        return len(self.prompt) + len(self.generated) - self.cached

    @property
    def lifetime_tokens(self) -> int:
        """Tokens cached at most: the last generated token is never fed back."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def decoding(self) -> bool:
        return bool(self.generated)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the id ``submit`` returned.
        token_ids: the tokens this step generated (none for an abort or an error; a prefill
            chunk that samples nothing gives no output at all).
        finished: whether the request ended with this step.
        finish_reason: ``"stop"`` (a stop token id, the model's EOS among them when
            ``generate(stream=True)`` passes it, or a stop string), ``"length"``, ``"abort"``
            or ``"error"`` when finished, else ``None``.
        logprobs: per token of ``token_ids`` (with ``logprobs=k``): its log-probability and
            the ``k`` most likely ``(token, log-probability)`` pairs, from the float32 log-softmax
            of the row's logits (before temperature and filtering).
        error: why the request was refused (``finish_reason == "error"``).
    """

    request_id: int
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()
    error: str | None = None


def new_tokens_per_request(max_new_tokens: int | Sequence[int], prompts: int | None
                           ) -> list[int]:
    """``max_new_tokens`` for each of ``prompts`` requests (an int is every request's; numpy
    integers count as ints). ``prompts`` None: the entries checked, not their count."""
    if as_int(max_new_tokens) is not None:  # a [1] tensor is a list (of one), not an int
        return [as_int(max_new_tokens)] * (prompts or 0)
    try:
        news = list(max_new_tokens) if not isinstance(max_new_tokens, (str, bytes)) else None
    except TypeError:  # e.g. a float
        news = None
    if news is None:
        raise ValueError(f"max_new_tokens must be an int or one int a prompt, got "
                         f"{max_new_tokens!r}")
    problems = [f"max_new_tokens[{i}] must be an int, got {n!r}"
                for i, n in enumerate(news) if as_int(n) is None]
    if prompts is not None and len(news) != prompts:
        problems.append(f"max_new_tokens has {len(news)} entries for {prompts} prompts")
    if problems:
        raise ValueError("; ".join(problems))
    return [as_int(n) for n in news]


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
                        f"({capacity} tokens)")
    return "; ".join(problems) or None


def logprobs_problem(logprobs, vocab: int) -> str | None:
    """Why ``logprobs`` (the k most likely tokens to report) is unusable, or None: an int in
    ``[0, vocab]``, or None for none."""
    k = as_int(logprobs)  # NumPy's ints too, as max_new_tokens and top_k take them
    if logprobs is None or (k is not None and 0 <= k <= vocab):
        return None
    return f"logprobs must be None or an int in [0, {vocab}] (the vocabulary), got {logprobs!r}"


def make_requests(prompts: Sequence[Sequence[int]], news: Sequence[int], vocab: int,
                  capacity: int) -> tuple[list[Request], dict[int, Result]]:
    """(the requests that can run, error results by index of those that cannot)."""
    requests, errors = [], {}
    for i, (prompt, new) in enumerate(zip(prompts, news)):
        error = check_request(prompt, new, vocab, capacity)
        if error:
            errors[i] = Result(i, (), "error", error=error)
        else:
            requests.append(Request(i, list(prompt), new))
    return requests, errors


@dataclass(frozen=True)
class Result:
    """What one request produced.

    Attributes:
        index: the request's position in the ``prompts`` given to ``generate``.
        token_ids: generated tokens (an EOS token that ended the request included).
        finish_reason: ``"eos"``, ``"length"`` (max_new_tokens reached) or ``"error"``.
        text: the decoded tokens when a tokenizer was given, else ``None``.
        error: why the request failed (``finish_reason == "error"``), else ``None``.
        logprobs: with ``logprobs=k``, per generated token its log-probability and the k most
            likely ``(token, log-probability)`` pairs (see ``RequestOutput``); else empty.
    """

    index: int
    token_ids: tuple[int, ...]
    finish_reason: Literal["eos", "length", "error"]
    text: str | None = None
    error: str | None = None
    logprobs: tuple = ()

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
    return id_tuple(eos_token_id, "eos_token_id")


def id_tuple(value, name: str) -> tuple[int, ...]:
    """Token ids given as an int, ints, a tensor or array of them (``as_int``'s kinds), or None
    for none, as a tuple; ValueError naming ``name`` for anything else."""
    if value is None:
        return ()
    one = as_int(value)
    try:
        ids = [one] if one is not None else [as_int(i) for i in value]
    except TypeError:
        ids = [None]
    if None in ids:
        raise ValueError(f"{name} must be an int or a list of ints, got {value!r}")
    return tuple(ids)


def with_text(results: list[Result], tokenizer) -> list[Result]:
    """``results`` with ``text`` decoded by ``tokenizer`` (special tokens skipped)."""
    return [dataclasses.replace(r, text=tokenizer.decode(list(r.token_ids),
                                                         skip_special_tokens=True))
            for r in results]
