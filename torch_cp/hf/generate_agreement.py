"""``model.generate`` under torchrun: every rank the patched model spans calls it with the same
arguments (one gather of each rank's problems and the arguments' digest, before the cache is
allocated), the whole input's token ids checked once, and a streamer that raises on one rank
kept from leaving the others in a step's collective."""

from __future__ import annotations

import inspect

import torch

from torch_cp.agreement import across_ranks, agree, described, fingerprint
from torch_cp.hf.generate_cache import GenerateCache
from torch_cp.hf.generate_checks import check_token_ids
from torch_cp.runtime import runtime_and_problems

# model.generate's arguments that only show what it makes, compared on no rank: the usual
# ``streamer=TextStreamer(tokenizer) if rank == 0 else None`` (as ``progress`` in the engine).
SHOWN_ONLY = ("streamer",)


def agreed_generate(self, *args, **kwargs):
    """The class's ``generate``, once every rank the model spans called it with the same
    arguments and generation config (``torch_cp.agreement``): ranks given other prompts
    returned the same wrong tokens, and other lengths or settings hung or died in a collective.
    One gather, before the cache is allocated; the checks that follow read only what agreed, so
    every rank refuses alike."""
    generate = type(self).generate
    runtime, problems = runtime_and_problems(self)  # this rank's own: cast or moved after patching
    try:
        bound = inspect.signature(generate).bind(self, *args, **kwargs)
    except TypeError:
        bound = None  # generate raises it, alike on every rank
    named = _named(bound, args, kwargs)
    agree(runtime, "model.generate", problems, lambda: fingerprint(**{
        name: described(value.logical() if isinstance(value, GenerateCache) else value)
        for name, value in (named | {"model.generation_config": self.generation_config}).items()
        if name not in SHOWN_ONLY}))
    ids = named.get("inputs", named.get("input_ids"))
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        # the whole call's, once: a bad id in a later prefill chunk left the chunks before it
        # written (helper 118); the forwards' own check is skipped while this call runs
        check_token_ids(self, ids)
    self.__dict__["_torch_cp_generating"] = True
    try:
        if (bound is None or bound.arguments.get("streamer") is None
                or not across_ranks(runtime.spans_ranks)):
            return generate(self, *args, **kwargs)
        streamer = bound.arguments["streamer"] = _StreamerAfterSteps(bound.arguments["streamer"])
        out = generate(*bound.args, **bound.kwargs)
    finally:
        self.__dict__.pop("_torch_cp_generating", None)
        for cache in (named.get("cache"), named.get("past_key_values")):
            if isinstance(cache, GenerateCache):  # a call refused before its first forward
                cache.held_pages = 0  # leaves no growth for the next
    if streamer.error is not None:
        raise streamer.error
    return out


class _StreamerAfterSteps:
    """A streamer under torchrun (often on rank 0 alone: ``SHOWN_ONLY``): an error it raised
    inside a step (a closed pipe) left the other ranks in that step's collective, for ever.
    Its first error is kept, the streamer not called again, and the error raised once
    ``generate`` returns (on its rank; the others return their tokens). A streamer cannot
    stop generation early by raising: use a stopping criterion, on every rank."""

    def __init__(self, streamer):
        self.streamer = streamer
        self.error: Exception | None = None

    def put(self, value) -> None:
        self._call(self.streamer.put, value)

    def end(self) -> None:
        self._call(self.streamer.end)

    def _call(self, method, *args) -> None:
        if self.error is None:
            try:
                method(*args)
            except Exception as error:  # noqa: BLE001 (raised after the last step)
                self.error = error


def _named(bound: inspect.BoundArguments | None, args, kwargs) -> dict:
    """The arguments ``bound`` by name (its ``**kwargs`` spread); where they could not be bound
    (generate raises it, alike on ranks called alike), the call's as given."""
    if bound is None:
        return {"positional arguments": args, **kwargs}
    named, spread = dict(bound.arguments), {}
    for name, param in bound.signature.parameters.items():
        if name in named and param.kind == inspect.Parameter.VAR_KEYWORD:
            spread |= named.pop(name)
    return {k: v for k, v in named.items() if k != "self"} | spread
