"""Receiver-side bookkeeping of incoming KV transfers: which tokens arrived, intact or not.

Pure: no I/O and no clock reads of its own (the clock is injected). Transports report
chunks through `on_chunk`; the worker waits on `wait` before it runs a stage on the
transferred KV, and recomputes from tokens when `wait` returns False.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ExpectedTransfer:
    """One transfer the receiver reserved blocks for, and what has arrived of it."""

    transfer_id: str
    request_id: str
    token_start: int
    token_end: int
    dst_blocks: tuple[int, ...]
    expected_at: float
    # Disjoint, sorted, non-adjacent half-open token ranges received so far.
    received: list[tuple[int, int]] = field(default_factory=list)
    failed: bool = False
    cancelled: bool = False
    completed_at: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        return not self.failed and self.received == [(self.token_start, self.token_end)]

    @property
    def received_tokens(self) -> int:
        return sum(end - start for start, end in self.received)


def add_range(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """Insert [start, end) into sorted disjoint ranges, merging overlapping and touching ones."""
    if start >= end:
        return
    i = bisect.bisect_left(ranges, (start, start))
    # The range before may overlap or touch the new one.
    if i > 0 and ranges[i - 1][1] >= start:
        i -= 1
    j = i
    while j < len(ranges) and ranges[j][0] <= end:
        start, end = min(start, ranges[j][0]), max(end, ranges[j][1])
        j += 1
    ranges[i:j] = [(start, end)]


class TransferTracker:
    """Tracks expected KV transfers on the receiving worker; chunks may arrive in any order."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, early_chunk_ttl_s: float = 30.0):
        self._clock = clock
        self._early_chunk_ttl_s = early_chunk_ttl_s
        self._transfers: dict[str, ExpectedTransfer] = {}
        # Chunks that beat their expect() call (a fast sender racing the receiver's own
        # bookkeeping): (arrival time, start, end, ok), replayed when expect() comes.
        self._early: dict[str, list[tuple[float, int, int, bool]]] = {}

    def expect(self, transfer_id: str, request_id: str, num_tokens: int, dst_blocks: list[int] | tuple[int, ...],
               *, token_start: int = 0) -> ExpectedTransfer:
        """Start tracking tokens [token_start, token_start + num_tokens) of a transfer."""
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id} is already expected")
        if num_tokens < 0 or token_start < 0:
            raise ValueError(f"bad token range: start {token_start}, {num_tokens} tokens")
        entry = ExpectedTransfer(transfer_id, request_id, token_start, token_start + num_tokens,
                                 tuple(dst_blocks), expected_at=self._clock())
        self._transfers[transfer_id] = entry
        for _, start, end, ok in self._early.pop(transfer_id, []):
            self._record(entry, start, end, ok)
        self._settle(entry)
        return entry

    def on_chunk(self, transfer_id: str, token_start: int, token_end: int, checksum_ok: bool) -> None:
        """Record that tokens [token_start, token_end) arrived; a bad checksum fails the transfer."""
        entry = self._transfers.get(transfer_id)
        if entry is None:
            self._prune_early()
            self._early.setdefault(transfer_id, []).append((self._clock(), token_start, token_end, checksum_ok))
            return
        if entry.done.is_set():
            return  # late or duplicate chunks cannot change a settled outcome
        self._record(entry, token_start, token_end, checksum_ok)
        self._settle(entry)

    def is_complete(self, transfer_id: str) -> bool:
        """Every expected token arrived and every checksum matched."""
        entry = self._transfers.get(transfer_id)
        return entry is not None and entry.complete

    def failed(self, transfer_id: str) -> bool:
        """A chunk arrived with a bad checksum, or the transfer was cancelled."""
        entry = self._transfers.get(transfer_id)
        return entry is not None and (entry.failed or entry.cancelled)

    def get(self, transfer_id: str) -> ExpectedTransfer | None:
        """The tracked transfer, or None."""
        return self._transfers.get(transfer_id)

    def elapsed_s(self, transfer_id: str) -> float | None:
        """Seconds from expect() to completion, or None while incomplete."""
        entry = self._transfers.get(transfer_id)
        if entry is None or entry.completed_at is None:
            return None
        return entry.completed_at - entry.expected_at

    async def wait(self, transfer_id: str, timeout_s: float) -> bool:
        """True once complete; False on failure, cancellation or after timeout_s."""
        entry = self._transfers.get(transfer_id)
        if entry is None:
            raise KeyError(f"transfer {transfer_id} is not expected")
        if not entry.done.is_set():
            try:
                await asyncio.wait_for(entry.done.wait(), max(0.0, timeout_s))
            except TimeoutError:
                return False
        return entry.complete and not entry.cancelled

    def cancel(self, transfer_id: str) -> None:
        """Give up on a transfer: waiters return False; later chunks are ignored."""
        entry = self._transfers.get(transfer_id)
        if entry is not None and not entry.done.is_set():
            entry.cancelled = True
            entry.done.set()

    def forget(self, transfer_id: str) -> None:
        """Drop a transfer's state (after its stage ran, or after cancel)."""
        entry = self._transfers.pop(transfer_id, None)
        if entry is not None:
            entry.cancelled = entry.cancelled or not entry.done.is_set()
            entry.done.set()  # nobody may be left waiting on a forgotten transfer
        self._early.pop(transfer_id, None)

    def pending(self) -> list[str]:
        """Transfers still waiting for chunks."""
        return [tid for tid, entry in self._transfers.items() if not entry.done.is_set()]

    def _record(self, entry: ExpectedTransfer, start: int, end: int, ok: bool) -> None:
        if not ok:
            entry.failed = True
            return
        # Tokens outside the expected range belong to neighbouring transfers sharing an
        # edge block; only the expected part counts.
        add_range(entry.received, max(start, entry.token_start), min(end, entry.token_end))

    def _settle(self, entry: ExpectedTransfer) -> None:
        if entry.failed:
            entry.done.set()
        elif entry.complete or entry.token_start == entry.token_end:
            entry.received = [(entry.token_start, entry.token_end)]
            entry.completed_at = self._clock()
            entry.done.set()

    def _prune_early(self) -> None:
        horizon = self._clock() - self._early_chunk_ttl_s
        for transfer_id in [tid for tid, chunks in self._early.items() if chunks[-1][0] < horizon]:
            del self._early[transfer_id]
