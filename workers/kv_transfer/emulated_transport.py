"""KV "transfers" between emulated workers: perf-model time, then metadata only.

An emulated worker (workers/engine/emulated.py) holds KV *blocks* (the real BlockManager
accounts for them) but no KV *values*. `EmulatedKvMemory` is that memory: numbered
blocks of zero bytes. `EmulatedTransport` is the gRPC transport over it: a push sleeps
the performance model's `kv_transfer_time(tokens)` (on the event loop, overlapping the
engine's compute as NIXL does), then sends one payload-free KvChunk over the peer's
Worker.PushKv, so the receiver's reservation, tracker and stage logic run exactly as for
real bytes. Receiving needs no override: the inherited `handle_push` checks an empty
payload against blocks of zero bytes and the digest of no bytes. A corrupted checksum (fault
injection) is forwarded, so the receiver still detects it and recomputes. An emulated
and a real worker cannot exchange KV: the dtype "emulated" is rejected, and the receiver
recomputes from tokens. Links are not contended: concurrent pushes overlap freely.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import grpc

from splitserve.perf.model import PerfModel
from splitserve.state.store import StateStore
from workers.kv_transfer.base import EMPTY_DIGEST, BlockTransfer, ChunkCallback, KvTransferError
from workers.kv_transfer.grpc_transport import GrpcTransport


@dataclass(frozen=True)
class _ShapeOnly:
    """Stands in for the KV tensor where only its shape is read (KvChunk.shape)."""

    shape: tuple[int, ...]


class EmulatedKvMemory:
    """The KvMemory interface over `num_blocks` blocks that hold no bytes."""

    block_bytes = 0
    dtype_name = "emulated"
    device = "emulated"
    base_ptr = 0

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensor = _ShapeOnly((num_blocks, 0))

    def block_addr(self, block_id: int) -> int:
        return 0

    def read(self, block_ids: list[int]) -> bytes:
        return b""

    def write(self, block_ids: list[int], payload: bytes) -> None:
        if payload:
            raise KvTransferError(f"{len(payload)} payload bytes for emulated blocks, which hold none")

    def checksum(self, block_ids: list[int]) -> int:
        return EMPTY_DIGEST


class EmulatedTransport(GrpcTransport):
    """GrpcTransport whose pushes and pulls take the perf model's time and move no bytes."""

    name = "emulated"

    def __init__(self, worker_id: str, memory: EmulatedKvMemory, store: StateStore, on_chunk: ChunkCallback,
                 perf: PerfModel):
        super().__init__(worker_id, memory, store, on_chunk)
        self.perf = perf

    def blocks_per_chunk(self, chunk_tokens: int = 0) -> int:
        """No bytes to bound: chunk only at `chunk_tokens` when given (pulls), else one chunk."""
        if chunk_tokens > 0:
            return max(1, math.ceil(chunk_tokens / self.memory.block_size))
        return 1 << 16

    async def _wait_transfer(self, transfer: BlockTransfer, deadline: float, what: str) -> None:
        delay = self.perf.kv_transfer_time(transfer.token_end - transfer.token_start)
        loop = asyncio.get_running_loop()
        if loop.time() + delay > deadline:
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            raise KvTransferError(f"{what} timed out (the model's transfer time is {delay * 1e3:.1f} ms)")
        await asyncio.sleep(delay)

    async def push(self, transfer: BlockTransfer, checksum: int | None, timeout_s: float) -> None:
        """Sleep the transfer time, then tell the peer the blocks are in place (one KvChunk)."""
        if transfer.src_worker != self.worker_id:
            raise ValueError(f"push of {transfer.transfer_id} from {transfer.src_worker} on worker {self.worker_id}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        what = f"emulated push of {transfer.transfer_id} to {transfer.dst_worker}"
        await self._wait_transfer(transfer, deadline, what)
        stub = await self._stub(transfer.dst_worker, deadline)
        if checksum is None:
            checksum = EMPTY_DIGEST  # what a payload of no bytes has
        chunk = self._chunk(transfer, transfer.token_start, transfer.token_end, b"", checksum,
                            len(transfer.dst_blocks), last=True, block_ids=transfer.dst_blocks)
        try:
            response = await stub.PushKv(iter([chunk]), timeout=self._remaining(deadline, what))
        except grpc.aio.AioRpcError as exc:
            self._on_rpc_error(transfer.dst_worker, exc)
            raise KvTransferError(f"{what} failed: {exc.code().name}: {exc.details()}") from None
        if not response.ok:
            raise KvTransferError(f"{what} rejected after {response.received_tokens} tokens: {response.error}")

    async def pull(self, transfer: BlockTransfer, timeout_s: float) -> int:
        """Sleep the transfer time, then stream the peer's (payload-free) chunks as a gRPC pull."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        await self._wait_transfer(transfer, deadline, f"emulated pull of {transfer.transfer_id}")
        return await super().pull(transfer, max(1e-3, deadline - asyncio.get_running_loop().time()))
