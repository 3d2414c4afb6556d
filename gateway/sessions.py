"""Multi-turn session ids kept in the gateway's memory with an idle TTL.

Interim: the coordinator will own sessions (Redis `session:{id}`, bound decode worker),
and this table will then forward OpenSession/CloseSession to it. Until then a session
lives only in the replica that opened it, so Generate passes unknown session ids through
rather than refusing them (another replica, or the coordinator, may know them).
"""

from __future__ import annotations

import time
import uuid
from typing import Callable

DEFAULT_SESSION_TTL_S = 600
MAX_SESSION_TTL_S = 24 * 3600


class SessionTable:
    """Open sessions and when each expires; expiry is checked lazily on every call."""

    def __init__(self, default_ttl_s: int = DEFAULT_SESSION_TTL_S, max_ttl_s: int = MAX_SESSION_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.clock = clock
        self._sessions: dict[str, tuple[int, float]] = {}  # id -> (ttl_s, expires_at)

    def open(self, session_id: str = "", ttl_s: int = 0) -> tuple[str, int]:
        """Open (or refresh) a session; returns its id (a new uuid when empty) and TTL."""
        self._expire()
        session_id = session_id or uuid.uuid4().hex
        ttl = min(ttl_s or self.default_ttl_s, self.max_ttl_s)
        self._sessions[session_id] = (ttl, self.clock() + ttl)
        return session_id, ttl

    def touch(self, session_id: str) -> bool:
        """Restart an open session's idle timer; False when it is not open here."""
        self._expire()
        entry = self._sessions.get(session_id)
        if entry is None:
            return False
        self._sessions[session_id] = (entry[0], self.clock() + entry[0])
        return True

    def close(self, session_id: str) -> bool:
        """Forget a session; whether it was open."""
        self._expire()
        return self._sessions.pop(session_id, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._sessions)

    def _expire(self) -> None:
        now = self.clock()
        for sid in [s for s, (_, expires) in self._sessions.items() if expires <= now]:
            del self._sessions[sid]
