"""Which step shapes to capture, and which captured shape a step replays (the shape itself is
``torch_cp.plan.Bucket``, carried by the step plan)."""

from __future__ import annotations

from collections.abc import Sequence

from torch_cp.plan import Bucket


def default_buckets(max_rows: int = 64, table_width: int = 1,
                    mixed: Sequence[tuple[int, int]] = ()) -> list[Bucket]:
    """Decode buckets 1, 2, 4, 8, then every 8 rows up to ``max_rows``, plus the given mixed
    (rows, tokens) buckets; every row's page table ``table_width`` pages wide."""
    problems = [f"mixed bucket {r}x{t} needs tokens > rows >= 1" for r, t in mixed
                if not 1 <= r < t]
    if max_rows < 1:
        problems.append(f"max_rows must be >= 1, got {max_rows}")
    if table_width < 1:
        problems.append(f"table_width must be >= 1, got {table_width}")
    if problems:
        raise ValueError("invalid buckets: " + "; ".join(problems))
    rows = sorted({r for r in (1, 2, 4, 8) if r <= max_rows} | set(range(8, max_rows + 1, 8))
                  | {max_rows})
    shapes = [(r, r) for r in rows] + sorted(mixed)
    return [Bucket(r, t, r * table_width) for r, t in shapes]


def pick_bucket(buckets: Sequence[Bucket], rows: int, tokens: int, decode: bool,
                table_width: int) -> Bucket | None:
    """The smallest bucket the step fits (fewest tokens, then rows), or None."""
    fitting = [b for b in buckets if b.fits(rows, tokens, decode, table_width)]
    return min(fitting, key=lambda b: (b.tokens, b.rows)) if fitting else None
