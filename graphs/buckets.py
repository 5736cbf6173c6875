"""Captured step shapes. A decode bucket holds ``rows`` one-token rows; a mixed bucket holds up
to ``rows`` rows with up to ``tokens`` tokens in all (``tokens > rows``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Bucket:
    rows: int
    tokens: int

    @property
    def decode(self) -> bool:
        return self.rows == self.tokens

    def fits(self, rows: int, tokens: int, decode: bool) -> bool:
        return decode == self.decode and rows <= self.rows and tokens <= self.tokens


def default_buckets(max_rows: int = 64, mixed: Sequence[tuple[int, int]] = ()) -> list[Bucket]:
    """Decode buckets 1, 2, 4, 8, then every 8 rows up to ``max_rows``, plus the given mixed
    (rows, tokens) buckets."""
    problems = [f"mixed bucket {r}x{t} needs tokens > rows >= 1" for r, t in mixed
                if not 1 <= r < t]
    if max_rows < 1:
        problems.append(f"max_rows must be >= 1, got {max_rows}")
    if problems:
        raise ValueError("invalid buckets: " + "; ".join(problems))
    rows = sorted({r for r in (1, 2, 4, 8) if r <= max_rows} | set(range(8, max_rows + 1, 8))
                  | {max_rows})
    return [Bucket(r, r) for r in rows] + [Bucket(r, t) for r, t in sorted(mixed)]


def pick_bucket(buckets: Sequence[Bucket], rows: int, tokens: int, decode: bool) -> Bucket | None:
    """The smallest bucket the step fits (fewest tokens, then rows), or None."""
    fitting = [b for b in buckets if b.fits(rows, tokens, decode)]
    return min(fitting, key=lambda b: (b.tokens, b.rows)) if fitting else None
