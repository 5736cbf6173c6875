"""What a run tells its user: one progress bar over prompt and generated tokens, status lines
while CUDA graphs are captured and layers compiled, and warnings where a setting is ignored or a
request runs past the model's positions.

Status lines go through ``tqdm.write`` to stderr on rank 0: unlike ``logging`` at INFO they show
without any logging setup, and unlike a bare ``print`` they do not tear a bar being drawn. Every
count is a host int the scheduler already holds: the bar adds no device sync to a step.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable

import torch.distributed as dist
from tqdm import tqdm

from torch_cp.engine.requests import Request
from torch_cp.engine.sampling import SamplingParams

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class EngineWarning(UserWarning):
    """Base of the engine's warnings."""


class IgnoredSettingWarning(EngineWarning):
    """A setting was given that has no effect (``top_k`` / ``top_p`` at temperature 0)."""


class PositionLimitWarning(EngineWarning):
    """A request runs past the model's ``max_position_embeddings``."""


def rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def warn(message: str, category: type[Warning], remembered: bool = True) -> None:
    """``warnings.warn`` attributed to the first caller outside torch_cp (the user's line), on
    rank 0 only (under torchrun every rank makes the same call: one warning, as one bar).
    ``remembered=False`` for a message naming requests, each one its own: the caller's warning
    registry would keep every one (a server's, one a request: helper 119)."""
    if not rank0():
        return
    frame, level = sys._getframe(1), 2  # level 2: the frame that called warn()
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    if remembered or frame is None:
        warnings.warn(message, category, stacklevel=level)
    else:  # shown as often as a remembered unique message is, kept in no registry
        warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                               module=frame.f_globals.get("__name__"), registry=None,
                               module_globals=frame.f_globals)


def warn_ignored_sampling(sampling: SamplingParams) -> None:
    given = [f"{name}={value}" for name, value in (("top_k", sampling.top_k),
                                                   ("top_p", sampling.top_p)) if value is not None]
    if sampling.greedy and given:
        warn(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} ignored at temperature "
             f"0 (greedy decoding takes the most likely token): pass temperature > 0 to sample "
             f"with {'it' if len(given) == 1 else 'them'}, or leave "
             f"{'it' if len(given) == 1 else 'them'} out", IgnoredSettingWarning)


def max_positions(model) -> int | None:
    """The positions the model is meant for: the text config's ``max_position_embeddings`` or,
    where its RoPE is scaled by a ``factor`` (YaRN, linear, llama3: Qwen3 at 128k keeps 40960
    there), that factor times the original length when longer. None when the config has no
    positive int limit."""
    text = _text_config(model)
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit < 1:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        original = rope.get("original_max_position_embeddings")
        limit = max(limit, int(factor * (original if isinstance(original, int) else limit)))
    return limit


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def warn_past_positions(model, requests: Iterable[Request]) -> None:
    """One warning for every request whose prompt + max_new_tokens exceeds the model's
    positions (``max_positions``); they still run."""
    limit = max_positions(model)
    if limit is None:
        return
    long = {r.index: len(r.prompt) + r.max_new_tokens for r in requests
            if len(r.prompt) + r.max_new_tokens > limit}
    if long:
        raw = getattr(_text_config(model), "max_position_embeddings", None)
        what = (f"max_position_embeddings ({limit})" if limit == raw
                else f"positions with its scaled RoPE ({limit})")
        shown = ", ".join(f"request {i} ({n})" for i, n in list(long.items())[:8])
        warn(f"{len(long)} request(s) need more positions (prompt + max_new_tokens) than the "
             f"model's {what}: {shown}"
             f"{', ...' if len(long) > 8 else ''}. They still run, but the model is not meant for "
             f"positions past {limit} and its output may degrade there; shorten the prompt "
             f"or max_new_tokens to stay within it",
             PositionLimitWarning, remembered=False)


def status(message: str, show: bool = True) -> None:
    """One line to stderr on rank 0 (above a progress bar being drawn, if any)."""
    if show and rank0():
        tqdm.write(f"torch_cp: {message}", file=sys.stderr)


class Progress:
    """One tqdm bar (rank 0, when ``show``) over a run's tokens: the prompt tokens as they are
    prefilled (a long prompt in chunks moves it) and the new tokens as they are generated.

    Its total is every prompt token plus every max_new_tokens; a request that stops early
    (EOS, an error) takes what it will not do off the total. The description names the phase
    of the last step ("prefill" when it prefilled prompt tokens, else "decode").
    """

    def __init__(self, requests: Iterable[Request], show: bool):
        requests = list(requests)
        self.prompt_total = sum(len(r.prompt) for r in requests)
        self.prefilled = self.generated = 0
        self.phase = "prefill"
        total = self.prompt_total + sum(r.max_new_tokens for r in requests)
        self.bar = tqdm(total=total, unit="tok", desc=self.phase, disable=not (show and rank0()))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def advance(self, prefilled: int, generated: int) -> None:
        """A step prefilled ``prefilled`` prompt tokens and generated ``generated`` tokens."""
        self.prefilled += prefilled
        self.generated += generated
        if self.bar.disable:
            return
        phase = "prefill" if prefilled else "decode"
        if phase != self.phase:
            self.phase = phase
            self.bar.set_description_str(phase, refresh=False)
        self.bar.set_postfix_str(f"prompt {self.prefilled}/{self.prompt_total}, "
                                 f"new {self.generated}", refresh=False)
        self.bar.update(prefilled + generated)

    def stop(self, request: Request) -> None:
        """``request`` ended: its prompt tokens not prefilled and tokens not generated leave
        the total."""
        unfilled = len(request.prompt) - min(request.cached, len(request.prompt))
        self.prompt_total -= unfilled
        self.bar.total -= unfilled + request.max_new_tokens - len(request.generated)
