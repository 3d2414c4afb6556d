"""A KV-transfer peer in its own process, driven by JSON lines, for the transport tests.

It owns a random KV cache, a NixlTransport and a GrpcTransport (behind a real grpc.aio
server exposing Worker.PushKv / PullKv) and registers itself in Redis. Commands arrive
one JSON object per line on stdin; replies ({"id": ..., ...}) and events ({"event":
"chunk" | "ready", ...}) leave one per line on the original stdout, which is kept for
this protocol alone (NIXL logs to stdout, so fd 1 is pointed at stderr).

    python tests/integration/kv_peer.py --worker-id w1 --redis-url redis://... --prefix ss:t: --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
from typing import Any

import grpc
import torch

from splitserve.proto import worker_pb2_grpc
from splitserve.state.store import StateStore, WorkerInfo
from workers.kv_transfer.base import BlockTransfer, KvMemory, KvTransferError
from workers.kv_transfer.grpc_transport import KV_GRPC_OPTIONS, GrpcTransport
from workers.kv_transfer.nixl_transport import NixlTransport

KV_SHAPE = (64, 2, 2, 16, 2, 16)  # [blocks, layers, K/V, block_size, kv_heads, head_dim]


def random_kv_cache(seed: int, dtype: torch.dtype, shape: tuple[int, ...] = KV_SHAPE) -> torch.Tensor:
    """The same random cache for the same seed, in any process."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype).contiguous()


def flip_first_byte(chunk: Any) -> None:
    """Corrupts a chunk after its checksum was computed, as a faulty link would."""
    payload = bytearray(chunk.payload)
    payload[0] ^= 0xFF
    chunk.payload = bytes(payload)


class KvServicer(worker_pb2_grpc.WorkerServicer):
    """Worker.PushKv / PullKv delegating to a GrpcTransport, as the real worker does."""

    def __init__(self, transport: GrpcTransport):
        self.transport = transport

    async def PushKv(self, request_iterator, context):
        return await self.transport.handle_push(request_iterator)

    async def PullKv(self, request, context):
        try:
            async for chunk in self.transport.handle_pull(request):
                yield chunk
        except KvTransferError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


_protocol_out = sys.stdout


def claim_stdout() -> None:
    """Keep the real stdout for protocol lines; everything else written to fd 1 goes to stderr."""
    global _protocol_out
    _protocol_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def emit(message: dict[str, Any]) -> None:
    _protocol_out.write(json.dumps(message) + "\n")


def transfer_from(fields: dict[str, Any]) -> BlockTransfer:
    return BlockTransfer(fields["transfer_id"], fields["src_worker"], fields["dst_worker"],
                         tuple(fields["src_blocks"]), tuple(fields["dst_blocks"]),
                         fields["token_start"], fields["token_end"], fields.get("request_id", ""))


class Peer:
    """The child's worker: memory, both transports, the gRPC server, its registration."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.memory = KvMemory(random_kv_cache(args.seed, getattr(torch, args.dtype)))
        self.store = StateStore(args.redis_url, prefix=args.prefix)
        self.transports: dict[str, Any] = {}
        self.server = grpc.aio.server(options=KV_GRPC_OPTIONS)

    def on_chunk(self, transport: str):
        def report(chunk: BlockTransfer, ok: bool) -> None:
            emit({"event": "chunk", "transport": transport, "transfer_id": chunk.transfer_id,
                  "token_start": chunk.token_start, "token_end": chunk.token_end,
                  "dst_blocks": list(chunk.dst_blocks), "ok": ok})
        return report

    async def start(self) -> None:
        await self.store.connect()
        grpc_transport = GrpcTransport(self.args.worker_id, self.memory, self.store, self.on_chunk("grpc"))
        worker_pb2_grpc.add_WorkerServicer_to_server(KvServicer(grpc_transport), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        nixl_transport = NixlTransport(self.args.worker_id, self.memory, self.store, self.on_chunk("nixl"),
                                       lanes=self.args.lanes, min_lane_bytes=self.args.min_lane_bytes)
        self.transports = {"grpc": grpc_transport, "nixl": nixl_transport}
        for transport in self.transports.values():
            await transport.start()
        await self.store.register_worker(WorkerInfo(self.args.worker_id, f"127.0.0.1:{port}"), ttl_s=300)
        emit({"event": "ready", "worker_id": self.args.worker_id, "port": port})

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "read":
            return {"payload": base64.b64encode(self.memory.read(command["blocks"])).decode()}
        if op == "checksum":
            return {"checksum": self.memory.checksum(command["blocks"])}
        if op == "corrupt_outgoing":
            hook = flip_first_byte if command["enabled"] else None
            self.transports["grpc"].outgoing_chunk_hook = hook
            return {}
        if op == "push":
            transfer = transfer_from(command["transfer"])
            checksum = self.memory.checksum(list(transfer.src_blocks))
            try:
                await self.transports[command["transport"]].push(transfer, checksum, command["timeout_s"])
            except KvTransferError as exc:
                return {"error": str(exc)}
            return {"checksum": checksum}
        raise ValueError(f"unknown op {op!r}")

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            command = json.loads(line)
            if command["op"] == "exit":
                break
            try:
                reply = await self.handle(command)
            except Exception as exc:  # reported to the test, which fails on it
                reply = {"exception": f"{type(exc).__name__}: {exc}"}
            emit({"id": command["id"], **reply})

    async def stop(self) -> None:
        for transport in self.transports.values():
            await transport.close()
        await self.server.stop(grace=None)
        await self.store.deregister_worker(self.args.worker_id)
        await self.store.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lanes", type=int, default=1, help="NIXL lanes")
    parser.add_argument("--min-lane-bytes", type=int, default=4 << 20, help="smallest part a NIXL lane moves")
    peer = Peer(parser.parse_args())
    await peer.start()
    try:
        await peer.serve()
    finally:
        await peer.stop()


if __name__ == "__main__":
    claim_stdout()
    asyncio.run(main())
