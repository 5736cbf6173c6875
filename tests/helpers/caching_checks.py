"""Prefix-caching checks the dense and hybrid tests share: the rows an engine plans, recorded
step by step, and runs with caching off and on compared rank by rank."""

from __future__ import annotations

from torch_cp.engine import Engine


def record_rows(engine) -> list[list]:
    """Appends each step's rows, as the engine plans them, to the returned list."""
    steps, plan = [], engine.launcher.plan

    def planned(rows, tables, state_slots=None):
        steps.append(list(rows))
        return plan(rows, tables, state_slots)

    engine.launcher.plan = planned
    return steps


def first_starts(steps, requests: int) -> list[int]:
    """Each request's first row start: the prompt tokens it found cached."""
    first = {}
    for rows in steps:
        for r in rows:
            first.setdefault(r.request, r.start)
    return [first[i] for i in range(requests)]


def caching_off_and_on(model, prompts, new_tokens: int, *args, **kwargs) -> dict:
    """caching -> (tokens of two runs of one engine, reused tokens, free pages after)."""
    out = {}
    for caching in (False, True):
        engine = Engine(model, *args, prefix_caching=caching, **kwargs)
        runs = [[r.token_ids for r in engine.run(prompts, new_tokens)] for _ in range(2)]
        out[caching] = (runs, engine.reused_tokens, engine.allocator.free_pages)
    return out


def assert_caching_changes_nothing(ranks_out, modes, reference, pages: int) -> None:
    """Every rank's ``caching_off_and_on`` per mode: both runs give ``reference`` with caching
    off and on, caching reuses tokens, and every page is free after."""
    for rank, out in enumerate(ranks_out):
        for mode in modes:
            (plain, reused0, free0), (cached, reused, free) = out[mode][False], out[mode][True]
            assert plain == [reference, reference], (rank, mode)
            assert cached == plain, (rank, mode)
            assert reused0 == 0 and reused > 0, (rank, mode)
            assert free0 == free == pages, (rank, mode)
