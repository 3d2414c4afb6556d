"""Session history kept on the bound worker between rounds (AMPD §3, "Binding"; pure).

An agentic session sends round after round, each prompt its whole history plus a new turn.
When a round finishes on the worker its session is bound to, the KV of everything it
computed stays here, pinned under the session, so that the next round's prompt hits the
prefix cache instead of recomputing (or re-transferring) the history:

* a pin holds one reference on each block of the round's indexed prefix (the blocks a
  later prompt with that prefix would hit), so neither the LRU of free cached blocks nor
  another request can take them;
* the next round's pin replaces the last one (the new prefix includes the old);
* a pin ends when the session closes (`release`), when it sat unused for its TTL
  (`expire`), or under memory pressure (`evict_lru`), which the scheduler asks for only
  after every unpinned free block is gone and before it preempts a running request:
  pinned history is evicted last, least recently used first. An evicted pin's blocks go
  to the free LRU, so the history may still hit until they are reused.

A round that arrives expecting history (`history_len > 0`) and finds no pin here counts
as a lost history (`history_lost`): it was evicted, expired, or the session was re-bound
to this worker, and the history is recomputed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import count
from typing import NamedTuple

from splitserve.core.block_manager import BlockManager
from splitserve.core.sequence import Sequence, SessionHold


class SessionPinStats(NamedTuple):
    """A worker's pinned-history figures (the counters only grow)."""

    pinned_sessions: int = 0
    pinned_blocks: int = 0
    evictions: int = 0
    expirations: int = 0
    history_hits: int = 0
    history_lost: int = 0


@dataclass(slots=True)
class _Pin:
    block_ids: list[int]
    num_tokens: int
    expires_at: float
    version: int  # matches the expiry heap entry that is current
    # The round's token ids (the finished sequence's list, which nothing appends to any more)
    # and the chained hashes of its pinned blocks: the next round's prompt starts with them,
    # so it takes them instead of hashing its whole history again (`seed_block_hashes`).
    token_ids: list[int]
    block_hashes: list[int]


class SessionPins:
    """Pinned session histories of one worker, over its block manager."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self._pins: dict[str, _Pin] = {}  # least recently used first (re-pinning moves to the end)
        self._expiry: list[tuple[float, int, str]] = []  # (expires_at, version, session) min-heap, lazy
        self._versions = count()
        self.num_pinned_blocks = 0
        # Counters (monotonic) for metrics.
        self.evictions = 0  # pins dropped under memory pressure
        self.expirations = 0  # pins dropped after their idle TTL
        self.history_hits = 0  # rounds that found their session's history pinned here
        self.history_lost = 0  # rounds that expected history here and found none (recomputed)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def stats(self) -> SessionPinStats:
        return SessionPinStats(len(self._pins), self.num_pinned_blocks, self.evictions, self.expirations,
                               self.history_hits, self.history_lost)

    def block_ids(self) -> list[int]:
        """Every pinned block, once per pin holding it (each pin holds one reference)."""
        return [b for pin in self._pins.values() for b in pin.block_ids]

    def blocks_of(self, session_id: str) -> list[int]:
        """The session's pinned blocks, in token order (empty when nothing is pinned)."""
        pin = self._pins.get(session_id)
        return list(pin.block_ids) if pin else []

    def pinned_tokens(self, session_id: str) -> int:
        pin = self._pins.get(session_id)
        return pin.num_tokens if pin else 0

    def note_round(self, hold: SessionHold) -> None:
        """A round of `hold.session_id` arrived: count whether its history was still here."""
        if hold.session_id in self._pins:
            self.history_hits += 1
        elif hold.history_len > 0:
            self.history_lost += 1

    def seed_block_hashes(self, session_id: str, seq: Sequence) -> bool:
        """Give a new round's sequence its pinned history's block hashes when its prompt starts
        with that history (`BlockManager.seed_block_hashes`); whether it did."""
        pin = self._pins.get(session_id)
        return pin is not None and self.block_manager.seed_block_hashes(seq, pin.token_ids, pin.block_hashes)

    def pin(self, hold: SessionHold, seq: Sequence, now: float) -> int:
        """Pin the indexed prefix of a finished round's KV under its session; tokens pinned."""
        blocks = self.block_manager.indexed_prefix(seq)
        self.block_manager.retain(blocks)  # before the old pin goes: shared blocks stay cached
        self.release(hold.session_id)
        version = next(self._versions)
        expires_at = now + hold.ttl_s
        # Nothing to seed from a pin of no blocks (e.g. prefix caching off): keep no token list then.
        self._pins[hold.session_id] = _Pin(blocks, len(blocks) * self.block_manager.block_size, expires_at, version,
                                           seq.token_ids if blocks else [], seq.block_hashes[:len(blocks)])
        heapq.heappush(self._expiry, (expires_at, version, hold.session_id))
        self.num_pinned_blocks += len(blocks)
        return len(blocks) * self.block_manager.block_size

    def release(self, session_id: str) -> bool:
        """Drop a session's pin (closed, replaced, expired or evicted); whether there was one."""
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        self.block_manager.release_blocks(pin.block_ids)
        self.num_pinned_blocks -= len(pin.block_ids)
        return True

    def expire(self, now: float) -> int:
        """Drop the pins idle past their TTL; how many."""
        dropped = 0
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, version, session_id = heapq.heappop(expiry)
            pin = self._pins.get(session_id)
            if pin is not None and pin.version == version:  # else replaced or released since
                self.release(session_id)
                dropped += 1
        self.expirations += dropped
        if len(expiry) > 2 * len(self._pins) + 64:  # stale entries of replaced pins: rebuild
            self._expiry = [(p.expires_at, p.version, s) for s, p in self._pins.items()]
            heapq.heapify(self._expiry)
        return dropped

    def evict_lru(self, free_blocks_needed: int, keep: str | None = None) -> bool:
        """Drop pins, least recently used first (never `keep`'s: the session asking for room),
        until that many blocks are free; whether they are.

        Nothing is dropped when even every pin would not free enough (a pin's blocks may be
        shared with running requests): that would lose histories for nothing.
        """
        bm = self.block_manager
        if bm.num_free_blocks >= free_blocks_needed:
            return True
        victims = [s for s in self._pins if s != keep]
        if not victims or bm.num_free_blocks + bm.freeable_if_released(
                [b for s in victims for b in self._pins[s].block_ids]) < free_blocks_needed:
            return False
        for session_id in victims:
            if bm.num_free_blocks >= free_blocks_needed:
                break
            self.release(session_id)
            self.evictions += 1
        return bm.num_free_blocks >= free_blocks_needed
