"""Sessions as the coordinator owns them: state in Redis, so any replica serves any round.

AMPD §3 (`Binding`): a session is bound to the worker that keeps its history's KV. Here
that binding is `session:{id}` in Redis (owned by `splitserve.state.store`): the worker holding
the history, its length, last use and the round in flight. Each round:

1. `begin_round` marks the round in flight atomically; a second round sent while one
   runs is refused (`SessionBusy`: the client must send rounds one after another, since
   each round's prompt carries the previous round's output); an unknown, expired or
   closed id is `NotFound` — never a silent fresh session;
2. the plan's last stage carries a `SessionHold`: the worker pins the round's KV when it
   finishes (`splitserve.core.session_pins`);
3. `end_round` records the worker now holding the history and restarts the idle TTL.

Limits (each error names its limit): the idle TTL a client may ask for
(`max_ttl_s`), open sessions per owner (`max_sessions_per_owner`, owner = a digest of the
API key; RESOURCE_EXHAUSTED), and history tokens per round (`max_history_tokens`).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from splitserve.errors import Conflict, InvalidArgument, NotFound, Overloaded
from splitserve.state.store import StateStore
from splitserve.core.records import SessionRecord

SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9._~-]{1,128}")


@dataclass(frozen=True)
class SessionLimits:
    default_ttl_s: float = 600.0
    max_ttl_s: float = 24 * 3600.0
    max_sessions_per_owner: int = 1000  # 0: no limit
    max_history_tokens: int = 0  # 0: only the model's length bounds a round's prompt
    round_timeout_s: float = 600.0  # a round in flight holds the session at most this long

    def __post_init__(self) -> None:
        if not 0 < self.default_ttl_s <= self.max_ttl_s:
            raise ValueError(f"session TTLs: need 0 < default_ttl_s ({self.default_ttl_s}) <= max_ttl_s "
                             f"({self.max_ttl_s})")
        if self.max_sessions_per_owner < 0 or self.max_history_tokens < 0:
            raise ValueError("max_sessions_per_owner and max_history_tokens must be >= 0")
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s must be > 0, got {self.round_timeout_s}")


def check_session_id(session_id: str) -> str:
    if not SESSION_ID_PATTERN.fullmatch(session_id):
        raise InvalidArgument("session_id must be 1-128 characters of letters, digits and . _ ~ -, "
                              f"got {session_id[:140]!r}", param="session_id")
    return session_id


class SessionService:
    """Open, close and run rounds of sessions kept in Redis (see the module docstring)."""

    def __init__(self, store: StateStore, limits: SessionLimits = SessionLimits(),
                 clock: Callable[[], float] = time.time):
        self.store = store
        self.limits = limits
        self.clock = clock

    async def open(self, session_id: str = "", ttl_s: float = 0, owner: str = "") -> tuple[str, float]:
        """Open a session (or refresh one this owner opened); its id and idle TTL."""
        limits = self.limits
        if ttl_s < 0 or ttl_s > limits.max_ttl_s:
            raise InvalidArgument(f"ttl_s must be in [0, {limits.max_ttl_s:g}] seconds (max_session_ttl_s), "
                                  f"got {ttl_s:g}", param="ttl_s")
        session_id = check_session_id(session_id) if session_id else uuid.uuid4().hex
        ttl = ttl_s or limits.default_ttl_s
        outcome, open_count = await self.store.open_session(session_id, owner, ttl, self.clock(),
                                                            limits.max_sessions_per_owner)
        if outcome == "taken":
            raise Conflict(f"session_id {session_id!r} is already in use", param="session_id")
        if outcome == "limit":
            raise Overloaded(f"too many open sessions: {open_count} of max_sessions_per_key "
                             f"{limits.max_sessions_per_owner}; close one or let it expire",
                             retry_after_s=min(ttl, 60.0))
        return session_id, ttl

    async def close(self, session_id: str, owner: str = "") -> SessionRecord | None:
        """Close a session: its last record (to release the pinned history), None when not open.
        A session opened under another API key is not found, as if it did not exist."""
        check_session_id(session_id)
        closed = await self.store.close_session(session_id, owner)
        return closed if isinstance(closed, SessionRecord) else None

    async def begin_round(self, session_id: str, request_id: str, prompt_len: int) -> SessionRecord:
        """Hold the session for this round; its record (where the history is)."""
        check_session_id(session_id)
        limit = self.limits.max_history_tokens
        if limit and prompt_len > limit:
            raise InvalidArgument(f"session round prompt has {prompt_len} tokens, over max_session_history_tokens "
                                  f"({limit})", param="prompt")
        record = await self.store.begin_session_round(session_id, request_id, self.clock(),
                                                      self.limits.round_timeout_s)
        if record is None:
            raise NotFound(f"session {session_id!r} does not exist (never opened, closed, or expired after its "
                           "idle TTL); open a new one", param="session_id")
        if isinstance(record, str):
            raise Conflict(f"session {session_id!r} has a round in flight (request {record}); send its rounds one "
                           "at a time", param="session_id")
        return record

    async def end_round(self, record: SessionRecord, request_id: str, decode_worker: str | None,
                        history_len: int | None) -> bool:
        """Release the session for its next round; where its history lives now (None: unchanged)."""
        return await self.store.end_session_round(record, request_id, self.clock(), decode_worker, history_len)
