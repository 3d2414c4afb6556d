"""NIXL and gRPC KV transports between two real processes, registered in a real Redis.

A child process (`kv_peer.py`) per cache dtype owns its own KV cache and transports and
answers JSON-line commands; the test process is the other worker. Everything waits on
events with timeouts (never a fixed sleep). Every key lives under a fresh prefix that is
deleted at the end; the children are stopped and, if need be, killed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch

from splitserve.proto import worker_pb2_grpc
from splitserve.state.store import StateStore, WorkerInfo
from workers.kv_transfer.base import BlockTransfer, KvMemory, KvTransferError
from workers.kv_transfer.grpc_transport import KV_GRPC_OPTIONS, GrpcTransport
from workers.kv_transfer.nixl_transport import NixlTransport
from workers.kv_transfer.tracker import TransferTracker

sys.path.insert(0, str(Path(__file__).parent))
from kv_peer import KV_SHAPE, KvServicer, flip_first_byte, random_kv_cache  # noqa: E402

pytestmark = pytest.mark.timeout(120)

REDIS_URL = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS, BLOCK_SIZE = KV_SHAPE[0], KV_SHAPE[3]
DTYPES = ("float32", "bfloat16")
TRANSPORTS = ("nixl", "grpc")
STEP_TIMEOUT_S = 15.0
MIN_LANE_BYTES = 2 * 4096  # two float32 test blocks: small transfers split too


class PeerProcess:
    """A kv_peer.py child: send it commands, wait for its replies and events."""

    def __init__(self, worker_id: str, prefix: str, seed: int, dtype: str, log_path: Path, lanes: int = 1):
        self.worker_id = worker_id
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "NIXL_LOG_LEVEL": "WARN"}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("kv_peer.py")), "--worker-id", worker_id,
             "--redis-url", REDIS_URL, "--prefix", prefix, "--seed", str(seed), "--dtype", dtype,
             "--lanes", str(lanes), "--min-lane-bytes", str(MIN_LANE_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, cwd=REPO_ROOT,
        )
        self._messages: list[dict[str, Any]] = []
        self._exited = False
        self._changed = threading.Condition()
        self._ids = itertools.count()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError), self._changed:
                self._messages.append(json.loads(line))
                self._changed.notify_all()
        with self._changed:
            self._exited = True
            self._changed.notify_all()

    def wait_for(self, matches: Callable[[dict[str, Any]], bool], timeout_s: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        """Remove and return the first message that matches; AssertionError on timeout or exit."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for i, message in enumerate(self._messages):
                    if matches(message):
                        return self._messages.pop(i)
                remaining = deadline - time.monotonic()
                if self._exited or remaining <= 0:
                    state = "exited" if self._exited else f"timed out after {timeout_s}s"
                    raise AssertionError(f"peer {self.worker_id} {state}; log:\n{self.log_tail()}")
                self._changed.wait(remaining)

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Run one command in the child and return its reply."""
        command_id = next(self._ids)
        self.proc.stdin.write(json.dumps({"id": command_id, "op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        reply = await asyncio.to_thread(self.wait_for, lambda m: m.get("id") == command_id)
        assert "exception" not in reply, reply["exception"]
        return reply

    async def read(self, blocks: list[int]) -> bytes:
        return base64.b64decode((await self.call("read", blocks=blocks))["payload"])

    async def chunks_of(self, transfer_id: str, token_start: int, token_end: int) -> TransferTracker:
        """Feed the child's chunk events for a transfer into a tracker until it settles."""
        tracker, _ = await self.chunk_events(transfer_id, token_start, token_end)
        return tracker

    async def chunk_events(self, transfer_id: str, token_start: int, token_end: int
                           ) -> tuple[TransferTracker, list[dict[str, Any]]]:
        """The tracker of chunks_of and the chunk events that settled it."""
        tracker = TransferTracker()
        tracker.expect(transfer_id, "", token_end - token_start, (), token_start=token_start)
        events = []
        while not (tracker.is_complete(transfer_id) or tracker.failed(transfer_id)):
            event = await asyncio.to_thread(
                self.wait_for, lambda m: m.get("event") == "chunk" and m["transfer_id"] == transfer_id)
            tracker.on_chunk(transfer_id, event["token_start"], event["token_end"], event["ok"])
            events.append(event)
        return tracker, events

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def prefix() -> Any:
    """A Redis key prefix of this module's own; its keys are deleted afterwards."""
    prefix = f"ss:test-kv-{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="module")
