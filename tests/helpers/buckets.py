"""Buckets for padding a step in tests: rows and tokens padded to given counts (what a captured
bucket does), page tables as wide as the step's longest."""

from __future__ import annotations

from collections.abc import Sequence

from torch_cp.plan import Bucket


def padding_bucket(q_lens: Sequence[int], page_tables: Sequence[Sequence[int]],
                   rows_to: int | None = None, tokens_to: int | None = None) -> Bucket | None:
    """The bucket that pads a step of ``q_lens`` to ``rows_to`` rows and ``tokens_to`` tokens
    (``None`` for both: no bucket). A decode step stays one unless ``tokens_to`` exceeds its
    rows; a multi-token step's bucket has more tokens than rows."""
    if rows_to is None and tokens_to is None:
        return None
    rows = max(rows_to or len(q_lens), len(q_lens), 1)
    if all(q == 1 for q in q_lens) and tokens_to in (None, rows):
        tokens = rows
    else:
        tokens = max(tokens_to or 0, sum(q_lens), rows + 1)
    width = max([len(t) for t in page_tables] + [1])
    return Bucket(rows, tokens, rows * width)
