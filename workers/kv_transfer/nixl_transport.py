"""KV blocks between workers with NIXL over UCX: one-sided WRITE (push) and READ (pull).

Each worker runs one NIXL agent per *lane* (lane 0 is named after the worker id),
registers its whole KV cache with each once and publishes, through
`StateStore.put_nixl_metadata`, a header and every lane's agent metadata
(`nixl_wire.py`). Peers load that once, prepare a descriptor list with one entry per block
per lane, and then transfer any block list by index. A push carries a JSON notification
(with the WRITE, or for a large part sent after it, once its digest computed beside the
copy is ready); the receiver's poller checks the digest (xxh3_64) of the written blocks
against the sender's and calls `on_chunk`.

Lanes: a large transfer is split into consecutive block runs, one per lane the two
workers share, posted at once. With UCX's CMA transport (process to process on one host)
a post is one core's copy, so lanes copy on several cores; across hosts they would map to
NICs. Raw NIXL on an idle 2-core VM went 9–12 → 12–18 GB/s with two lanes, but through this
transport (digests, receiver polls on the same two cores) only +0–15%: the default is one
lane. Each part carries its own token range and digest; the receiver's tracker puts the
parts back together.

Every NIXL call of a lane runs on that lane's thread (`NixlThread`): with CMA `transfer()`
copies the bytes before it returns (GIL released), and an agent is not thread-safe in its
default sync mode, so the event loop never calls NIXL itself. A transfer is one call on
that thread (post, then progress it to completion), and the same thread polls for
notifications between calls: every 1 ms while a push into this worker is announced
(`expect_incoming`, from PrepareKv) or notifications keep arriving, backing off to 50 ms
when idle. A push that timed out may still land and notify later (a copy in progress
cannot always be cancelled): the receiver's on_chunk is the truth about what arrived. A
peer restarted under the same worker id is reloaded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from splitserve.state.store import StateStore
from workers.kv_transfer.base import (
    BlockTransfer,
    ChunkCallback,
    KvMemory,
    KvTransferError,
    LayerAssembler,
    layer_desc_index,
    split_transfer,
)
from workers.kv_transfer.nixl_thread import NixlThread
from workers.kv_transfer.nixl_wire import (
    NixlMemoryHeader,
    block_descs,
    decode_write_notification,
    encode_write_notification,
    lane_agent_name,
    layer_block_descs,
    pack_published_metadata,
    unpack_published_metadata,
)
from workers.kv_transfer.poll_schedule import PollSchedule

log = logging.getLogger(__name__)

_SPIN_S = 0.002  # how long a posted transfer is polled without sleeping
_INLINE_DIGEST_BYTES = 1 << 20  # a received layer slice below this is checked on the event loop


@dataclass
class _Lane:
    """One NIXL agent and the thread that makes every call to it."""

    index: int
    name: str
    schedule: PollSchedule
    thread: NixlThread | None = None
    agent: Any = None
    registration: Any = None
    local_dlist: Any = None
    local_layer_dlist: Any = None  # lane 0: one row per block per layer (per-layer pushes)
    busy_handles: list[Any] = field(default_factory=list)  # handles NIXL would not release yet


@dataclass
class _Peer:
    """A peer's header and, per shared lane, its loaded agent name and prepared block descriptors."""

    worker_id: str
    header: NixlMemoryHeader
    lanes: list[tuple[bytes, Any]]  # (remote agent name, nixl_prepped_dlist_handle), by lane index
    layer_dlist: Any = None  # lane 0's per-layer descriptors of the peer, when it splits blocks by layer alike


