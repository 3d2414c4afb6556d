"""KV blocks between workers with NIXL over UCX: one-sided WRITE (push) and READ (pull).

Each worker runs one NIXL agent named after its worker id, registers its whole KV cache
once and publishes, through `StateStore.put_nixl_metadata`, a small header (base
address, block size, block count, memory type) followed by the agent metadata. Peers
load that once, prepare a descriptor list with one entry per block, and then transfer
any block list by index. A push carries a JSON notification; the receiver's poller
checks crc32 of the written blocks against the sender's checksum and calls `on_chunk`.

Every NIXL call runs on one dedicated thread (`NixlThread`): with UCX's CMA transport
(process to process on one host) `transfer()` copies the bytes before it returns (GIL
released), and the agent is not thread-safe in its default sync mode, so the event loop
never calls NIXL itself. A transfer is one call on that thread (post, then progress it
to completion), and the same thread polls for notifications between calls: every 1 ms
while a push into this worker is announced (`expect_incoming`, from PrepareKv) or
notifications keep arriving, backing off to 50 ms when idle. A push that timed out may
still land and notify later (a copy in progress cannot always be cancelled): the
receiver's on_chunk is the truth about what arrived. A peer restarted under the same
worker id is reloaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from splitserve.state import StateStore
from workers.kv_transfer.base import BlockTransfer, ChunkCallback, KvMemory, KvTransferError
from workers.kv_transfer.nixl_thread import NixlThread
from workers.kv_transfer.poll_schedule import PollSchedule

log = logging.getLogger(__name__)

_HEADER_MAGIC = b"SSNX1"
_NOTIF_VERSION = 1


@dataclass(frozen=True)
class NixlMemoryHeader:
    """What a peer must know about a worker's registered KV cache to address its blocks."""

    agent: str
    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str  # "DRAM" | "VRAM"
    dev_id: int
    incarnation: str  # changes on every start, so a restarted peer is recognisable


def pack_published_metadata(header: NixlMemoryHeader, agent_metadata: bytes) -> bytes:
    """Header and agent metadata as one Redis value: magic, header length, JSON, metadata."""
    encoded = json.dumps(header.__dict__).encode()
    return _HEADER_MAGIC + struct.pack("!I", len(encoded)) + encoded + agent_metadata


def unpack_published_metadata(value: bytes) -> tuple[NixlMemoryHeader, bytes]:
    """Inverse of pack_published_metadata; KvTransferError on anything else."""
    if not value.startswith(_HEADER_MAGIC) or len(value) < len(_HEADER_MAGIC) + 4:
        raise KvTransferError("published NIXL metadata has an unknown format")
    offset = len(_HEADER_MAGIC)
    (length,) = struct.unpack_from("!I", value, offset)
    offset += 4
    try:
        header = NixlMemoryHeader(**json.loads(value[offset : offset + length]))
    except (ValueError, TypeError) as exc:
        raise KvTransferError(f"published NIXL header is malformed: {exc}") from None
    return header, value[offset + length :]


def encode_write_notification(transfer: BlockTransfer, checksum: int) -> bytes:
    """The message a WRITE delivers to the destination agent once its bytes are in place."""
    return json.dumps({
        "v": _NOTIF_VERSION, "kind": "write", "transfer_id": transfer.transfer_id,
        "request_id": transfer.request_id, "src_worker": transfer.src_worker,
        "token_start": transfer.token_start, "token_end": transfer.token_end,
        "src_blocks": list(transfer.src_blocks), "dst_blocks": list(transfer.dst_blocks),
        "checksum": checksum,
    }, separators=(",", ":")).encode()


