"""Where a hybrid model's prefill chunks end, so that its state is kept where later prompts
can reuse a prefix (``kv/state_checkpoints.py``): the scheduler's rules for a model whose
requests share a cached prefix only at a state checkpoint."""

from __future__ import annotations

from collections.abc import Callable


def checkpoint_end(request, end: int, page: int) -> int:
    """Where a hybrid model's prefill chunk of ``request`` ending at ``end`` stops instead:
    where its cached prefix ends, if past its checkpoint (the next prompt sharing that prefix
    starts from the state taken there), or at the prompt's last page boundary a later prompt
    could share (inside ``prompt[:-1]``), if it would pass either; else at a page boundary if
    it stops short of the prompt's end."""
    start = request.cached
    last = (len(request.prompt) - 1) // page * page
    for boundary in (request.cached_prefix_end, last):
        if start < boundary < end:
            return boundary
    if end < len(request.prompt) and end // page * page > start:
        return end // page * page
    return end


def checkpoint_keys(rows, running: dict, page: int, keys_of: Callable
                    ) -> list[tuple[int, bytes]]:
    """(request, page key) of ``rows`` that end a page of their prompt while prefilling."""
    keys = []
    for row in rows:
        request = running[row.request]
        end = row.start + row.length
        if end % page == 0 and 0 < end <= len(request.prompt) and not request.decoding:
            keys.append((row.request, keys_of(request)[end // page - 1]))
    return keys
