"""Worker side of multi-stage requests: reserved KV for incoming stages, chunked push out.

Receiver: `prepare` reserves blocks for a transfer (Worker.PrepareKv); the continuing
stage waits for every chunk (`acquire_prefix`) and adopts the blocks, or recomputes
from tokens when the transfer failed, timed out or arrived corrupted.
Sender: a stage with a KvSink pushes every completed chunk of `chunk_tokens` while it
keeps computing (DynaServe §4.3), then the remainder when it ends, then frees its KV.
Source of a lazy pull (AMPD §3): `lease_session` holds a session's pinned history blocks
for another worker to read; the lease ends when the request's next stage arrives here
(the pull is long done by then), on Cancel, or after the reservation TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from prometheus_client import Counter, Gauge, Histogram

from splitserve.core import InvalidInput, KvCapacityError, KvInBlocks, KvPushPlan, KvSink, StageKey, whole_block_chunk
from splitserve.telemetry import percentile_buckets
from workers.engine_loop import EngineLoop
from workers.kv_transfer.base import BlockTransfer, KvMemory, KvTransferError, KvTransport
from workers.kv_transfer.tracker import TransferTracker

log = logging.getLogger(__name__)

KV_BYTES = Counter("splitserve_worker_kv_pushed_bytes_total", "KV bytes pushed to other workers")
KV_PUSH_SECONDS = Histogram("splitserve_worker_kv_push_seconds", "Time of one pushed chunk",
                            buckets=percentile_buckets(10.0))
KV_EXPOSED_SECONDS = Histogram(
    "splitserve_worker_kv_exposed_seconds",
    "Transfer time not hidden behind compute: stage end to its last KV chunk in place (DynaServe §4.3)",
    buckets=percentile_buckets(10.0))
KV_LAYER_SLICES = Counter("splitserve_worker_kv_layer_slices_total",
                          "Per-layer slices pushed from inside a stage's last step (NIXL, kv_layer_push)")
KV_OUTCOMES = Counter("splitserve_worker_kv_incoming_total", "Incoming stage KV: used or recomputed", ["outcome"])
KV_UNUSABLE = Counter("splitserve_worker_kv_unusable_total",
                      "Incoming stage KV recomputed instead: failed (a bad checksum, or the sender's notice that "
                      "its push failed) or timeout (nothing more arrived within kv_transfer_timeout_s)", ["reason"])
KV_FAILURE_NOTICES = Counter("splitserve_worker_kv_failure_notices_total",
                             "Failed pushes this worker told the receiver about (sent) or could not (undelivered)",
                             ["result"])
KV_INCOMING_TOKENS = Counter("splitserve_worker_kv_incoming_tokens_total",
                             "Tokens of KV taken from other workers instead of computed, by how", ["how"])
HISTORY_CACHED_TOKENS = Counter(
    "splitserve_worker_history_cached_tokens_total",
    "History tokens a lazy pull found in this worker's own prefix cache, so did not pull")
KV_RESERVATIONS = Counter("splitserve_worker_kv_reservations_total",
                          "KV reservations for another worker's push (PrepareKv): reserved, or no_room (none now, "
                          "or within the caller's wait in line)", ["outcome"])
KV_RESERVATIONS_WAITING = Gauge("splitserve_worker_kv_reservations_waiting",
                                "KV reservations (PrepareKv) allowed to wait for room and not yet answered: "
                                "a line here means prefills elsewhere are held back for want of this worker's KV")
KV_RESERVE_WAIT_SECONDS = Counter("splitserve_worker_kv_reserve_wait_seconds_total",
                                  "Seconds from PrepareKv to its answer for reservations allowed to wait for room "
                                  "(time in line plus the engine's answer between steps)")
HISTORY_LEASES = Counter("splitserve_worker_session_history_leases_total",
                         "Pinned session histories lent to another worker's lazy pull (AMPD remote prefill)")


@dataclass
class _Reservation:
    request_id: str
    block_ids: list[int]  # for tokens [start, num_tokens)
    num_tokens: int
    created: float
    start: int = 0  # tokens before it are this worker's already (a session's pinned history)


@dataclass
class _Lease:
    """A session's pinned history blocks held for a lazy pull by `request_id`'s prefill worker."""

    request_id: str
    block_ids: list[int]
    created: float


@dataclass
class _OutgoingPush:
    key: StageKey
    sink: KvSink
    plan: KvPushPlan  # which ranges may leave as the stage computes (shared with the simulator)
    computed_at: float | None = None  # when the step that reached stop_at was reported
    layer_range: tuple[int, int] | None = None  # pushed layer by layer from inside the last step
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    failed: bool = False


class KvStageManager:
    """Reservations, incoming-transfer waits and outgoing chunked pushes of one worker."""

    def __init__(self, worker_id: str, loop: EngineLoop, memory: KvMemory, tracker: TransferTracker,
                 transfer_timeout_s: float, reservation_ttl_s: float, fault_injection: str = "",
                 layer_push: bool = False):
        self.worker_id = worker_id
        self.loop = loop
        self.memory = memory
        self.tracker = tracker
        self.transport: KvTransport | None = None
        self.transfer_timeout_s = transfer_timeout_s
        self.reservation_ttl_s = reservation_ttl_s
        self.fault_injection = fault_injection
        # Push the last step's KV layer by layer as the engine computes it (transports that can).
        self.layer_push = layer_push
        self._reservations: dict[str, _Reservation] = {}
        self._leases: list[_Lease] = []
        self._pushes: dict[str, _OutgoingPush] = {}
        # Tells a receiver that a push failed (the gRPC transport's signal_failure, whatever
        # transport carried the data); None: the receiver finds out at its transfer timeout.
        self.failure_notice: Callable[[BlockTransfer, str, float], Awaitable[bool]] | None = None
        self._notices: set[asyncio.Future] = set()  # notices in flight (kept referenced until done)

    def on_chunk(self, chunk: BlockTransfer, checksum_ok: bool) -> None:
        """Transport callback: a chunk of an incoming transfer is in place."""
        if not checksum_ok:
            log.warning("KV chunk [%d, %d) of %s failed its checksum", chunk.token_start, chunk.token_end,
                        chunk.transfer_id)
        self.tracker.on_chunk(chunk.transfer_id, chunk.token_start, chunk.token_end, checksum_ok)
        entry = self.tracker.get(chunk.transfer_id)
        if entry is not None and entry.done.is_set() and self.transport is not None:
            self.transport.incoming_done(chunk.transfer_id)  # all in (or failed): stop polling fast

    # ---- receiving ----------------------------------------------------------------
    async def prepare(self, request_id: str, transfer_id: str, num_tokens: int, start: int = 0,
                      wait_s: float = 0.0) -> list[int]:
        """Reserve blocks for [start, num_tokens) of a request's KV, waiting in line up to
        `wait_s` for room; raises KvCapacityError when none came, or InvalidInput for a start
        that is not whole blocks below num_tokens."""
        self.reap_expired()
        if transfer_id in self._reservations:
            return self._reservations[transfer_id].block_ids
        if not 0 <= start < num_tokens or (start and start % self.memory.block_size):
            raise InvalidInput(f"start must be a multiple of the block size {self.memory.block_size} "
                               f"below num_tokens={num_tokens}, got {start}", param="start")
        reserved = self.loop.reserve_kv(num_tokens - start, wait=wait_s > 0, undo=_release_reserved)
        asked = time.monotonic()
        try:
            if wait_s > 0:
                with KV_RESERVATIONS_WAITING.track_inprogress():
                    blocks = await asyncio.wait_for(reserved, wait_s)
            else:
                blocks = await reserved
        except TimeoutError:
            KV_RESERVATIONS.labels("no_room").inc()
            KV_RESERVE_WAIT_SECONDS.inc(wait_s)
            raise KvCapacityError(f"no room for {num_tokens - start} tokens of KV within {wait_s:g} s") from None
        except KvCapacityError:
            KV_RESERVATIONS.labels("no_room").inc()
            raise
        KV_RESERVATIONS.labels("reserved").inc()
        if wait_s > 0:
            KV_RESERVE_WAIT_SECONDS.inc(time.monotonic() - asked)
        if transfer_id in self._reservations:  # a retry of the same transfer got there while this one waited
            await self.loop.call(lambda engine: engine.release_reserved(blocks))
            return self._reservations[transfer_id].block_ids
        self._reservations[transfer_id] = _Reservation(request_id, blocks, num_tokens, time.monotonic(), start)
        self.tracker.expect(transfer_id, request_id, num_tokens - start, blocks, token_start=start)
        if self.transport is not None:
            # The sender starts pushing as soon as it computes: have the transport watch for it.
            self.transport.expect_incoming(transfer_id, self.reservation_ttl_s + self.transfer_timeout_s)
        return blocks

    async def acquire_prefix(self, transfer_id: str, num_tokens: int) -> KvInBlocks | None:
        """Wait for an incoming transfer; its KV when complete and intact, else None (recompute)."""
        reservation = self._reservations.get(transfer_id)
        if reservation is None:
            KV_OUTCOMES.labels("no_reservation").inc()
            return None
        ok = await self.tracker.wait(transfer_id, self.transfer_timeout_s)
        if self._reservations.pop(transfer_id, None) is None:
            # Cancelled or reaped while this stage waited: its blocks are released already.
            KV_OUTCOMES.labels("cancelled").inc()
            return None
        corrupt = self.tracker.failed(transfer_id)  # before forget(), which drops what it knew
        self.tracker.forget(transfer_id)
        if self.transport is not None:
            self.transport.incoming_done(transfer_id)
        if ok and reservation.num_tokens >= num_tokens:
            KV_OUTCOMES.labels("used").inc()
            KV_INCOMING_TOKENS.labels("pushed").inc(num_tokens - reservation.start)
            return KvInBlocks(tuple(reservation.block_ids), num_tokens, reservation.start)
        outcome = "failed" if corrupt else "timeout"
        log.warning("incoming KV %s unusable (%s); recomputing from tokens", transfer_id, outcome)
        KV_OUTCOMES.labels("recomputed").inc()
        KV_UNUSABLE.labels(outcome).inc()
        await self.loop.call(lambda engine: engine.release_reserved(reservation.block_ids))
        return None

    async def pull_prefix(self, request_id: str, source_worker: str, source_blocks: list[int],
                          num_tokens: int, transfer_id: str, token_ids: list[int] | None = None) -> KvInBlocks | None:
        """Lazy pull (AMPD §6): read [0, num_tokens) of KV from the source's blocks now; None → recompute.

        With the stage's `token_ids`, the whole blocks this worker's own prefix cache holds
        are not pulled: they are held (released with the request's leases, once the stage is
        added) and only the rest comes over (`KvInBlocks.start`).
        """
        bs = self.memory.block_size
        needed = -(-num_tokens // bs)
        if len(source_blocks) < needed:
            KV_OUTCOMES.labels("recomputed").inc()
            return None
        local = 0
        if token_ids is not None and num_tokens % bs == 0:
            held = await self.loop.call(lambda engine: engine.hold_cached_prefix(token_ids, num_tokens),
                                        undo=_release_lease)
            if held:
                self._leases.append(_Lease(request_id, held, time.monotonic()))
                local = len(held) * bs
                HISTORY_CACHED_TOKENS.inc(local)
            if local >= num_tokens:  # all of it is here: the stage hits its own prefix cache
                KV_OUTCOMES.labels("cached").inc()
                return None
        try:
            blocks = await self.loop.call(lambda engine: engine.reserve_kv(num_tokens - local), undo=_release_reserved)
        except KvCapacityError:
            KV_OUTCOMES.labels("recomputed").inc()
            return None
        transfer = BlockTransfer(transfer_id, source_worker, self.worker_id, tuple(source_blocks[local // bs:needed]),
                                 tuple(blocks), local, num_tokens, request_id=request_id)
        try:
            await self.transport.pull(transfer, self.transfer_timeout_s)
        except Exception as err:  # KvTransferError, or the peer is gone
            log.warning("lazy pull of %s from %s failed (%s); recomputing from tokens", transfer_id, source_worker, err)
            KV_OUTCOMES.labels("recomputed").inc()
            await self.loop.call(lambda engine: engine.release_reserved(blocks))
            return None
        except BaseException:  # cancelled mid-pull (the stage's caller left): nobody owns them
            self.loop.call(lambda engine: engine.release_reserved(blocks))
            raise
        KV_OUTCOMES.labels("pulled").inc()
        KV_INCOMING_TOKENS.labels("pulled").inc(num_tokens - local)
        return KvInBlocks(tuple(blocks), num_tokens, local)

    # ---- lending a session's history -------------------------------------------------------
    async def lease_session(self, request_id: str, session_id: str, max_tokens: int) -> tuple[list[int], int]:
        """Hold a pinned session history's whole blocks (up to max_tokens) for `request_id`'s lazy
        pull; (block ids, tokens they hold), ([], 0) when nothing is pinned here."""
        self.reap_expired()
        blocks = await self.loop.call(lambda engine: engine.lease_session_kv(session_id, max_tokens),
                                      undo=_release_lease)
        if blocks:
            self._leases.append(_Lease(request_id, blocks, time.monotonic()))
            HISTORY_LEASES.inc()
        return blocks, len(blocks) * self.memory.block_size

    async def release_leases(self, request_id: str) -> int:
        """The request's reader is done with its history (its next stage is here, or it ended)."""
        mine = [lease for lease in self._leases if lease.request_id == request_id]
        if mine:
            self._leases = [lease for lease in self._leases if lease.request_id != request_id]
            await self._return_leases(mine)
        return len(mine)

    async def _return_leases(self, leases: list[_Lease]) -> None:
        blocks = [b for lease in leases for b in lease.block_ids]
        await self.loop.call(lambda engine: engine.release_lease(blocks))

    async def release_for_request(self, request_id: str) -> int:
        """Free every reservation and history lease of a cancelled request."""
        doomed = [tid for tid, r in self._reservations.items() if r.request_id == request_id]
        for tid in doomed:
            await self._drop_reservation(tid)
        return len(doomed) + await self.release_leases(request_id)

    def reap_expired(self) -> None:
        """Free reservations and leases nobody claimed in time (the coordinator died or gave up)."""
        now = time.monotonic()
        for tid, r in list(self._reservations.items()):
            if now - r.created > self.reservation_ttl_s:
                asyncio.ensure_future(self._drop_reservation(tid))
        stale = [lease for lease in self._leases if now - lease.created > self.reservation_ttl_s]
        if stale:
            self._leases = [lease for lease in self._leases if now - lease.created <= self.reservation_ttl_s]
            asyncio.ensure_future(self._return_leases(stale))

    async def _drop_reservation(self, transfer_id: str) -> None:
        reservation = self._reservations.pop(transfer_id, None)
        if reservation is not None:
            self.tracker.forget(transfer_id)
            if self.transport is not None:
                self.transport.incoming_done(transfer_id)
            await self.loop.call(lambda engine: engine.release_reserved(reservation.block_ids))

    # ---- sending ---------------------------------------------------------------------
    def start_push(self, key: StageKey, sink: KvSink, stop_at: int) -> None:
        """Push this stage's KV [sink.start, stop_at) to the sink's blocks chunk by chunk as the
        engine computes it."""
        plan = KvPushPlan(whole_block_chunk(sink.chunk_tokens, self.memory.block_size), stop_at,
                          pushed_upto=sink.start)
        push = _OutgoingPush(key, sink, plan)
        push.task = asyncio.create_task(self._pusher(push))
        self._pushes[key] = push
        self.loop.watch(key, lambda computed, table: self._on_progress(push, computed, table))
        if self.layer_push and getattr(self.transport, "supports_layer_push", False):
            loop = asyncio.get_running_loop()
            self.loop.watch_layers(key, stop_at, lambda layer, table: loop.call_soon_threadsafe(
                self._on_layer, push, layer, table))

    def _on_layer(self, push: _OutgoingPush, layer: int, block_table: list[int]) -> None:
        # Inside the stage's last step, layer `layer` wrote its KV: push that layer's slice of
        # everything not pushed yet (the earlier steps' reports came first, on this loop). The
        # receiver counts those tokens once every layer's slice is in (LayerAssembler).
        if push.layer_range is None:
            rest = push.plan.rest()
            if rest is None:
                return
            push.layer_range = rest
        if layer == self.memory.num_layers - 1 and self.fault_injection == "truncate":
            return  # testing: the last layer's slice never arrives, so the chunk never completes
        start, end = push.layer_range
        push.queue.put_nowait((start, end, block_table, layer))

    def _on_progress(self, push: _OutgoingPush, computed: int, block_table: list[int]) -> None:
        # The step that reached stop_at wrote the stage's last KV: the plan releases the rest
        # now, from the step's own report, rather than after the stage-end event and another
        # round trip to the engine thread (finish_push) — that wait was exposed transfer time.
        if computed >= push.plan.stop_at and push.computed_at is None:
            push.computed_at = time.perf_counter()
        for start, end in push.plan.ready(computed):
            if end == push.plan.stop_at and self.fault_injection == "truncate":
                continue  # testing: the last chunk never arrives
            push.queue.put_nowait((start, end, block_table))

    async def finish_push(self, key: StageKey, completed: bool) -> bool:
        """After the stage ended: push the rest, wait for every chunk, free the KV. True if all went."""
        push = self._pushes.pop(key, None)
        if push is None:
            return False
        self.loop.unwatch(key)
        try:
            if completed and not push.plan.complete and not push.failed and self.fault_injection != "truncate":
                table, computed = await self.loop.call(lambda engine: engine.kv_blocks(key))
                rest = push.plan.rest()
                if rest is not None:  # else a step report queued the last chunk while we waited
                    push.queue.put_nowait((rest[0], rest[1], table))
            push.queue.put_nowait(None)
            # Exposed time runs from the end of the stage's computation: the step report, if
            # it came (it queued the last chunk), else now.
            ended = push.computed_at or time.perf_counter()
            log.debug("stage %s ended; %d chunk(s) still queued", key, push.queue.qsize() - 1)
            # Shielded: a caller that leaves must not cut a transfer that reads these blocks.
            await asyncio.shield(push.task)
        except BaseException:
            # The caller left (its coordinator died), or the pusher failed outside a transfer.
            # Nobody waits for the rest: chunks not sent yet are skipped; the one in flight ends
            # within its transport timeout, and then the blocks go back (found by the
            # control-plane restart test: 3 blocks held for good).
            push.failed = True
            push.queue.put_nowait(None)
            if push.task.done():
                self._release(key)
            else:
                push.task.add_done_callback(lambda _: self._release(key))
            raise
        if completed and not push.failed:
            KV_EXPOSED_SECONDS.observe(time.perf_counter() - ended)
        await self._release(key)
        return not push.failed

    def _release(self, key: StageKey) -> asyncio.Future:
        """Free a finished stage's KV (the push that read it is over); nobody need await it."""
        return self.loop.call(lambda engine: engine.release(key))

    async def _notify_failure(self, transfer: BlockTransfer, error: str) -> None:
        delivered = await self.failure_notice(transfer, error, min(2.0, self.transfer_timeout_s))
        KV_FAILURE_NOTICES.labels("sent" if delivered else "undelivered").inc()

    async def _pusher(self, push: _OutgoingPush) -> None:
        bs = self.memory.block_size
        while True:
            item = await push.queue.get()
            if item is None:
                return
            if push.failed:
                continue  # the receiver will time out and recompute; don't waste bandwidth
            start, end, table, *layer = item
            layer = layer[0] if layer else None  # a per-layer slice (last step), or whole blocks
            first, last = start // bs, -(-end // bs)
            sink = push.sink
            offset = sink.start // bs  # the sink's blocks begin at its start
            src, dst = table[first:last], sink.block_ids[first - offset:last - offset]
            transfer = BlockTransfer(sink.transfer_id, self.worker_id, sink.worker_id, tuple(src), tuple(dst),
                                     start, end, request_id=push.key.request_id, layer=layer)
            checksum = None  # the transport checksums what it sends, off the event loop
            if self.fault_injection == "corrupt" and not getattr(self.transport, "corrupt_writes", False):
                # Testing, on a transport that cannot alter the bytes it moves (the emulated
                # one): a forged digest instead. gRPC and NIXL alter the bytes themselves.
                digest = await asyncio.to_thread(self.memory.checksum, src) if layer is None else \
                    self.memory.checksum(src, layer)
                checksum = digest ^ 0xFFFFFFFF
            started = time.perf_counter()
            try:
                if self.fault_injection == "fail":  # testing: a push that fails at the sender
                    raise KvTransferError(f"injected failure of the push of {sink.transfer_id}")
                await self.transport.push(transfer, checksum, self.transfer_timeout_s)
            except (KvTransferError, Exception) as err:
                push.failed = True
                log.warning("pushing KV [%d, %d) of %s to %s failed: %s", start, end, sink.transfer_id,
                            sink.worker_id, err)
                if self.failure_notice is not None:  # the receiver recomputes now, not at its timeout
                    # In the background: a dead receiver must not hold up this stage's end.
                    notice = asyncio.ensure_future(self._notify_failure(transfer, str(err)))
                    self._notices.add(notice)
                    notice.add_done_callback(self._notices.discard)
                continue
            KV_PUSH_SECONDS.observe(time.perf_counter() - started)
            log.debug("pushed KV [%d, %d) of %s in %.1f ms", start, end, sink.transfer_id,
                      (time.perf_counter() - started) * 1e3)
            KV_BYTES.inc(len(src) * (self.memory.block_bytes if layer is None else self.memory.layer_bytes))
            if layer is not None:
                KV_LAYER_SLICES.inc()


__all__ = ["KvStageManager", "KvCapacityError"]


# What a cancelled caller's engine call took, given back (EngineLoop.call's `undo`).
def _release_reserved(engine, blocks: list[int]) -> None:
    engine.release_reserved(blocks)


def _release_lease(engine, blocks: list[int]) -> None:
    if blocks:
        engine.release_lease(blocks)