def peers(prefix, tmp_path_factory) -> Any:
    """One ready child per cache dtype."""
    logs = tmp_path_factory.mktemp("kv-peers")
    children = {dtype: PeerProcess(f"peer-{dtype}", prefix, seed=7, dtype=dtype, log_path=logs / f"{dtype}.log")
                for dtype in DTYPES}
    children["lanes"] = PeerProcess("peer-lanes", prefix, seed=9, dtype="float32", log_path=logs / "lanes.log",
                                    lanes=2)
    try:
        for child in children.values():
            child.wait_for(lambda m: m.get("event") == "ready", timeout_s=60)
        yield children
    finally:
        for child in children.values():
            child.stop()


@dataclass
class Parent:
    """This process as a worker: its cache, tracker and both transports."""

    worker_id: str
    memory: KvMemory
    tracker: TransferTracker
    transports: dict[str, Any]


@contextlib.asynccontextmanager
async def parent_worker(prefix: str, dtype: str, lanes: int = 1) -> AsyncIterator[Parent]:
    worker_id = f"parent-{uuid.uuid4().hex[:8]}"  # fresh per test: NIXL agents cannot be reloaded by name
    memory = KvMemory(random_kv_cache(1000, getattr(torch, dtype)))
    tracker = TransferTracker()

    def on_chunk(chunk: BlockTransfer, ok: bool) -> None:
        tracker.on_chunk(chunk.transfer_id, chunk.token_start, chunk.token_end, ok)

    store = StateStore(REDIS_URL, prefix=prefix)
    await store.connect()
    # Small chunks, so a push of a few blocks is several KvChunk messages.
    grpc_transport = GrpcTransport(worker_id, memory, store, on_chunk, max_chunk_bytes=3 * memory.block_bytes)
    server = grpc.aio.server(options=KV_GRPC_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(KvServicer(grpc_transport), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    nixl_transport = NixlTransport(worker_id, memory, store, on_chunk, lanes=lanes, min_lane_bytes=MIN_LANE_BYTES)
    await nixl_transport.start()
    await store.register_worker(WorkerInfo(worker_id, f"127.0.0.1:{port}"), ttl_s=300)
    try:
        yield Parent(worker_id, memory, tracker, {"nixl": nixl_transport, "grpc": grpc_transport})
    finally:
        await nixl_transport.close()
        await grpc_transport.close()
        await server.stop(grace=None)
        await store.deregister_worker(worker_id)
        await store.close()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def transfer_fields(transfer: BlockTransfer) -> dict[str, Any]:
    return {"transfer_id": transfer.transfer_id, "src_worker": transfer.src_worker,
            "dst_worker": transfer.dst_worker, "src_blocks": list(transfer.src_blocks),
            "dst_blocks": list(transfer.dst_blocks), "token_start": transfer.token_start,
            "token_end": transfer.token_end, "request_id": transfer.request_id}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport_name", TRANSPORTS)
def test_round_trip_is_bit_exact_both_ways(peers, prefix, transport_name, dtype):
    async def scenario() -> None:
        peer = peers[dtype]
        rng = random.Random(f"{transport_name}-{dtype}")
        async with parent_worker(prefix, dtype) as parent:
            transport = parent.transports[transport_name]
            # Push 10 random parent blocks into random child blocks; the last block is partial.
            src, dst = rng.sample(range(NUM_BLOCKS), 10), rng.sample(range(NUM_BLOCKS), 10)
            tokens = (32, 32 + 10 * BLOCK_SIZE - 5)
            push = BlockTransfer(f"push-{uuid.uuid4().hex[:6]}", parent.worker_id, peer.worker_id,
                                 tuple(src), tuple(dst), *tokens, request_id="r1")
            await transport.push(push, parent.memory.checksum(src), timeout_s=STEP_TIMEOUT_S)
            arrived = await peer.chunks_of(push.transfer_id, *tokens)
            assert arrived.is_complete(push.transfer_id)
            assert await peer.read(dst) == parent.memory.read(src)

            # Pull them back from the child into other parent blocks.
            back = rng.sample([b for b in range(NUM_BLOCKS) if b not in src], 10)
            pull = BlockTransfer(f"pull-{uuid.uuid4().hex[:6]}", peer.worker_id, parent.worker_id,
                                 tuple(dst), tuple(back), *tokens, request_id="r1")
            received_crc = await transport.pull(pull, timeout_s=STEP_TIMEOUT_S)
            assert received_crc == parent.memory.checksum(src)
            assert torch.equal(as_bytes(parent.memory.tensor[back]), as_bytes(parent.memory.tensor[src]))

            # The child pushes into the parent, whose tracker learns of it through on_chunk.
            child_src, parent_dst = rng.sample(range(NUM_BLOCKS), 7), rng.sample(range(NUM_BLOCKS), 7)
            incoming = BlockTransfer(f"in-{uuid.uuid4().hex[:6]}", peer.worker_id, parent.worker_id,
                                     tuple(child_src), tuple(parent_dst), 0, 7 * BLOCK_SIZE, request_id="r2")
            parent.tracker.expect(incoming.transfer_id, "r2", 7 * BLOCK_SIZE, parent_dst)
            reply = await peer.call("push", transport=transport_name, transfer=transfer_fields(incoming),
                                    timeout_s=STEP_TIMEOUT_S)
            assert "error" not in reply, reply["error"]
            assert await parent.tracker.wait(incoming.transfer_id, STEP_TIMEOUT_S)
            assert parent.memory.read(parent_dst) == await peer.read(child_src)

    asyncio.run(scenario())


@pytest.mark.parametrize("parent_lanes, child", [(2, "lanes"), (2, "float32"), (1, "lanes")])
def test_nixl_lanes_split_large_transfers_and_stay_bit_exact(peers, prefix, parent_lanes, child):
    """Lanes split a transfer across the lanes both sides have; fewer on either side means fewer parts."""

    async def scenario() -> None:
        peer = peers[child]
        shared = min(parent_lanes, 2 if child == "lanes" else 1)
        rng = random.Random(f"lanes-{parent_lanes}-{child}")
        async with parent_worker(prefix, "float32", lanes=parent_lanes) as parent:
            transport = parent.transports["nixl"]
            src, dst = rng.sample(range(NUM_BLOCKS), 9), rng.sample(range(NUM_BLOCKS), 9)
            tokens = (5, 5 + 9 * BLOCK_SIZE - 12)  # a partial first and last block
            push = BlockTransfer(f"lanes-push-{uuid.uuid4().hex[:6]}", parent.worker_id, peer.worker_id,
                                 tuple(src), tuple(dst), *tokens, request_id="r")
            await transport.push(push, None, timeout_s=STEP_TIMEOUT_S)  # None: the transport digests each part
            arrived, events = await peer.chunk_events(push.transfer_id, *tokens)
            assert arrived.is_complete(push.transfer_id)
            assert len(events) == shared and all(e["ok"] for e in events)
            assert sorted(b for e in events for b in e["dst_blocks"]) == sorted(dst)
            assert await peer.read(dst) == parent.memory.read(src)

            back = rng.sample([b for b in range(NUM_BLOCKS) if b not in src], 9)
            pull = BlockTransfer(f"lanes-pull-{uuid.uuid4().hex[:6]}", peer.worker_id, parent.worker_id,
                                 tuple(dst), tuple(back), *tokens)
            assert await transport.pull(pull, timeout_s=STEP_TIMEOUT_S) == parent.memory.checksum(src)
            assert parent.memory.read(back) == parent.memory.read(src)

    asyncio.run(scenario())


@pytest.mark.parametrize("transport_name", TRANSPORTS)
def test_unknown_peer_and_tiny_timeout_fail_fast(peers, prefix, transport_name):
    async def scenario() -> None:
        peer = peers["float32"]
        async with parent_worker(prefix, "float32") as parent:
            transport = parent.transports[transport_name]
            nowhere = BlockTransfer("to-nowhere", parent.worker_id, "nobody", (1, 2), (3, 4), 0, 2 * BLOCK_SIZE)
            from_nowhere = BlockTransfer("from-nowhere", "nobody", parent.worker_id, (1, 2), (3, 4), 0, 2 * BLOCK_SIZE)
            real = BlockTransfer("real", parent.worker_id, peer.worker_id, tuple(range(16)), tuple(range(16)),
                                 0, 16 * BLOCK_SIZE)
            checksum = parent.memory.checksum(list(range(16)))
            await transport.push(real, checksum, timeout_s=STEP_TIMEOUT_S)  # connects and caches the peer
            for attempt in (transport.push(nowhere, 0, timeout_s=STEP_TIMEOUT_S),
                            transport.pull(from_nowhere, timeout_s=STEP_TIMEOUT_S),
                            transport.push(real, checksum, timeout_s=1e-6),
                            transport.push(real, checksum, timeout_s=0)):
                started = time.monotonic()
                with pytest.raises(KvTransferError):
                    await attempt
                assert time.monotonic() - started < 1.0
            # Failures leave the transport usable.
            await transport.push(real, checksum, timeout_s=STEP_TIMEOUT_S)

    asyncio.run(scenario())


def test_grpc_corrupted_chunks_are_detected_both_ways(peers, prefix):
    async def scenario() -> None:
        peer = peers["float32"]
        async with parent_worker(prefix, "float32") as parent:
            transport = parent.transports["grpc"]
            push = BlockTransfer("corrupt-push", parent.worker_id, peer.worker_id, (5, 6, 7, 8), (9, 10, 11, 12),
                                 0, 4 * BLOCK_SIZE)
            transport.outgoing_chunk_hook = flip_first_byte
            with pytest.raises(KvTransferError, match="checksum"):
                await transport.push(push, parent.memory.checksum([5, 6, 7, 8]), timeout_s=STEP_TIMEOUT_S)
            assert (await peer.chunks_of(push.transfer_id, 0, 4 * BLOCK_SIZE)).failed(push.transfer_id)
            transport.outgoing_chunk_hook = None

            await peer.call("corrupt_outgoing", enabled=True)
            before = parent.memory.read([20, 21])
            pull = BlockTransfer("corrupt-pull", peer.worker_id, parent.worker_id, (1, 2), (20, 21), 0, 2 * BLOCK_SIZE)
            try:
                with pytest.raises(KvTransferError, match="checksum"):
                    await transport.pull(pull, timeout_s=STEP_TIMEOUT_S)
            finally:
                await peer.call("corrupt_outgoing", enabled=False)
            assert parent.memory.read([20, 21]) == before  # a corrupt chunk is never written

    asyncio.run(scenario())


def test_nixl_checksum_mismatch_is_reported_not_ok(peers, prefix):
    async def scenario() -> None:
        peer = peers["bfloat16"]
        async with parent_worker(prefix, "bfloat16") as parent:
            push = BlockTransfer("bad-sum", parent.worker_id, peer.worker_id, (3, 4), (40, 41), 0, 2 * BLOCK_SIZE)
            wrong = parent.memory.checksum([3, 4]) ^ 1
            await parent.transports["nixl"].push(push, wrong, timeout_s=STEP_TIMEOUT_S)
            assert (await peer.chunks_of(push.transfer_id, 0, 2 * BLOCK_SIZE)).failed(push.transfer_id)

    asyncio.run(scenario())
