"""What FlashInfer 0.7.2's FA MLA planner accepts, and where it plans causal MLA exactly.

Its planner refuses more than 16384 work items. ``mla_work_items`` bounds the count from query
lengths alone, so every partner refuses the same step before planning (``PlannerCapExceeded``)
and the engine can retry it smaller. Its causal kernels drop keys unless the query tile is a
multiple of the head count (``causal_mla_on_flashinfer``; ``own_token_parts`` runs the heads
in parts that are). Host arithmetic only: nothing here imports FlashInfer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch_cp.plan import StepRefused

FA_MAX_WORK_ITEMS = 16384


class PlannerCapExceeded(StepRefused, ValueError):
    """A step needs more MLA planner work items than FlashInfer accepts; the engine retries it
    smaller (a ``StepRefused``: fewer prefill tokens first, then fewer rows)."""

    def __init__(self, work_items: int, cap: int, num_rows: int, num_heads: int):
        super().__init__(f"MLA step of {num_rows} rows x {num_heads} heads needs up to "
                         f"{work_items} planner work items; FlashInfer's cap is {cap} "
                         f"(torch_cp.generate retries such a step smaller by itself; with "
                         f"model.generate, prefill in chunks: prefill_chunk_size=...)")
        self.work_items = work_items
        self.cap = cap
        self.num_rows = num_rows
        self.num_heads = num_heads


def _query_tile(q_lens: Sequence[int], num_heads: int) -> int:
    """FA MLA query tile: 64 rows, or 128 (a 2-CTA cluster) when the mean ``q * H`` > 64."""
    return 128 if sum(q_lens) * num_heads // max(len(q_lens), 1) > 64 else 64


def mla_work_items(q_lens: Sequence[int], num_heads: int, num_sms: int) -> int:
    """Upper bound of FlashInfer 0.7.2's FA MLA planner work items, from query lengths alone.

    The planner makes ``ceil(q * H / tile)`` query tiles per row and splits each tile's KV at a
    limit no smaller than the mean KV per cluster, so the splits add at most ``clusters =
    num_sms // cluster_size`` items to one item per tile, whatever the KV lengths are (which
    differ between partners). The bound is within ``clusters`` of the planner's count.

    Args:
        q_lens: query tokens of every planned row (padding rows and the token-padding row too).
        num_heads: query heads the kernel sees (``context_q_heads`` for the context).
        num_sms: streaming multiprocessors of the device.
    """
    if not q_lens:
        return 0
    tile = _query_tile(q_lens, num_heads)
    tiles = sum((q * num_heads + tile - 1) // tile for q in q_lens)
    return tiles + num_sms // (tile // 64)


def check_mla_work_items(q_lens: Sequence[int], num_heads: int, num_sms: int,
                         num_rows: int | None = None) -> int:
    """Raise ``PlannerCapExceeded`` when ``mla_work_items`` exceeds the cap; else return it."""
    items = mla_work_items(q_lens, num_heads, num_sms)
    if items > FA_MAX_WORK_ITEMS:
        raise PlannerCapExceeded(items, FA_MAX_WORK_ITEMS,
                                 len(q_lens) if num_rows is None else num_rows, num_heads)
    return items


def mixed_bucket_problems(shapes: Sequence[tuple[int, int]], num_heads: int,
                          num_sms: int) -> list[str]:
    """The mixed buckets (rows, tokens) whose steps the MLA planner always refuses: a capture
    step's tokens are all padding, in one row past the bucket's rows, and any step replayed in
    the bucket is padded to its tokens, so none fits under the cap."""
    problems = []
    for rows, tokens in shapes:
        items = mla_work_items([0] * rows + [tokens], num_heads, num_sms)
        if items > FA_MAX_WORK_ITEMS:
            problems.append(f"mixed bucket ({rows}, {tokens}): an MLA step of {tokens} tokens x "
                            f"{num_heads} heads needs up to {items} FlashInfer planner work "
                            f"items, over its cap of {FA_MAX_WORK_ITEMS}: capture fewer tokens")
    return problems


def causal_mla_on_flashinfer(q_lens: Sequence[int], num_heads: int) -> bool:
    """FlashInfer 0.7.2 plans causal MLA exactly only when the query tile is a multiple of H."""
    return _query_tile(q_lens, num_heads) % num_heads == 0


# The most heads one own-token launch takes where FlashInfer would not plan all of them exactly:
# a power of two no larger than either query tile divides both.
MAX_OWN_PART = 64


def own_token_parts(q_lens: Sequence[int], num_heads: int) -> tuple[int, ...]:
    """The query heads FlashInfer's causal own-token kernel runs, one launch per part over
    consecutive heads: all at once where it plans causal MLA exactly, else powers of two of at
    most ``MAX_OWN_PART``, largest first (20 heads as 16 + 4), each of which divides either
    query tile. No padded heads: padding 20 to 32 copied every query and output (40 of a 341 ms
    GLM-4.7-Flash prefill, run 93) and computed 12 heads for nothing."""
    if causal_mla_on_flashinfer(q_lens, num_heads):
        return (num_heads,)
    rest = num_heads % MAX_OWN_PART
    return ((MAX_OWN_PART,) * (num_heads // MAX_OWN_PART)
            + tuple(1 << b for b in reversed(range(rest.bit_length())) if rest >> b & 1))


def max_own_parts(num_heads: int) -> int:
    """The most parts ``own_token_parts`` cuts ``num_heads`` into, at any query lengths."""
    return max(1, num_heads // MAX_OWN_PART + (num_heads % MAX_OWN_PART).bit_count())


def own_parts_for(own_tokens: str, q_lens: Sequence[int], num_heads: int
                  ) -> tuple[int, ...] | None:
    """The head parts a step's own tokens run in on FlashInfer under the backend's
    ``own_tokens`` (``"auto"``: ``own_token_parts``); None where they run on torch."""
    return own_token_parts(q_lens, num_heads) if own_tokens == "auto" else None
