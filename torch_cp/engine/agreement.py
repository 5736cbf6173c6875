"""Ranks agree on a call before it runs.

Under torchrun every rank of a patched model calls ``generate`` with the same arguments: each
rank builds its KV from its own prompts, and rank 0's tokens are broadcast, so ranks given
different prompts returned the same wrong tokens, silently, and ranks given different settings
hung or died in a collective that named nothing. One gather of each rank's problems and a
fingerprint of its arguments, before anything is allocated, turns both into the same
ValueError on every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist


def fingerprint(**arguments) -> dict[str, str]:
    """A short digest of each argument's ``repr`` (prompts can be long)."""
    return {name: hashlib.sha256(repr(value).encode()).hexdigest()[:16]
            for name, value in arguments.items()}


def agree(runtime, call: str, problems: list[str], digest: Callable[[], dict[str, str]]
          ) -> None:
    """Raise on every rank a step of ``runtime`` spans: a ValueError naming every rank's
    ``problems``, or the arguments of ``call`` whose ``digest()`` (made only then) differs
    between ranks. On one rank (or ranks that each run alone), ``problems`` only."""
    spans = (runtime.spans_ranks and dist.is_available() and dist.is_initialized()
             and dist.get_world_size() > 1)
    if not spans:
        if problems:
            raise ValueError("; ".join(problems))
        return
    gathered: list = [None] * dist.get_world_size()
    device = torch.device(runtime.device)
    # NCCL moves the objects through the current CUDA device: make it this rank's.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(gathered, (problems, digest()))
    found = [f"rank {rank}: {'; '.join(p)}" for rank, (p, _) in enumerate(gathered) if p]
    if found:
        raise ValueError(" | ".join(found) if len(found) > 1 or not problems else
                         "; ".join(problems))
    differ = sorted(name for name in gathered[0][1]
                    if len({d.get(name) for _, d in gathered}) > 1)
    if differ:
        raise ValueError(f"the ranks called {call} with different {', '.join(differ)}: every "
                         f"rank must pass the same arguments")
