"""Worker addresses from the Redis registry, and one gRPC channel per worker."""

from __future__ import annotations

import asyncio
import logging
import time

from splitserve.config import CommonConfig
from splitserve.errors import Unavailable
from splitserve.proto import worker_pb2_grpc
from splitserve.service import insecure_channel
from splitserve.state.store import StateStore

log = logging.getLogger(__name__)


class WorkerDirectory:
    """Resolves worker ids to stubs without I/O; the registry is re-read in the background.

    Only an id it has never seen (a worker that registered since the last refresh) makes
    `stub` read Redis inline. A worker missing from the registry is still resolved for
    `grace_s` after it was last listed: a Redis that restarted empty lists no worker until
    each re-registers at its next heartbeat, and requests already placed on them must not
    fail meanwhile (a worker that really died fails its calls and is avoided anyway).
    """

    def __init__(self, store: StateStore, config: CommonConfig, refresh_s: float = 1.0, grace_s: float = 5.0):
        self.store = store
        self.config = config
        self.refresh_s = refresh_s
        self.grace_s = grace_s
        self._addresses: dict[str, str] = {}
        self._listed: dict[str, float] = {}  # worker id -> when the registry last listed it (monotonic)
        self._channels: dict[str, object] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._refresh_now = asyncio.Event()

    async def start(self) -> None:
        """Read the registry once (errors propagate), then keep it fresh in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop(), name="worker-directory-refresh")

    async def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        address = self._addresses.get(worker_id)
        if address is None:
            await self.refresh()
            address = self._addresses.get(worker_id)
        if address is None:
            raise Unavailable(f"worker {worker_id!r} is not registered (it may have died)")
        stub = self._stubs.get(address)
        if stub is None:
            channel = insecure_channel(address, self.config)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    def forget_soon(self) -> None:
        """A worker failed: re-read the registry now rather than at the next interval."""
        self._refresh_now.set()

    async def refresh(self) -> None:
        workers = await self.store.list_workers()
        now = time.monotonic()
        for w in workers:
            self._listed[w.worker_id] = now
        kept = {worker_id: address for worker_id, address in self._addresses.items()
                if now - self._listed.get(worker_id, 0.0) <= self.grace_s}
        self._addresses = {**kept, **{w.worker_id: w.address for w in workers}}
        self._listed = {worker_id: self._listed[worker_id] for worker_id in self._addresses}

    async def _refresh_loop(self) -> None:
        while not self._stopping:
            try:
                await asyncio.wait_for(self._refresh_now.wait(), self.refresh_s)
            except asyncio.TimeoutError:
                pass
            self._refresh_now.clear()
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # keep the last addresses; the next round retries
                log.warning("worker registry refresh failed: %s", err)

    async def close(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
