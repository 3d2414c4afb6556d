"""Worker addresses from the Redis registry, and one gRPC channel per worker."""

from __future__ import annotations

import asyncio
import logging

from splitserve.config import CommonConfig
from splitserve.errors import Unavailable
from splitserve.proto import worker_pb2_grpc
from splitserve.service import insecure_channel
from splitserve.state import StateStore

log = logging.getLogger(__name__)


class WorkerDirectory:
    """Resolves worker ids to stubs without I/O; the registry is re-read in the background.

    Only an id it has never seen (a worker that registered since the last refresh) makes
    `stub` read Redis inline.
    """

    def __init__(self, store: StateStore, config: CommonConfig, refresh_s: float = 1.0):
        self.store = store
        self.config = config
        self.refresh_s = refresh_s
        self._addresses: dict[str, str] = {}
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
        self._addresses = {w.worker_id: w.address for w in workers}

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