def decode_write_notification(message: bytes, dst_worker: str) -> tuple[BlockTransfer, int]:
    """The transfer and sender checksum in a WRITE notification; ValueError if malformed."""
    try:
        fields = json.loads(message)
        if fields.get("v") != _NOTIF_VERSION or fields.get("kind") != "write":
            raise ValueError(f"unexpected notification {message[:80]!r}")
        transfer = BlockTransfer(
            transfer_id=fields["transfer_id"], src_worker=fields["src_worker"], dst_worker=dst_worker,
            src_blocks=tuple(fields["src_blocks"]), dst_blocks=tuple(fields["dst_blocks"]),
            token_start=fields["token_start"], token_end=fields["token_end"], request_id=fields["request_id"],
        )
        return transfer, int(fields["checksum"])
    except (KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed notification: {exc}") from None


@dataclass
class _Peer:
    """A loaded remote agent and the prepared descriptor list of all its blocks."""

    worker_id: str
    agent_name: bytes
    header: NixlMemoryHeader
    blocks_dlist: Any  # nixl_prepped_dlist_handle


def _block_descs(base_addr: int, block_bytes: int, num_blocks: int, dev_id: int) -> np.ndarray:
    """One (address, length, device) row per block: the layout is block-major."""
    rows = np.empty((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    rows[:, 1] = block_bytes
    rows[:, 2] = dev_id
    return rows


class NixlTransport:
    """KvTransport over one NIXL agent (UCX backend) per worker; metadata exchanged in Redis."""

    name = "nixl"

    def __init__(self, worker_id: str, memory: KvMemory, store: StateStore, on_chunk: ChunkCallback,
                 poll_fast_s: float = 0.001, poll_idle_s: float = 0.05, backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = False):
        self.worker_id = worker_id
        self.memory = memory
        self.store = store
        self.on_chunk = on_chunk
        self.backends = list(backends)
        # NIXL's Python wrapper runs its progress thread with zero delay: it spins a whole
        # core even when idle. The notification polls and the transfer's own state checks
        # progress UCX instead.
        self.progress_thread = progress_thread
        self._schedule = PollSchedule(fast_s=poll_fast_s, idle_s=poll_idle_s)
        self._thread = NixlThread(f"nixl-{worker_id}", self._poll_once, self._schedule)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._agent: Any = None
        self._registration: Any = None
        self._local_dlist: Any = None
        self._mem_type = "VRAM" if memory.tensor.is_cuda else "DRAM"
        self._dev_id = (memory.tensor.device.index or 0) if memory.tensor.is_cuda else 0
        self._peers: dict[str, _Peer] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._busy_handles: list[Any] = []  # handles NIXL would not release yet; NIXL thread only
        self._deliveries: set[asyncio.Task] = set()

    async def _nixl(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._thread.submit(fn, *args))

    async def start(self) -> None:
        """Create the agent, register the KV cache and publish how to reach it."""
        self._agent = await self._nixl(self._create_agent)
        header = NixlMemoryHeader(
            agent=self.worker_id, base_addr=self.memory.base_ptr, block_bytes=self.memory.block_bytes,
            num_blocks=self.memory.num_blocks, mem_type=self._mem_type, dev_id=self._dev_id,
            incarnation=uuid.uuid4().hex,
        )
        metadata = await self._nixl(self._agent.get_agent_metadata)
        await self.store.put_nixl_metadata(self.worker_id, pack_published_metadata(header, metadata))
        self._loop = asyncio.get_running_loop()
        self._thread.start_polling()

    def expect_incoming(self, transfer_id: str, timeout_s: float) -> None:
        """A push into this worker is announced (PrepareKv): poll for its notifications fast."""
        self._thread.call_soon(self._schedule.expect, transfer_id, timeout_s)

    def incoming_done(self, transfer_id: str) -> None:
        """The announced push arrived or was given up: polling may slow down again."""
        self._thread.call_soon(self._schedule.done, transfer_id)

    def _create_agent(self) -> Any:
        from nixl._api import nixl_agent, nixl_agent_config

        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL's Python logger prints INFO lines to stdout, among the service's own logs.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        config = nixl_agent_config(enable_prog_thread=self.progress_thread, backends=self.backends)
        agent = nixl_agent(self.worker_id, config)
        self._registration = agent.register_memory(self.memory.tensor)
        rows = _block_descs(self.memory.base_ptr, self.memory.block_bytes, self.memory.num_blocks, self._dev_id)
        self._local_dlist = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem_type)
        return agent

    async def push(self, transfer: BlockTransfer, checksum: int | None, timeout_s: float) -> None:
        """WRITE local src_blocks into the peer's dst_blocks; the peer is notified when they land.

        With checksum None, the crc32 of the source blocks is computed on the NIXL thread
        right before the post: no extra thread hop, and never on the event loop.
        """
        if transfer.src_worker != self.worker_id:
            raise ValueError(f"push of {transfer.transfer_id} from {transfer.src_worker} on worker {self.worker_id}")
        _check_blocks(transfer.src_blocks, self.memory.num_blocks, "local source")
        if checksum is None:
            def notif() -> bytes:
                return encode_write_notification(transfer, self.memory.checksum(list(transfer.src_blocks)))
        else:
            notif = encode_write_notification(transfer, checksum)
        await self._with_peer("WRITE", transfer.dst_worker, transfer.src_blocks, transfer.dst_blocks,
                              notif, timeout_s, transfer.transfer_id)

    async def pull(self, transfer: BlockTransfer, timeout_s: float) -> int:
        """READ the peer's src_blocks into local dst_blocks; returns crc32 of what arrived."""
        if transfer.dst_worker != self.worker_id:
            raise ValueError(f"pull of {transfer.transfer_id} into {transfer.dst_worker} on worker {self.worker_id}")
        _check_blocks(transfer.dst_blocks, self.memory.num_blocks, "local destination")
        await self._with_peer("READ", transfer.src_worker, transfer.dst_blocks, transfer.src_blocks, b"",
                              timeout_s, transfer.transfer_id)
        return await asyncio.to_thread(self.memory.checksum, list(transfer.dst_blocks))

    async def _with_peer(self, op: str, peer_id: str, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...],
                         notif: bytes | Callable[[], bytes], timeout_s: float, transfer_id: str) -> None:
        """One transfer with a peer, tried again once if it failed because the peer restarted."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        for attempt in (1, 2):
            peer = await self._peer(peer_id, deadline)
            _check_blocks(remote_blocks, peer.header.num_blocks, f"{peer_id}'s")
            try:
                return await self._transfer(op, peer, local_blocks, remote_blocks, notif, deadline, transfer_id)
            except KvTransferError:
                # A failed (not timed-out) transfer unloads the peer. A worker restarted
                # under the same id republishes with a new incarnation: reload and go again.
                if attempt == 2 or peer_id in self._peers or not await self._restarted(peer, deadline):
                    raise
                log.info("NIXL peer %s restarted; retrying %s", peer_id, transfer_id)

    async def _restarted(self, peer: _Peer, deadline: float) -> bool:
        try:
            published = await asyncio.wait_for(self.store.get_nixl_metadata(peer.worker_id),
                                               max(0.0, deadline - asyncio.get_running_loop().time()))
            return published is not None and \
                unpack_published_metadata(published)[0].incarnation != peer.header.incarnation
        except Exception:
            return False

    async def _transfer(self, op: str, peer: _Peer, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...],
                        notif: bytes | Callable[[], bytes], deadline: float, transfer_id: str) -> None:
        what = f"NIXL {op} of {transfer_id} with {peer.worker_id}"
        try:
            # One hop to the NIXL thread for the whole transfer: each hop costs a thread
            # wake-up (and a GIL hand-over when the engine computes), which was most of
            # the per-post fixed cost.
            await self._call_before(deadline, what, self._post_and_wait, op, peer, local_blocks, remote_blocks,
                                    notif, deadline)
        except KvTransferError:
            raise  # timed out: the peer may only be slow, keep it loaded
        except Exception as exc:  # NIXL's own errors (e.g. nixlRemoteDisconnectError) and ERR
            await self._forget_peer(peer.worker_id)
            raise KvTransferError(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    def _post_and_wait(self, op: str, peer: _Peer, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...],
                       notif: bytes | Callable[[], bytes], deadline: float) -> None:
        """On the NIXL thread: post the transfer and progress it until DONE, ERR or the deadline."""
        if time.monotonic() >= deadline:
            raise _TimedOut
        if callable(notif):
            notif = notif()
        handle = self._agent.make_prepped_xfer(op, self._local_dlist, list(local_blocks), peer.blocks_dlist,
                                               list(remote_blocks), notif)
        try:
            # With CMA the copy happens inside transfer(); what may remain is the flush and
            # (for a WRITE) sending the notification, which check_xfer_state drives.
            state = self._agent.transfer(handle)
            pause = 0.0
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise _TimedOut
                time.sleep(pause)  # sleep(0) first: yield the GIL, then back off to 1 ms
                pause = min(0.001, pause * 2 or 0.00002)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
        finally:
            # A transfer still in flight is cancelled when NIXL can; otherwise its handle is
            # released by a later poll.
            self._release_or_keep(handle)

    def _release_or_keep(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception:
            self._busy_handles.append(handle)

    async def _call_before(self, deadline: float, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn on the NIXL thread; KvTransferError if it has not returned by the deadline."""
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()  # loop.time() is time.monotonic(), as on the NIXL thread
        if remaining <= 0:
            raise KvTransferError(f"{what} timed out")
        future = self._thread.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), remaining)
        except _TimedOut:
            raise KvTransferError(f"{what} timed out") from None
        except (TimeoutError, asyncio.CancelledError) as exc:
            # The call still runs on the NIXL thread; a handle it creates must not leak.
            future.add_done_callback(self._abandon_result)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise KvTransferError(f"{what} timed out") from None

    def _abandon_result(self, future: Any) -> None:
        # Runs on the NIXL thread when the abandoned call finishes.
        if not future.cancelled() and future.exception() is None and hasattr(future.result(), "release"):
            self._release_or_keep(future.result())

    async def _peer(self, worker_id: str, deadline: float) -> _Peer:
        peer = self._peers.get(worker_id)
        if peer is not None:
            return peer
        lock = self._peer_locks.setdefault(worker_id, asyncio.Lock())
        async with lock:
            if worker_id not in self._peers:
                self._peers[worker_id] = await self._connect(worker_id, deadline)
            return self._peers[worker_id]

    async def _connect(self, worker_id: str, deadline: float) -> _Peer:
        loop = asyncio.get_running_loop()
        try:
            published = await asyncio.wait_for(self.store.get_nixl_metadata(worker_id),
                                               max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise KvTransferError(f"fetching NIXL metadata of {worker_id} timed out") from None
        except Exception as exc:
            raise KvTransferError(f"cannot fetch NIXL metadata of {worker_id}: {exc}") from exc
        if published is None:
            raise KvTransferError(f"worker {worker_id} published no NIXL metadata (unknown, gone or not NIXL-enabled)")
        header, agent_metadata = unpack_published_metadata(published)
        if header.block_bytes != self.memory.block_bytes:
            raise KvTransferError(f"worker {worker_id} has {header.block_bytes}-byte KV blocks, "
                                  f"this worker {self.memory.block_bytes}: different model or layout")
        try:
            return await self._call_before(deadline, f"loading NIXL agent {worker_id}", self._load_peer,
                                           worker_id, header, agent_metadata)
        except KvTransferError:
            raise
        except Exception as exc:
            raise KvTransferError(f"cannot load NIXL agent of {worker_id}: {type(exc).__name__}: {exc}") from exc

    def _load_peer(self, worker_id: str, header: NixlMemoryHeader, agent_metadata: bytes) -> _Peer:
        try:
            name = self._agent.add_remote_agent(agent_metadata)
        except Exception:
            # Metadata of an earlier incarnation under the same name is still loaded
            # (NIXL refuses to replace it): drop it and load the new one.
            self._agent.remove_remote_agent(header.agent)
            name = self._agent.add_remote_agent(agent_metadata)
        rows = _block_descs(header.base_addr, header.block_bytes, header.num_blocks, header.dev_id)
        dlist = self._agent.prep_xfer_dlist(name, rows, header.mem_type)
        return _Peer(worker_id, name, header, dlist)

    async def _forget_peer(self, worker_id: str) -> None:
        """Drop a peer after a failed transfer, so the next one reloads its (maybe new) metadata."""
        peer = self._peers.pop(worker_id, None)
        if peer is None:
            return

        def unload() -> None:
            peer.blocks_dlist.release()
            self._agent.remove_remote_agent(peer.agent_name)

        try:
            await self._nixl(unload)
        except Exception as exc:
            log.debug("unloading NIXL peer %s: %s", worker_id, exc)

    def _poll_once(self) -> bool:
        """On the NIXL thread: fetch notifications (this also progresses UCX) and hand them to the loop."""
        if self._agent is None:
            return False  # closing
        if self._busy_handles:
            handles, self._busy_handles = self._busy_handles, []
            for handle in handles:
                self._release_or_keep(handle)
        notifs = self._agent.get_new_notifs()
        if not notifs:
            return False
        self._loop.call_soon_threadsafe(self._dispatch, notifs)
        return True

    def _dispatch(self, notifs: dict[str, list[bytes]]) -> None:
        for sender, messages in notifs.items():
            for message in messages:
                task = asyncio.create_task(self._deliver(sender, message))
                self._deliveries.add(task)
                task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, sender: str, message: bytes) -> None:
        try:
            chunk, sent_checksum = decode_write_notification(message, self.worker_id)
            _check_blocks(chunk.dst_blocks, self.memory.num_blocks, "notified destination")
        except (ValueError, KvTransferError) as exc:
            log.warning("dropping NIXL notification from %s: %s", sender, exc)
            return
        # The notification comes after the WRITE completed, so the blocks hold its bytes.
        received = await asyncio.to_thread(self.memory.checksum, list(chunk.dst_blocks))
        ok = received == sent_checksum
        if not ok:
            log.warning("KV transfer %s from %s: checksum %08x, sender said %08x", chunk.transfer_id,
                        sender, received, sent_checksum)
        try:
            self.on_chunk(chunk, ok)
        except Exception:
            log.exception("on_chunk failed for transfer %s", chunk.transfer_id)

    async def close(self) -> None:
        """Stop polling, unload peers, deregister the KV cache and destroy the agent."""
        for task in list(self._deliveries):
            task.cancel()
        await asyncio.gather(*self._deliveries, return_exceptions=True)
        if self._agent is not None:
            for worker_id in list(self._peers):
                await self._forget_peer(worker_id)
            await self._nixl(self._destroy_agent)
        await asyncio.to_thread(self._thread.stop)

    def _destroy_agent(self) -> None:
        for handle in self._busy_handles:
            log.warning("NIXL transfer handle %r still busy at close", handle)
        try:
            self._local_dlist.release()
            self._agent.deregister_memory(self._registration)
        except Exception as exc:
            log.warning("deregistering NIXL memory: %s", exc)
        self._agent = None


class _TimedOut(Exception):
    """A transfer on the NIXL thread reached its deadline."""


def _check_blocks(blocks: tuple[int, ...], num_blocks: int, what: str) -> None:
    if any(not 0 <= b < num_blocks for b in blocks):
        raise KvTransferError(f"{what} blocks {list(blocks)[:8]}... out of range [0, {num_blocks})")

