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

from splitserve.state.store import RequestRecord, StateStore

log = logging.getLogger(__name__)

DROPPED = Counter("splitserve_coordinator_records_dropped_total", "Request records not written (Redis down, backlog full)")
WRITE_FAILURES = Counter("splitserve_coordinator_record_write_failures_total",
                         "Batched record writes that failed (Redis unreachable); their records are kept and retried")


class RequestRecordWriter:
    """Coalesces request records by id and flushes them in one Redis transaction per interval.

    While Redis is unreachable (or restarting) nothing is lost and no request waits: a batch
    that fails goes back into the pending records (a newer record of the same request
    wins) and is written again after a capped exponential backoff, so a restarted Redis
    (even an empty one) gets every record that changed meanwhile. Only a backlog beyond
    `max_pending` requests is dropped (counted), to keep memory bounded in a long outage.
    """

    def __init__(self, store: StateStore, ttl_s: float, flush_interval_s: float = 0.02, max_pending: int = 100_000,
                 max_backoff_s: float = 1.0):
        self.store = store
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self.max_backoff_s = max_backoff_s
        self._pending: dict[str, RequestRecord] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._failures = 0  # failed flushes in a row

    def put(self, record: RequestRecord) -> None:
        """Queue a record; a later one for the same request replaces it."""
        if record.request_id not in self._pending and len(self._pending) >= self.max_pending:
            # Redis has been unreachable for a long time: keep memory bounded by dropping the
            # least recently changed record, as a failed flush does (the newest matter most).
            del self._pending[next(iter(self._pending))]
            DROPPED.inc()
        self._pending.pop(record.request_id, None)  # the least recently changed stay first in line to drop
        self._pending[record.request_id] = record
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def failing(self) -> bool:
        """The last flush failed (Redis unreachable): records are being kept for the next one."""
        return self._failures > 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="request-record-writer")

    async def close(self, timeout_s: float = 2.0) -> None:
        """Flush what is pending (best effort, at most `timeout_s`: Redis may be down) and stop."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("%d request records not written at shutdown (Redis did not answer within %.1f s)",
                        len(self._pending), timeout_s)
        if self._pending:
            DROPPED.inc(len(self._pending))

    async def flush(self) -> bool:
        """Write what is pending in one transaction; False (records kept) when Redis fails."""
        if not self._pending:
            return True
        batch, self._pending = self._pending, {}
        try:
            await self.store.put_requests(list(batch.values()), self.ttl_s)
        except BaseException as err:
            # Put the batch back under anything newer that arrived during the write.
            kept = {**batch, **self._pending}
            overflow = len(kept) - self.max_pending
            if overflow > 0:  # oldest first (dicts keep insertion order)
                for request_id in list(kept)[:overflow]:
                    del kept[request_id]
                DROPPED.inc(overflow)
            self._pending = kept
            if isinstance(err, Exception):
                WRITE_FAILURES.inc()
                if self._failures == 0:
                    log.warning("writing %d request records failed (%s); keeping them and retrying",
                                len(batch), err)
                self._failures += 1
                return False
            raise  # cancelled: the records are back in pending for close()
        if self._failures:
            log.info("request records written again after %d failed attempt(s)", self._failures)
        self._failures = 0
        return True

    async def _run(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            # Let the interval's records accumulate: one round trip for all of them.
            await asyncio.sleep(self.flush_interval_s)
            if not await self.flush():
                # Redis is down: retry after a capped backoff whether or not new records arrive.
                await asyncio.sleep(min(self.max_backoff_s, self.flush_interval_s * 2 ** min(self._failures, 16)))
                self._wake.set()
