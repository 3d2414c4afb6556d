"""Captured step shapes (LAPS §3.1): the `(tokens, batch)` buckets a runner keeps ready.

On CUDA a runner captures one graph per bucket and replays it when a batch of short
(re-)prefills fits one; on the CPU the same grid is bucketed, padded execution. The
batch policy (`policies.laps`) uses the grid to choose its target depth D (the largest
captured batch the budget allows) and to group requests whose lengths share a bucket, so
that little padding is needed. Pure: plain numbers in, plain numbers out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["ShapeGrid", "parse_sizes"]


def parse_sizes(name: str, value: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Sizes as a sorted tuple of distinct positive ints, from "8,16,32" or a sequence;
    a ValueError names the option."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        try:
            sizes = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{name} must be comma-separated positive integers, got {value!r}") from None
    else:
        sizes = [int(v) for v in value]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"{name} must be one or more positive integers, got {value!r}")
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class ShapeGrid:
    """Captured prompt-length buckets and batch sizes (the paper's powers of two by default)."""

    tokens: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", parse_sizes("shape_tokens", self.tokens))
        object.__setattr__(self, "batches", parse_sizes("shape_batches", self.batches))

    def token_bucket(self, num_tokens: int) -> int | None:
        """The smallest captured length holding `num_tokens` (None: longer than every bucket)."""
        i = bisect.bisect_left(self.tokens, num_tokens)
        return self.tokens[i] if i < len(self.tokens) else None

    def batch_bucket(self, batch: int) -> int | None:
        """The smallest captured batch size holding `batch` requests (None: more than the largest)."""
        i = bisect.bisect_left(self.batches, batch)
        return self.batches[i] if i < len(self.batches) else None

    def depth_at_most(self, batch: int) -> int:
        """The largest captured batch size <= `batch` (at least 1: a batch of one always runs)."""
        i = bisect.bisect_right(self.batches, batch)
        return self.batches[i - 1] if i > 0 else 1

    def next_depth(self, batch: int) -> int:
        """The next captured batch size above `batch` (itself when it is the largest)."""
        i = bisect.bisect_right(self.batches, batch)
        return self.batches[i] if i < len(self.batches) else self.batches[-1]

    def padded(self, lengths: list[int]) -> tuple[int, int] | None:
        """The captured `(tokens, batch)` shape a batch of these lengths pads to (every
        request right-padded to one length bucket, the batch to a batch bucket); None when
        it fits no captured shape (the runner then runs it unpadded)."""
        if not lengths:
            return None
        length = self.token_bucket(max(lengths))
        batch = self.batch_bucket(len(lengths))
        if length is None or batch is None:
            return None
        return length, batch
