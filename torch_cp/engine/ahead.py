"""The input ids of a step launched ahead, taken on the device from the step before it."""

from __future__ import annotations

import torch

from torch_cp.engine.scheduler import Row
from torch_cp.engine.steps import LaunchedStep


def ahead_ids(current: LaunchedStep, following: list[Row]) -> torch.Tensor:
    """The input ids of ``following`` (one decode row per request) picked from ``current``'s
    greedy ids on the device, without waiting for ``current``."""
    at = {current.rows[b].request: i for i, b in enumerate(current.sampled)}
    index = [at[r.request] for r in following]
    ids = current.device_ids
    if index != list(range(len(ids))):  # some requests end with current's token
        index_host = torch.tensor(index)
        if ids.is_cuda:  # pinned, so the copy does not wait for the running step
            index_host = index_host.pin_memory()
        ids = ids[index_host.to(ids.device, non_blocking=True)]
    return ids