class NixlTransport:
    """KvTransport over NIXL agents (UCX backend), `lanes` per worker; metadata exchanged in Redis."""

    name = "nixl"

    def __init__(self, worker_id: str, memory: KvMemory, store: StateStore, on_chunk: ChunkCallback,
                 poll_fast_s: float = 0.001, poll_idle_s: float = 0.05, backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = False, lanes: int = 1, min_lane_bytes: int = 4 << 20):
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.worker_id = worker_id
        self.memory = memory
        self.store = store
        self.on_chunk = on_chunk
        self.backends = list(backends)
        # NIXL's Python wrapper runs its progress thread with zero delay: it spins a whole
        # core even when idle. The notification polls and the transfer's own state checks
        # progress UCX instead.
        self.progress_thread = progress_thread
        # Below this many bytes per lane a split costs more (one post each) than it saves.
        self.min_lane_bytes = min_lane_bytes
        self._lanes = []
        for index in range(lanes):
            lane = _Lane(index, lane_agent_name(worker_id, index), PollSchedule(fast_s=poll_fast_s, idle_s=poll_idle_s))
            lane.thread = NixlThread(f"nixl-{lane.name}", lambda lane=lane: self._poll_once(lane), lane.schedule)
            self._lanes.append(lane)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mem_type = "VRAM" if memory.tensor.is_cuda else "DRAM"
        self._dev_id = (memory.tensor.device.index or 0) if memory.tensor.is_cuda else 0
        self._peers: dict[str, _Peer] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._deliveries: set[asyncio.Task] = set()
        self._layers = LayerAssembler(memory.num_layers)  # per-layer slices put back together
        # Testing (kv_fault_injection=corrupt): each WRITE reads its bytes from the wrong source
        # blocks while its notification carries the digest of the right ones, so bytes that
        # really differ land at the receiver (a misaddressed DMA), which must detect them.
        self.corrupt_writes = False
        self._published: bytes | None = None  # what start() published, for publish()

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    async def _on(self, lane: _Lane, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(lane.thread.submit(fn, *args))

    async def publish(self) -> None:
        """(Re)publish how to reach this worker's agents: at start, and again when the worker
        re-registers (a Redis that restarted empty lost it, and peers could not load us)."""
        if self._published is not None:
            await self.store.put_nixl_metadata(self.worker_id, self._published)

    async def start(self) -> None:
        """Create the agents, register the KV cache with each and publish how to reach them."""
        metadata = [await self._on(lane, self._create_agent, lane) for lane in self._lanes]
        header = NixlMemoryHeader(
            agent=self.worker_id, base_addr=self.memory.base_ptr, block_bytes=self.memory.block_bytes,
            num_blocks=self.memory.num_blocks, mem_type=self._mem_type, dev_id=self._dev_id,
            incarnation=uuid.uuid4().hex, lanes=len(self._lanes), num_layers=self.memory.num_layers,
        )
        self._published = pack_published_metadata(header, metadata)
        await self.publish()
        self._loop = asyncio.get_running_loop()
        for lane in self._lanes:
            lane.thread.start_polling()

    def expect_incoming(self, transfer_id: str, timeout_s: float) -> None:
        """A push into this worker is announced (PrepareKv): poll for its notifications fast, on every lane."""
        for lane in self._lanes:
            lane.thread.call_soon(lane.schedule.expect, transfer_id, timeout_s)

    def incoming_done(self, transfer_id: str) -> None:
        """The announced push arrived or was given up: polling may slow down again."""
        for lane in self._lanes:
            lane.thread.call_soon(lane.schedule.done, transfer_id)
        self._layers.forget(transfer_id)

    def _create_agent(self, lane: _Lane) -> bytes:
        """On the lane's thread: its agent, the KV cache registered, local descriptors; returns its metadata."""
        from nixl._api import nixl_agent, nixl_agent_config

        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL's Python logger prints INFO lines to stdout, among the service's own logs.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        config = nixl_agent_config(enable_prog_thread=self.progress_thread, backends=self.backends)
        lane.agent = nixl_agent(lane.name, config)
        lane.registration = lane.agent.register_memory(self.memory.tensor)
        rows = block_descs(self.memory.base_ptr, self.memory.block_bytes, self.memory.num_blocks, self._dev_id)
        lane.local_dlist = lane.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem_type)
        if lane.index == 0 and self.memory.num_layers > 1:
            rows = layer_block_descs(self.memory.base_ptr, self.memory.block_bytes, self.memory.num_blocks,
                                     self.memory.num_layers, self._dev_id)
            lane.local_layer_dlist = lane.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem_type)
        return lane.agent.get_agent_metadata()

    @property
    def supports_layer_push(self) -> bool:
        """Whether `push` takes one layer's slice of blocks (BlockTransfer.layer): a model of several layers."""
        return self.memory.num_layers > 1

    async def push(self, transfer: BlockTransfer, checksum: int | None, timeout_s: float) -> None:
        """WRITE local src_blocks into the peer's dst_blocks; the peer is notified as each part lands.

        With checksum None, each part's digest is computed on its lane's thread right
        before its post (never on the event loop), and large transfers use every shared
        lane. A given checksum covers the whole transfer, which then goes as one part.
        """
        if transfer.src_worker != self.worker_id:
            raise ValueError(f"push of {transfer.transfer_id} from {transfer.src_worker} on worker {self.worker_id}")
        _check_blocks(transfer.src_blocks, self.memory.num_blocks, "local source")
        if transfer.layer is not None and not 0 <= transfer.layer < self.memory.num_layers:
            raise ValueError(f"push of layer {transfer.layer}; the KV cache has {self.memory.num_layers}")
        # A layer's slice is small and goes as one part, on lane 0 (which has per-layer descriptors).
        await self._with_peer("WRITE", transfer, transfer.dst_worker, timeout_s, checksum,
                              split=checksum is None and transfer.layer is None)

    async def pull(self, transfer: BlockTransfer, timeout_s: float) -> int:
        """READ the peer's src_blocks into local dst_blocks (over every shared lane); returns their kv_digest."""
        if transfer.dst_worker != self.worker_id:
            raise ValueError(f"pull of {transfer.transfer_id} into {transfer.dst_worker} on worker {self.worker_id}")
        _check_blocks(transfer.dst_blocks, self.memory.num_blocks, "local destination")
        await self._with_peer("READ", transfer, transfer.src_worker, timeout_s, None, split=True)
        return await asyncio.to_thread(self.memory.checksum, list(transfer.dst_blocks))

    def _parts(self, transfer: BlockTransfer, shared_lanes: int) -> list[BlockTransfer]:
        lanes = min(shared_lanes, len(transfer.dst_blocks) * self.memory.block_bytes // max(1, self.min_lane_bytes))
        return split_transfer(transfer, lanes, self.memory.block_size)

    async def _with_peer(self, op: str, transfer: BlockTransfer, peer_id: str, timeout_s: float,
                         checksum: int | None, split: bool) -> None:
        """One transfer with a peer, tried again once if it failed because the peer restarted."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        for attempt in (1, 2):
            peer = await self._peer(peer_id, deadline)
            remote_blocks = transfer.dst_blocks if op == "WRITE" else transfer.src_blocks
            _check_blocks(remote_blocks, peer.header.num_blocks, f"{peer_id}'s")
            parts = self._parts(transfer, len(peer.lanes)) if split else [transfer]
            results = await asyncio.gather(
                *(self._transfer(op, peer, self._lanes[k], part, checksum, deadline) for k, part in enumerate(parts)),
                return_exceptions=True)  # every part settles before we report: none is left running
            errors = [r for r in results if isinstance(r, BaseException)]
            if not errors:
                return
            if any(isinstance(e, asyncio.CancelledError) for e in errors):
                raise asyncio.CancelledError
            if not all(isinstance(e, KvTransferError) for e in errors):
                raise next(e for e in errors if not isinstance(e, KvTransferError))
            # A failed (not timed-out) transfer unloads the peer. A worker restarted under
            # the same id republishes with a new incarnation: reload and go again.
            if attempt == 2 or peer_id in self._peers or not await self._restarted(peer, deadline):
                raise errors[0]
            log.info("NIXL peer %s restarted; retrying %s", peer_id, transfer.transfer_id)

    async def _restarted(self, peer: _Peer, deadline: float) -> bool:
        try:
            published = await asyncio.wait_for(self.store.get_nixl_metadata(peer.worker_id),
                                               max(0.0, deadline - asyncio.get_running_loop().time()))
            return published is not None and \
                unpack_published_metadata(published)[0].incarnation != peer.header.incarnation
        except Exception:
            return False

    async def _transfer(self, op: str, peer: _Peer, lane: _Lane, part: BlockTransfer, checksum: int | None,
                        deadline: float) -> None:
        what = f"NIXL {op} of {part.transfer_id} [{part.token_start}, {part.token_end}) with {peer.worker_id}"
        local, remote = (part.src_blocks, part.dst_blocks) if op == "WRITE" else (part.dst_blocks, part.src_blocks)
        if op == "WRITE" and self.corrupt_writes:
            local = misdirected_blocks(local, self.memory.num_blocks)
        remote_name, remote_dlist = peer.lanes[lane.index]
        local_dlist = None  # the lane's per-block descriptors
        if part.layer is not None:
            if peer.layer_dlist is None or lane.local_layer_dlist is None:
                raise KvTransferError(f"{what}: {peer.worker_id} has {peer.header.num_layers} layer(s) per block, "
                                      f"this worker {self.memory.num_layers}: no per-layer push")
            layers = self.memory.num_layers
            local = tuple(layer_desc_index(b, part.layer, layers) for b in local)
            remote = tuple(layer_desc_index(b, part.layer, layers) for b in remote)
            remote_dlist, local_dlist = peer.layer_dlist, lane.local_layer_dlist
        digest_aside = op == "WRITE" and checksum is None and part.layer is None and \
            len(part.src_blocks) * self.memory.block_bytes >= self.min_lane_bytes
        if op == "READ" or digest_aside:
            notif: bytes | Callable[[], bytes] = b""
        elif checksum is None:
            def notif() -> bytes:
                return encode_write_notification(part, self.memory.checksum(list(part.src_blocks), part.layer))
        else:
            notif = encode_write_notification(part, checksum)
        try:
            digest = None
            if digest_aside:
                # A large part: its digest (~27 GB/s) would add a third to a one-core copy
                # (~10 GB/s) if it came first; compute it on another thread meanwhile and
                # notify once both are done — the bytes are in place by then.
                digest = asyncio.ensure_future(asyncio.to_thread(self.memory.checksum, list(part.src_blocks)))
            # One hop to the lane's thread for the whole part: each hop costs a thread
            # wake-up (and a GIL hand-over when the engine computes).
            try:
                await self._call_before(lane, deadline, what, self._post_and_wait, lane, op, remote_dlist,
                                        local, remote, notif, deadline, local_dlist,
                                        part.layer is None or part.layer == self.memory.num_layers - 1)
            finally:
                if digest is not None and not digest.done():
                    await asyncio.wait([digest])  # never leave it reading blocks the caller may free
            if digest is not None:
                message = encode_write_notification(part, digest.result())
                await self._call_before(lane, deadline, what, lambda: lane.agent.send_notif(remote_name, message))
        except KvTransferError:
            raise  # timed out: the peer may only be slow, keep it loaded
        except Exception as exc:  # NIXL's own errors (e.g. nixlRemoteDisconnectError) and ERR
            await self._forget_peer(peer.worker_id)
            raise KvTransferError(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    def _post_and_wait(self, lane: _Lane, op: str, remote_dlist: Any, local_blocks: tuple[int, ...],
                       remote_blocks: tuple[int, ...], notif: bytes | Callable[[], bytes], deadline: float,
                       local_dlist: Any = None, spin: bool = True) -> None:
        """On the lane's thread: post the transfer and progress it until DONE, ERR or the deadline."""
        if time.monotonic() >= deadline:
            raise _TimedOut
        if callable(notif):
            notif = notif()
        handle = lane.agent.make_prepped_xfer(op, local_dlist or lane.local_dlist, list(local_blocks), remote_dlist,
                                              list(remote_blocks), notif)
        try:
            # With CMA the copy happens inside transfer(); what may remain is the flush and
            # (for a WRITE) sending the notification, which check_xfer_state drives.
            state = lane.agent.transfer(handle)
            # Small transfers finish within a few hundred microseconds of the post: spin
            # (yielding the GIL) that long, since sleeping even 20 us at a time doubled
            # their latency, then back off to 1 ms naps for whatever is really slow.
            # A layer slice other than the last goes while later layers compute: nobody waits
            # for it, so it naps from the start rather than spin a core beside the engine.
            spin_until = time.monotonic() + (0.0 if spin is False else _SPIN_S)
            pause = 0.0
            while state == "PROC":
                now = time.monotonic()
                if now >= deadline:
                    raise _TimedOut
                if now >= spin_until:
                    pause = min(0.001, pause * 2 or 0.00005)
                time.sleep(pause)
                state = lane.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
        finally:
            # A transfer still in flight is cancelled when NIXL can; otherwise its handle is
            # released by a later poll.
            _release_or_keep(lane, handle)

    async def _call_before(self, lane: _Lane, deadline: float, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn on the lane's thread; KvTransferError if it has not returned by the deadline."""
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()  # loop.time() is time.monotonic(), as on the NIXL thread
        if remaining <= 0:
            raise KvTransferError(f"{what} timed out")
        future = lane.thread.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), remaining)
        except _TimedOut:
            raise KvTransferError(f"{what} timed out") from None
        except (TimeoutError, asyncio.CancelledError) as exc:
            # The call still runs on the lane's thread; a handle it creates must not leak.
            future.add_done_callback(lambda done: _abandon_result(lane, done))
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise KvTransferError(f"{what} timed out") from None

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
        shared = self._lanes[: len(agent_metadata)]  # lane k talks to the peer's lane k
        try:
            lanes = await asyncio.gather(*(
                self._call_before(lane, deadline, f"loading NIXL agent {worker_id} on lane {lane.index}",
                                  self._load_peer_lane, lane, header, agent_metadata[lane.index])
                for lane in shared))
        except KvTransferError:
            raise
        except Exception as exc:
            raise KvTransferError(f"cannot load NIXL agent of {worker_id}: {type(exc).__name__}: {exc}") from exc
        layer_dlist = None
        if header.num_layers == self.memory.num_layers > 1 and self._lanes[0].local_layer_dlist is not None:
            try:
                layer_dlist = await self._call_before(self._lanes[0], deadline, f"per-layer descriptors of {worker_id}",
                                                      self._prep_peer_layers, lanes[0][0], header)
            except Exception as exc:  # whole-block pushes still work
                log.warning("no per-layer descriptors for %s: %s", worker_id, exc)
        return _Peer(worker_id, header, list(lanes), layer_dlist)

    def _prep_peer_layers(self, name: bytes, header: NixlMemoryHeader) -> Any:
        rows = layer_block_descs(header.base_addr, header.block_bytes, header.num_blocks, header.num_layers,
                                 header.dev_id)
        return self._lanes[0].agent.prep_xfer_dlist(name, rows, header.mem_type)

    def _load_peer_lane(self, lane: _Lane, header: NixlMemoryHeader, agent_metadata: bytes) -> tuple[bytes, Any]:
        try:
            name = lane.agent.add_remote_agent(agent_metadata)
        except Exception:
            # Metadata of an earlier incarnation under the same name is still loaded
            # (NIXL refuses to replace it): drop it and load the new one.
            lane.agent.remove_remote_agent(lane_agent_name(header.agent, lane.index))
            name = lane.agent.add_remote_agent(agent_metadata)
        rows = block_descs(header.base_addr, header.block_bytes, header.num_blocks, header.dev_id)
        return name, lane.agent.prep_xfer_dlist(name, rows, header.mem_type)

    async def _forget_peer(self, worker_id: str) -> None:
        """Drop a peer after a failed transfer, so the next one reloads its (maybe new) metadata."""
        peer = self._peers.pop(worker_id, None)
        if peer is None:
            return

        def unload(lane: _Lane, name: bytes, dlist: Any) -> None:
            dlist.release()
            if lane.index == 0 and peer.layer_dlist is not None:
                peer.layer_dlist.release()
            lane.agent.remove_remote_agent(name)

        for lane, (name, dlist) in zip(self._lanes, peer.lanes):
            try:
                await self._on(lane, unload, lane, name, dlist)
            except Exception as exc:
                log.debug("unloading NIXL peer %s on lane %d: %s", worker_id, lane.index, exc)

    def _poll_once(self, lane: _Lane) -> bool:
        """On the lane's thread: fetch notifications (this also progresses UCX) and hand them to the loop."""
        if lane.agent is None:
            return False  # closing
        if lane.busy_handles:
            handles, lane.busy_handles = lane.busy_handles, []
            for handle in handles:
                _release_or_keep(lane, handle)
        notifs = lane.agent.get_new_notifs()
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
        if chunk.layer is not None and not 0 <= chunk.layer < self.memory.num_layers:
            log.warning("dropping NIXL notification from %s: layer %d of %d", sender, chunk.layer,
                        self.memory.num_layers)
            return
        # The notification comes after the WRITE completed, so the blocks hold its bytes.
        if chunk.layer is not None and len(chunk.dst_blocks) * self.memory.layer_bytes < _INLINE_DIGEST_BYTES:
            received = self.memory.checksum(list(chunk.dst_blocks), chunk.layer)  # ~10 us: no thread hop
        else:
            received = await asyncio.to_thread(self.memory.checksum, list(chunk.dst_blocks), chunk.layer)
        ok = received == sent_checksum
        if not ok:
            log.warning("KV transfer %s from %s: checksum %016x, sender said %016x", chunk.transfer_id,
                        sender, received, sent_checksum)
        if chunk.layer is not None:
            # One layer's slice: the chunk's tokens count once every layer's slice is in.
            settled = self._layers.add(chunk, ok)
            if settled is None:
                return
            chunk, ok = settled
        try:
            self.on_chunk(chunk, ok)
        except Exception:
            log.exception("on_chunk failed for transfer %s", chunk.transfer_id)

    async def close(self) -> None:
        """Stop polling, unload peers, deregister the KV cache and destroy the agents."""
        for task in list(self._deliveries):
            task.cancel()
        await asyncio.gather(*self._deliveries, return_exceptions=True)
        for worker_id in list(self._peers):
            await self._forget_peer(worker_id)
        for lane in self._lanes:
            if lane.agent is not None:
                await self._on(lane, _destroy_agent, lane)
        for lane in self._lanes:
            await asyncio.to_thread(lane.thread.stop)


