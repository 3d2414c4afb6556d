"""KV blocks between workers with NIXL over UCX: one-sided WRITE (push) and READ (pull).

Each worker runs one NIXL agent named after its worker id, registers its whole KV cache
once and publishes, through `StateStore.put_nixl_metadata`, a small header (base
address, block size, block count, memory type) followed by the agent metadata. Peers
load that once, prepare a descriptor list with one entry per block, and then transfer
any block list by index. A push carries a JSON notification; the receiver's poller
checks crc32 of the written blocks against the sender's checksum and calls `on_chunk`.

Every NIXL call runs on one dedicated thread: with UCX's CMA transport (process to
process on one host) `transfer()` copies the bytes before it returns (~45 ms for 256 MiB
here, GIL released), and the agent is not thread-safe in its default sync mode, so the
event loop never calls NIXL itself. A push that timed out may still land and notify
later (a copy in progress cannot always be cancelled): the receiver's on_chunk is the
truth about what arrived. A peer restarted under the same worker id is reloaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from splitserve.state import StateStore
from workers.kv_transfer.base import BlockTransfer, ChunkCallback, KvMemory, KvTransferError

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
                 poll_interval_s: float = 0.001, backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = False):
        self.worker_id = worker_id
        self.memory = memory
        self.store = store
        self.on_chunk = on_chunk
        self.poll_interval_s = poll_interval_s
        self.backends = list(backends)
        # NIXL's Python wrapper runs its progress thread with zero delay: it spins a whole
        # core even when idle. The notification poller's get_new_notifs and the
        # check_xfer_state polls progress UCX instead.
        self.progress_thread = progress_thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nixl-{worker_id}")
        self._agent: Any = None
        self._registration: Any = None
        self._local_dlist: Any = None
        self._mem_type = "VRAM" if memory.tensor.is_cuda else "DRAM"
        self._dev_id = (memory.tensor.device.index or 0) if memory.tensor.is_cuda else 0
        self._peers: dict[str, _Peer] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._to_release: list[Any] = []  # transfer handles, released by the poller
        self._poller: asyncio.Task | None = None
        self._deliveries: set[asyncio.Task] = set()

    async def _nixl(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

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
        self._poller = asyncio.create_task(self._poll_notifications(), name=f"nixl-notifs-{self.worker_id}")

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

    async def push(self, transfer: BlockTransfer, checksum: int, timeout_s: float) -> None:
        """WRITE local src_blocks into the peer's dst_blocks; the peer is notified when they land."""
        if transfer.src_worker != self.worker_id:
            raise ValueError(f"push of {transfer.transfer_id} from {transfer.src_worker} on worker {self.worker_id}")
        _check_blocks(transfer.src_blocks, self.memory.num_blocks, "local source")
        await self._with_peer("WRITE", transfer.dst_worker, transfer.src_blocks, transfer.dst_blocks,
                              encode_write_notification(transfer, checksum), timeout_s, transfer.transfer_id)

    async def pull(self, transfer: BlockTransfer, timeout_s: float) -> int:
        """READ the peer's src_blocks into local dst_blocks; returns crc32 of what arrived."""
        if transfer.dst_worker != self.worker_id:
            raise ValueError(f"pull of {transfer.transfer_id} into {transfer.dst_worker} on worker {self.worker_id}")
        _check_blocks(transfer.dst_blocks, self.memory.num_blocks, "local destination")
        await self._with_peer("READ", transfer.src_worker, transfer.dst_blocks, transfer.src_blocks, b"",
                              timeout_s, transfer.transfer_id)
        return await asyncio.to_thread(self.memory.checksum, list(transfer.dst_blocks))

    async def _with_peer(self, op: str, peer_id: str, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...],
                         notif: bytes, timeout_s: float, transfer_id: str) -> None:
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
                        notif: bytes, deadline: float, transfer_id: str) -> None:
        what = f"NIXL {op} of {transfer_id} with {peer.worker_id}"
        handle = None
        try:
            handle = await self._call_before(deadline, what, self._agent.make_prepped_xfer, op, self._local_dlist,
                                             list(local_blocks), peer.blocks_dlist, list(remote_blocks), notif)
            # transfer() may do the whole copy before it returns (CMA); the deadline bounds
            # it like the polls that follow.
            state = await self._call_before(deadline, what, self._agent.transfer, handle)
            while state == "PROC":
                await asyncio.sleep(self.poll_interval_s)
                state = await self._call_before(deadline, what, self._agent.check_xfer_state, handle)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
        except KvTransferError:
            raise  # timed out: the peer may only be slow, keep it loaded
        except Exception as exc:  # NIXL's own errors (e.g. nixlRemoteDisconnectError) and ERR
            await self._forget_peer(peer.worker_id)
            raise KvTransferError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if handle is not None:
                # Released by the poller; a transfer still in flight is cancelled when NIXL can.
                self._to_release.append(handle)

    async def _call_before(self, deadline: float, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn on the NIXL thread; KvTransferError if it has not returned by the deadline."""
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise KvTransferError(f"{what} timed out")
        future = loop.run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(future), remaining)
        except (TimeoutError, asyncio.CancelledError) as exc:
            # The call still runs on the NIXL thread; a handle it creates must not leak.
            future.add_done_callback(self._abandon_result)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise KvTransferError(f"{what} timed out") from None

    def _abandon_result(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None and hasattr(future.result(), "release"):
            self._to_release.append(future.result())

    async def _release_handles(self) -> None:
        handles, self._to_release = self._to_release, []
        self._to_release.extend(await self._nixl(_release_all, handles))

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

    async def _poll_notifications(self) -> None:
        while True:
            try:
                notifs = await self._nixl(self._agent.get_new_notifs)
                if self._to_release:
                    await self._release_handles()
            except Exception:
                log.exception("polling NIXL notifications failed")
                notifs = {}
            for sender, messages in notifs.items():
                for message in messages:
                    task = asyncio.create_task(self._deliver(sender, message))
                    self._deliveries.add(task)
                    task.add_done_callback(self._deliveries.discard)
            await asyncio.sleep(self.poll_interval_s)

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
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for task in list(self._deliveries):
            task.cancel()
        await asyncio.gather(*self._deliveries, return_exceptions=True)
        if self._agent is not None:
            for worker_id in list(self._peers):
                await self._forget_peer(worker_id)
            await self._release_handles()
            for handle in self._to_release:
                log.warning("NIXL transfer handle %r still busy at close", handle)
            await self._nixl(self._destroy_agent)
        self._executor.shutdown(wait=True)

    def _destroy_agent(self) -> None:
        try:
            self._local_dlist.release()
            self._agent.deregister_memory(self._registration)
        except Exception as exc:
            log.warning("deregistering NIXL memory: %s", exc)
        self._agent = None


def _release_all(handles: list[Any]) -> list[Any]:
    """Release NIXL handles; returns those NIXL refused (transfers it could not cancel yet)."""
    busy = []
    for handle in handles:
        try:
            handle.release()
        except Exception:
            busy.append(handle)
    return busy


def _check_blocks(blocks: tuple[int, ...], num_blocks: int, what: str) -> None:
    if any(not 0 <= b < num_blocks for b in blocks):
        raise KvTransferError(f"{what} blocks {list(blocks)[:8]}... out of range [0, {num_blocks})")

