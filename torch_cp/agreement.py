"""Ranks agree on a call before it runs.

Under torchrun every rank patches the same model with the same settings and calls each entry
point (``patch_model``, ``Engine(...)``, ``Engine.run``, ``generate``, ``model.generate``) with
the same arguments: each rank builds its KV from its own prompts, and rank 0's tokens are
broadcast, so ranks given different prompts returned the same wrong tokens, silently, and ranks
given different settings (or a bad one on one rank only) hung or died in a collective that named
nothing. One gather of each rank's problems and a fingerprint of its arguments, before anything
is allocated, turns both into the same ValueError on every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def fingerprint(**arguments) -> dict[str, str]:
    """A short digest of each argument's ``repr`` (prompts can be long)."""
    return {name: hashlib.sha256(repr(value).encode()).hexdigest()[:16]
            for name, value in arguments.items()}


def described(value, depth: int = 0):
    """``value`` as plain data whose ``repr`` is alike on ranks that hold alike values: tensors
    and arrays by dtype, shape and a hash of their bytes (a tensor's ``repr`` elides the middle
    of a long one; its ``tolist`` of 8k x 4096 embeddings took 19 s), containers item by item,
    configs by ``to_dict()``, other objects (a logits processor, a stopping criterion) by their
    type's name and attributes, a few levels deep; modules, tokenizers and objects without an
    attribute dict by their type's name alone, never an address. A function is its type's
    name and its attributes: two functions that compute differently look alike."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype)):
        return value
    if isinstance(value, torch.Tensor):  # by its bytes: a long prompt's or embeddings' values
        data = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        return (str(value.dtype), tuple(value.shape), hashlib.sha256(data.numpy()).hexdigest())
    if hasattr(value, "dtype") and hasattr(value, "tobytes"):  # NumPy arrays and scalars
        return (str(value.dtype), tuple(getattr(value, "shape", ())),
                hashlib.sha256(value.tobytes()).hexdigest())
    if isinstance(value, Mapping):
        return {str(k): described(v, depth) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [described(v, depth) for v in value]
    if callable(getattr(value, "to_dict", None)):
        return described(value.to_dict(), depth)
    name = type(value).__qualname__
    attributes = getattr(value, "__dict__", None)
    # Settings live in attributes (MaxLengthCriteria's max_length): ranks passing the same type
    # with other settings stop at other steps and hang in a collective (helper 72). A module's
    # or a tokenizer's attributes are its weights and vocabulary: the type says enough.
    if (not isinstance(attributes, dict) or depth >= DESCRIBED_DEPTH
            or isinstance(value, torch.nn.Module) or hasattr(value, "get_vocab")):
        return name
    return (name, described(attributes, depth + 1))


DESCRIBED_DEPTH = 4  # levels of objects within objects ``described`` reads


def across_ranks(spans: bool) -> bool:
    """Whether a call that ``spans`` ranks (a patched model's ``runtime.spans_ranks``, a mesh
    of more than one rank) runs in a world of more than one rank: then every rank makes it."""
    return (spans and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1)


def agree(runtime, call: str, problems: list[str], digest: Callable[[], dict[str, str]],
          flag: bool = False) -> bool:
    """``agree_over`` the ranks a step of ``runtime`` (a patched model's) spans."""
    return agree_over(runtime.spans_ranks, runtime.device, call, problems, digest, flag)


def agree_over(spans: bool, device, call: str, problems: list[str],
               digest: Callable[[], dict[str, str]], flag: bool = False) -> bool:
    """Raise on every rank of the world where ``spans``: a ValueError naming every rank's
    ``problems``, or the arguments of ``call`` whose ``digest()`` (made only then) differs
    between ranks. Elsewhere (one rank, or ranks that each run alone), ``problems`` only.
    ``device``: this rank's (NCCL gathers through the current CUDA device). Returns whether
    ``flag`` holds on any rank (gathered, not compared: what one rank saw and every rank must
    act on, as weights loaded on rank 0 alone and broadcast)."""
    if not across_ranks(spans):
        if problems:
            raise ValueError("; ".join(problems))
        return flag
    mine: dict[str, str] = {}
    if not problems:  # a rank with problems refuses with them; its arguments are not compared
        try:
            mine = digest()
        except Exception as e:  # noqa: BLE001 (named on every rank; never a skipped gather)
            problems = [f"the arguments of {call} cannot be compared: {type(e).__name__}: {e}"]
    gathered = _gathered(device, (problems, mine, flag))
    ranks_of: dict[str, list[int]] = {}  # each message once, with every rank that found it
    for rank, (p, _, _) in enumerate(gathered):
        if p:
            ranks_of.setdefault("; ".join(p), []).append(rank)
    if ranks_of:
        if list(ranks_of) == ["; ".join(problems)]:  # this rank's own, alone: as one rank says
            raise ValueError("; ".join(problems))
        raise ValueError(" | ".join(
            f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {m}" for m, r in ranks_of.items()))
    names = set().union(*(d for _, d, _ in gathered))
    differ = sorted(name for name in names if len({d.get(name) for _, d, _ in gathered}) > 1)
    if differ:
        raise ValueError(f"the ranks called {call} with different {', '.join(differ)}: every "
                         f"rank must pass the same arguments")
    return any(f for _, _, f in gathered)


class OtherRankFailed(RuntimeError):
    """``together``'s work failed on another rank (named, with its error), not on this one."""


def together(spans: bool, device, call: str, work: Callable[[], T]) -> T:
    """``work()`` (an allocation, with no collective in it) on every rank of the world where
    ``spans``, raising on every rank where it raised on any: a pool that runs out of memory on
    one rank only (the ranks' free memory differs) left the others waiting in the next step's
    collective, for ever. One gather of each rank's outcome; elsewhere ``work()`` alone. The
    failing ranks raise their own error (a KeyboardInterrupt too); the others drop what they
    made and raise a ``torch.OutOfMemoryError`` (when every failure was one) or an
    ``OtherRankFailed`` naming each failing rank and its error."""
    if not across_ranks(spans):
        return work()
    try:
        result = work()
    except BaseException as error:  # gathered, then raised as it came (no frame keeps it)
        mine = (type(error).__name__, str(error))
        others = [_said(rank, outcome) for rank, outcome in
                  enumerate(_gathered(device, mine)) if outcome not in (None, mine)]
        if others and hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"{call} failed on other ranks too: {'; '.join(others)}")
        raise
    failed = {rank: outcome for rank, outcome in enumerate(_gathered(device, None))
              if outcome is not None}
    if not failed:
        return result
    del result  # a pool kept alive by this frame, which the exception's traceback holds
    named = "; ".join(_said(rank, outcome) for rank, outcome in failed.items())
    oom = all(kind == torch.OutOfMemoryError.__name__ for kind, _ in failed.values())
    raise (torch.OutOfMemoryError if oom else OtherRankFailed)(
        f"{call} failed on {'rank' if len(failed) == 1 else 'ranks'} "
        f"{', '.join(map(str, failed))}, so it stops on every rank ({named})")


def _said(rank: int, outcome: tuple[str, str]) -> str:
    """A rank's failure, as ``together`` names it: its rank, the error's type and message."""
    kind, message = outcome
    return f"rank {rank}: {kind}: {message}"


def _gathered(device, obj) -> list:
    """Every rank's ``obj``, in rank order. ``device``: this rank's (NCCL moves the objects
    through the current CUDA device: make it this rank's)."""
    gathered: list = [None] * dist.get_world_size()
    device = torch.device(device) if device is not None else None
    on_cuda = device is not None and device.type == "cuda"
    with torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
        dist.all_gather_object(gathered, obj)
    return gathered
