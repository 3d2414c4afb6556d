"""Request records written to Redis in batches, off the request path.

A record is bookkeeping (status, plan, emitted tokens for `splitserve status` and
post-mortems), so no request waits for it: `put` only remembers the latest record per
request, and a background task writes whatever accumulated in one MULTI/EXEC every
`flush_interval_s`. A short request's "running" record is usually replaced by its final
one before a flush, so it costs no Redis write at all.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter

from splitserve.state import RequestRecord, StateStore

log = logging.getLogger(__name__)

DROPPED = Counter("splitserve_coordinator_records_dropped_total", "Request records not written (Redis down, backlog full)")


class RequestRecordWriter:
    """Coalesces request records by id and flushes them in one Redis transaction per interval."""

    def __init__(self, store: StateStore, ttl_s: float, flush_interval_s: float = 0.02, max_pending: int = 100_000):
        self.store = store
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self._pending: dict[str, RequestRecord] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    def put(self, record: RequestRecord) -> None:
        """Queue a record; a later one for the same request replaces it."""
        if record.request_id not in self._pending and len(self._pending) >= self.max_pending:
            DROPPED.inc()  # Redis has been unreachable for a long time: keep memory bounded
            return
        self._pending[record.request_id] = record
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="request-record-writer")

    async def close(self) -> None:
        """Flush what is pending (best effort) and stop."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = list(self._pending.values()), {}
        try:
            await self.store.put_requests(batch, self.ttl_s)
        except Exception as err:
            log.warning("writing %d request records failed: %s", len(batch), err)
            DROPPED.inc(len(batch))

    async def _run(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            # Let the interval's records accumulate: one round trip for all of them.
            await asyncio.sleep(self.flush_interval_s)
            await self.flush()
