"""Log-probabilities of the tokens a step samples, for the requests that ask (``logprobs=k``).

They are taken on the device right after the step's launch, before a step launched ahead
reuses the logits buffer; the top k, and a greedy row's own token's (known on the device), go
home at once in one pinned copy (``HomeBound``), so reading them waits for this step only, not
for the step launched ahead (a plain ``.item()`` of a CUDA tensor waited for both).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torch_cp.engine.steps import HomeBound, LaunchedStep, to_device


@dataclass(frozen=True)
class LogprobRows:
    """A launched step's log-probabilities: each asking row's index into ``device`` ([rows, V]
    log-softmax), its k, and its top k values and ids (and greedy rows' own tokens') on their
    way home."""

    index: dict[int, int]
    k: dict[int, int]
    device: torch.Tensor
    home: HomeBound


def take(step: LaunchedStep, asked: Mapping[int, int | None]) -> LogprobRows | None:
    """The log-probabilities of ``step``'s sampling rows whose request ``asked`` for k of them
    (request id -> k, or None for none); None when no row asks."""
    want = [(i, b) for i, b in enumerate(step.sampled)
            if asked.get(step.rows[b].request) is not None]
    if not want:
        return None
    rows = to_device([i for i, _ in want], step.logits.device)
    lp = torch.log_softmax(step.logits.index_select(0, rows).float(), dim=-1)
    ks = {b: asked[step.rows[b].request] for _, b in want}
    top = lp.topk(max(max(ks.values()), 1), dim=-1)
    chosen = (() if step.device_ids is None else
              (lp.gather(1, step.device_ids.index_select(0, rows)[:, None])[:, 0],))
    return LogprobRows({b: j for j, (_, b) in enumerate(want)}, ks, lp,
                       HomeBound(top.values, top.indices, *chosen))


def of_tokens(step: LaunchedStep, tokens: dict[int, int]) -> dict[int, tuple]:
    """Per request of ``step`` that asked and got a token in ``tokens`` (request id -> token):
    (its token's log-probability, ((token, log-probability) of the k most likely, ...))."""
    lp = step.logprob_rows
    if lp is None:
        return {}
    values, indices, *chosen = lp.home.arrived()
    out = {}
    for b, row in enumerate(step.rows):
        token = tokens.get(row.request)
        if token is None or b not in lp.index:
            continue
        j, k = lp.index[b], lp.k[b]
        # A sampled token was drawn on the host after the launch: no step runs ahead then.
        own = chosen[0][j].item() if chosen else lp.device[j, token].item()
        out[row.request] = (own, tuple(zip(indices[j, :k].tolist(), values[j, :k].tolist())))
    return out