class _TimedOut(Exception):
    """A transfer on a lane's thread reached its deadline."""


def _release_or_keep(lane: _Lane, handle: Any) -> None:
    """On the lane's thread: release a transfer handle, or keep it for a later poll if NIXL won't yet."""
    try:
        handle.release()
    except Exception:
        lane.busy_handles.append(handle)


def _abandon_result(lane: _Lane, future: Any) -> None:
    # Runs on the lane's thread when an abandoned call finishes.
    if not future.cancelled() and future.exception() is None and hasattr(future.result(), "release"):
        _release_or_keep(lane, future.result())


def _destroy_agent(lane: _Lane) -> None:
    for handle in lane.busy_handles:
        log.warning("NIXL transfer handle %r still busy at close", handle)
    try:
        if lane.local_dlist is not None:
            lane.local_dlist.release()
        if lane.local_layer_dlist is not None:
            lane.local_layer_dlist.release()
        if lane.registration is not None:
            lane.agent.deregister_memory(lane.registration)
    except Exception as exc:
        log.warning("deregistering NIXL memory: %s", exc)
    lane.agent = None


def _check_blocks(blocks: tuple[int, ...], num_blocks: int, what: str) -> None:
    if any(not 0 <= b < num_blocks for b in blocks):
        raise KvTransferError(f"{what} blocks {list(blocks)[:8]}... out of range [0, {num_blocks})")


def misdirected_blocks(blocks: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    """Testing: the source blocks of a WRITE shifted so each part reads another block's bytes
    (the next one of the transfer, or for a single block its neighbour in the pool)."""
    if len(blocks) > 1:
        return blocks[1:] + blocks[:1]
    return tuple((b + 1) % num_blocks for b in blocks)
