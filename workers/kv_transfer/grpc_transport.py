"""KV blocks between workers as streamed bytes over gRPC (Worker.PushKv / Worker.PullKv).

The fallback when NIXL is absent or disabled. A transfer is cut into KvChunk messages of
whole blocks (at most 1 MiB each unless one block is larger), each with its own digest (xxh3_64),
so a receiver writes and reports every chunk as it arrives. Peers are found by their
gRPC address in the worker registry. The Worker servicer delegates its PushKv and
PullKv handlers to `handle_push` / `handle_pull`, mapping KvTransferError from
`handle_pull` to an error status.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from typing import Callable

import grpc
import xxhash

from splitserve.proto import worker_pb2, worker_pb2_grpc
from splitserve.state.store import StateStore
from workers.kv_transfer.base import (
    BlockTransfer,
    ChunkCallback,
    KvMemory,
    KvTransferError,
    chunk_token_range,
    kv_digest,
)

log = logging.getLogger(__name__)

# A message is serialized and parsed on the event loop thread: a 4 MiB chunk stalled the
# loop 5-10 ms on a 2-vCPU VM, a 1 MiB chunk 1-2 ms, at the same throughput.
MAX_CHUNK_BYTES = 1 << 20
# Room for caches whose single block is larger than a chunk.
KV_GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


ChannelFactory = Callable[[str, list[tuple[str, int]]], grpc.aio.Channel]  # (address, options)


def _plaintext_channel(address: str, options: list[tuple[str, int]]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=options)


class GrpcTransport:
    """KvTransport over the Worker service's PushKv / PullKv streams."""

    name = "grpc"

    def __init__(self, worker_id: str, memory: KvMemory, store: StateStore, on_chunk: ChunkCallback,
                 channel_options: list[tuple[str, int]] | None = None, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                 channel_factory: ChannelFactory | None = None):
        """`channel_factory(address, options)` dials a peer worker (the service's mTLS when
        configured); default plaintext."""
        self.worker_id = worker_id
        self.memory = memory
        self.store = store
        self.on_chunk = on_chunk
        self.channel_options = channel_options if channel_options is not None else KV_GRPC_OPTIONS
        self.max_chunk_bytes = max_chunk_bytes
        self.channel_factory: ChannelFactory = channel_factory or _plaintext_channel
        # Test hook: sees (and may mutate) every outgoing chunk after its checksum is set.
        self.outgoing_chunk_hook: Callable[[worker_pb2.KvChunk], None] | None = None
        # Set with the corrupting hook above: the bytes this transport moves are altered in
        # flight, so nobody forges a digest on top (workers/kv_stages.py).
        self.corrupt_writes = False
        self._addresses: dict[str, str] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> None:
        """Nothing to publish: peers reach this worker at its registered gRPC address."""

    def expect_incoming(self, transfer_id: str, timeout_s: float) -> None:
        """Nothing to do: pushed chunks arrive as PushKv calls."""

    def incoming_done(self, transfer_id: str) -> None:
        """Nothing to do."""

    def blocks_per_chunk(self, chunk_tokens: int = 0) -> int:
        """Whole blocks per KvChunk: within max_chunk_bytes (and chunk_tokens, if given), at least one."""
        blocks = max(1, self.max_chunk_bytes // self.memory.block_bytes)
        if chunk_tokens > 0:
            blocks = min(blocks, max(1, math.ceil(chunk_tokens / self.memory.block_size)))
        return blocks

    # ---- sending side ----------------------------------------------------------------

    async def push(self, transfer: BlockTransfer, checksum: int | None, timeout_s: float) -> None:
        """Stream local src_blocks into the peer's dst_blocks; returns when the peer wrote them all.

        `checksum` is not sent: every chunk carries the digest of its own payload instead.
        """
        if transfer.src_worker != self.worker_id:
            raise ValueError(f"push of {transfer.transfer_id} from {transfer.src_worker} on worker {self.worker_id}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        stub = await self._stub(transfer.dst_worker, deadline)
        what = f"gRPC push of {transfer.transfer_id} to {transfer.dst_worker}"
        try:
            response = await stub.PushKv(self._push_chunks(transfer), timeout=self._remaining(deadline, what))
        except grpc.aio.AioRpcError as exc:
            self._on_rpc_error(transfer.dst_worker, exc)
            raise KvTransferError(f"{what} failed: {exc.code().name}: {exc.details()}") from None
        if not response.ok:
            raise KvTransferError(f"{what} rejected after {response.received_tokens} tokens: {response.error}")

    async def _push_chunks(self, transfer: BlockTransfer) -> AsyncIterator[worker_pb2.KvChunk]:
        per_chunk = self.blocks_per_chunk()
        total = len(transfer.src_blocks)
        for first in range(0, total, per_chunk):
            src = list(transfer.src_blocks[first : first + per_chunk])
            payload, digest = await asyncio.to_thread(self._read_with_digest, src)
            start, end = chunk_token_range(transfer, first, len(src), self.memory.block_size)
            yield self._chunk(transfer, start, end, payload, digest, len(src), last=first + per_chunk >= total,
                              block_ids=transfer.dst_blocks[first : first + per_chunk])

    async def signal_failure(self, transfer: BlockTransfer, error: str, timeout_s: float) -> bool:
        """Tell the receiver that `transfer` will not complete (whatever transport carried it), so
        it recomputes now instead of waiting out its transfer timeout; whether it was told."""
        notice = worker_pb2.KvChunk(transfer_id=transfer.transfer_id, request_id=transfer.request_id,
                                    start=transfer.token_start, end=transfer.token_end, last=True, failed=True,
                                    error=error[:500], src_worker=self.worker_id, block_ids=transfer.dst_blocks)

        async def one():
            yield notice

        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            stub = await self._stub(transfer.dst_worker, deadline)
            reply = await stub.PushKv(one(), timeout=self._remaining(deadline, "failure notice"))
        except (grpc.aio.AioRpcError, KvTransferError) as exc:
            log.warning("could not tell %s that transfer %s failed: %s", transfer.dst_worker, transfer.transfer_id, exc)
            return False
        if not reply.ok:
            log.warning("%s refused the failure notice of %s: %s", transfer.dst_worker, transfer.transfer_id,
                        reply.error)
        return reply.ok

    def _read_with_digest(self, blocks: list[int]) -> tuple[bytes, int]:
        payload = self.memory.read(blocks)
        return payload, kv_digest((payload,))

    def _chunk(self, transfer: BlockTransfer, start: int, end: int, payload: bytes, digest: int, num_blocks: int,
               last: bool, block_ids: tuple[int, ...]) -> worker_pb2.KvChunk:
        chunk = worker_pb2.KvChunk(
            transfer_id=transfer.transfer_id, request_id=transfer.request_id, start=start, end=end,
            payload=payload, dtype=self.memory.dtype_name,
            shape=[num_blocks, *self.memory.tensor.shape[1:]], checksum=digest, last=last,
            block_ids=block_ids, src_worker=self.worker_id,
        )
        if self.outgoing_chunk_hook is not None:
            self.outgoing_chunk_hook(chunk)
        return chunk

    # ---- receiving side of a push ----------------------------------------------------

    async def handle_push(self, request_iterator: AsyncIterator[worker_pb2.KvChunk]) -> worker_pb2.PushKvResponse:
        """Worker.PushKv: verify, write and report (on_chunk) each chunk as it arrives."""
        received_tokens = 0
        async for chunk in request_iterator:
            if chunk.failed:  # the sender's notice that this transfer will not complete
                try:
                    piece = BlockTransfer(chunk.transfer_id, chunk.src_worker, self.worker_id, (),
                                          tuple(chunk.block_ids), chunk.start, chunk.end, chunk.request_id)
                except ValueError as exc:
                    log.warning("bad KV failure notice from %s: %s", chunk.src_worker, exc)
                    return worker_pb2.PushKvResponse(ok=False, error=f"bad failure notice: {exc}")
                log.warning("KV push %s from %s failed at the sender: %s", chunk.transfer_id, chunk.src_worker,
                            chunk.error)
                self._report(piece, False)
                return worker_pb2.PushKvResponse(ok=True, received_tokens=received_tokens)
            piece, error = await self._accept(chunk, tuple(chunk.block_ids))
            if piece is not None:
                self._report(piece, error is None)
            if error is not None:
                log.warning("KV push %s from %s: %s", chunk.transfer_id, chunk.src_worker, error)
                return worker_pb2.PushKvResponse(ok=False, received_tokens=received_tokens, error=error)
            received_tokens += chunk.end - chunk.start
            if chunk.last:
                return worker_pb2.PushKvResponse(ok=True, received_tokens=received_tokens)
        return worker_pb2.PushKvResponse(ok=False, received_tokens=received_tokens,
                                         error="the stream ended before the last chunk")

    async def _accept(self, chunk: worker_pb2.KvChunk, dst_blocks: tuple[int, ...]
                      ) -> tuple[BlockTransfer | None, str | None]:
        """Check a chunk and write it into dst_blocks: (the chunk as a transfer, error or None)."""
        try:
            piece = BlockTransfer(chunk.transfer_id, chunk.src_worker, self.worker_id, (), dst_blocks,
                                  chunk.start, chunk.end, chunk.request_id)
        except ValueError as exc:
            return None, str(exc)
        if chunk.dtype and chunk.dtype != self.memory.dtype_name:
            return piece, f"chunk dtype {chunk.dtype}, this cache holds {self.memory.dtype_name}"
        if any(not 0 <= b < self.memory.num_blocks for b in dst_blocks):
            return piece, f"block ids out of range [0, {self.memory.num_blocks})"
        if len(chunk.payload) != len(dst_blocks) * self.memory.block_bytes:
            return piece, f"{len(chunk.payload)} payload bytes for {len(dst_blocks)} blocks"
        intact = await asyncio.to_thread(self._verify_and_write, chunk, dst_blocks)
        return piece, None if intact else f"checksum mismatch in tokens [{chunk.start}, {chunk.end})"

    def _verify_and_write(self, chunk: worker_pb2.KvChunk, dst_blocks: tuple[int, ...]) -> bool:
        if kv_digest((chunk.payload,)) != chunk.checksum:
            return False  # a corrupt payload never reaches the cache
        self.memory.write(list(dst_blocks), chunk.payload)
        return True

    def _report(self, piece: BlockTransfer, ok: bool) -> None:
        try:
            self.on_chunk(piece, ok)
        except Exception:
            log.exception("on_chunk failed for transfer %s", piece.transfer_id)

    # ---- pulling ---------------------------------------------------------------------

    async def handle_pull(self, request: worker_pb2.PullKvRequest) -> AsyncIterator[worker_pb2.KvChunk]:
        """Worker.PullKv: stream the requested local blocks; KvTransferError on a bad request."""
        blocks = tuple(request.block_ids)
        if not blocks or any(not 0 <= b < self.memory.num_blocks for b in blocks):
            raise KvTransferError(f"pull {request.transfer_id}: {len(blocks)} block ids, valid range "
                                  f"[0, {self.memory.num_blocks})")
        try:
            as_transfer = BlockTransfer(request.transfer_id, self.worker_id, "", blocks, blocks,
                                        request.start, request.end, request.request_id)
        except ValueError as exc:
            raise KvTransferError(str(exc)) from None
        per_chunk = self.blocks_per_chunk(request.chunk_tokens)
        for first in range(0, len(blocks), per_chunk):
            src = list(blocks[first : first + per_chunk])
            payload, digest = await asyncio.to_thread(self._read_with_digest, src)
            start, end = chunk_token_range(as_transfer, first, len(src), self.memory.block_size)
            yield self._chunk(as_transfer, start, end, payload, digest, len(src),
                              last=first + per_chunk >= len(blocks), block_ids=tuple(src))

    async def pull(self, transfer: BlockTransfer, timeout_s: float) -> int:
        """Stream the peer's src_blocks into local dst_blocks; returns kv_digest of all received bytes."""
        if transfer.dst_worker != self.worker_id:
            raise ValueError(f"pull of {transfer.transfer_id} into {transfer.dst_worker} on worker {self.worker_id}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        what = f"gRPC pull of {transfer.transfer_id} from {transfer.src_worker}"
        stub = await self._stub(transfer.src_worker, deadline)
        request = worker_pb2.PullKvRequest(
            transfer_id=transfer.transfer_id, request_id=transfer.request_id, start=transfer.token_start,
            end=transfer.token_end, block_ids=transfer.src_blocks,
            # The puller's own chunk size: its message limit is the one that matters here.
            chunk_tokens=self.blocks_per_chunk() * self.memory.block_size,
        )
        call = stub.PullKv(request, timeout=self._remaining(deadline, what))
        done, received = 0, xxhash.xxh3_64()
        try:
            async for chunk in call:
                count = len(chunk.block_ids)
                if tuple(chunk.block_ids) != transfer.src_blocks[done : done + count]:
                    raise KvTransferError(f"{what}: chunk holds blocks {list(chunk.block_ids)[:4]}..., "
                                          f"expected source blocks from position {done}")
                _, error = await self._accept(chunk, transfer.dst_blocks[done : done + count])
                if error is not None:
                    raise KvTransferError(f"{what}: {error}")
                received.update(chunk.payload)
                done += count
                if chunk.last:
                    break
        except grpc.aio.AioRpcError as exc:
            self._on_rpc_error(transfer.src_worker, exc)
            raise KvTransferError(f"{what} failed: {exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()  # no-op once finished; stops the stream after an early exit
        if done != len(transfer.src_blocks):
            raise KvTransferError(f"{what}: stream ended after {done} of {len(transfer.src_blocks)} blocks")
        return received.intdigest()

    # ---- peers -----------------------------------------------------------------------

    @staticmethod
    def _remaining(deadline: float, what: str) -> float:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise KvTransferError(f"{what} timed out")
        return remaining

    async def _stub(self, worker_id: str, deadline: float) -> worker_pb2_grpc.WorkerStub:
        address = self._addresses.get(worker_id)
        if address is None:
            what = f"looking up worker {worker_id}"
            try:
                workers = await asyncio.wait_for(self.store.list_workers(), self._remaining(deadline, what))
            except TimeoutError:
                raise KvTransferError(f"{what} timed out") from None
            except KvTransferError:
                raise
            except Exception as exc:
                raise KvTransferError(f"{what} failed: {exc}") from exc
            self._addresses.update({w.worker_id: w.address for w in workers})
            address = self._addresses.get(worker_id)
            if address is None:
                raise KvTransferError(f"worker {worker_id} is not registered")
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.channel_factory(address, self.channel_options)
        return worker_pb2_grpc.WorkerStub(channel)

    def _on_rpc_error(self, worker_id: str, exc: grpc.aio.AioRpcError) -> None:
        # The peer may have moved (restart on another port): look it up again next time.
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
            self._addresses.pop(worker_id, None)

    async def close(self) -> None:
        """Close every peer channel."""
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)
