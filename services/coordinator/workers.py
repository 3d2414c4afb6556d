"""Worker addresses from the Redis registry, and one gRPC channel per worker."""

from __future__ import annotations

import time

from splitserve.config import CommonConfig
from splitserve.errors import Unavailable
from splitserve.proto import worker_pb2_grpc
from splitserve.service import insecure_channel
from splitserve.state import StateStore


class WorkerDirectory:
    """Resolves worker ids to stubs; re-reads the registry on a miss or when stale."""

    def __init__(self, store: StateStore, config: CommonConfig, max_age_s: float = 2.0):
        self.store = store
        self.config = config
        self.max_age_s = max_age_s
        self._addresses: dict[str, str] = {}
        self._read_at = 0.0
        self._channels: dict[str, object] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    async def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        address = self._addresses.get(worker_id)
        if address is None or time.monotonic() - self._read_at > self.max_age_s:
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

    async def refresh(self) -> None:
        workers = await self.store.list_workers()
        self._addresses = {w.worker_id: w.address for w in workers}
        self._read_at = time.monotonic()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
