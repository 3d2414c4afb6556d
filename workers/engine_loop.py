"""Runs an engine on its own thread and bridges it to asyncio.

The engine is single-threaded by design (the nano-vLLM loop); gRPC handlers live on the
event loop. Commands go to the engine thread through a queue; each step's token events
come back to the loop in one `call_soon_threadsafe`, routed to per-request queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from splitserve.core import KvCapacityError, KvInBlocks, StageKey, StageKeyTaken, StageSpec, TokenEvent
from splitserve.core.session_pins import SessionPinStats
from splitserve.core.records import PrefillTask, WorkerLoad
from workers.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class EngineSnapshot:
    """Load figures read off the engine thread after each step."""

    load: WorkerLoad
    prefill_queue: list[PrefillTask] = field(default_factory=list)
    taken_at: float = 0.0
    sessions: SessionPinStats = SessionPinStats()


@dataclass
class _Add:
    spec: StageSpec
    accepted: asyncio.Future
    events: asyncio.Queue


class StageBusy(StageKeyTaken):
    """An earlier attempt of this stage still holds its key after the wait: retriable (the
    caller places it again, elsewhere), unlike the engine's InvalidInput (bad input)."""


class EngineLoop:
    """Owns the engine thread; every method is called from the asyncio loop."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, idle_wait_s: float = 0.05,
                 thread_init: Callable[[], None] | None = None):
        self.engine = engine
        # Runs first on the engine thread: per-thread runtime settings (torch's OpenMP thread
        # count is per thread, so setting it where the engine was built does not reach here).
        self.thread_init = thread_init
        self.loop = loop
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[StageKey, asyncio.Queue] = {}
        self._closed: dict[StageKey, asyncio.Event] = {}  # set when the stream of a key closes
        self._adding = 0  # stages sent to the engine thread and not yet taken (or refused)
        # stage -> callback(num_computed_tokens, block_table), called after steps that advance it
        self._watchers: dict[StageKey, Callable[[int, list[int]], None]] = {}
        self._watched_progress: dict[StageKey, int] = {}
        # KV reservations waiting for room, first come first served (engine thread only):
        # (num_tokens, future, undo), granted as steps and releases free blocks.
        self._reservation_line: deque[tuple[int, asyncio.Future, Callable[[Engine, Any], Any] | None]] = deque()
        self.snapshot = self._take_snapshot()
        self.steps = 0
        self.busy_s = 0.0  # seconds spent in steps that ran tokens (the worker's busy_fraction)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._adding

    def stage_keys(self) -> list[StageKey]:
        """Stages whose streams are open."""
        return list(self._streams)

    async def add(self, spec: StageSpec, superseded_wait_s: float = 3.0) -> asyncio.Queue:
        """Queue a stage; raises the engine's InvalidInput for bad input, StageBusy while an
        earlier attempt holds the key. Returns its event queue.

        The stream opens when the engine thread has taken the stage (`_accepted`), so no event
        of an earlier stage under the same key can reach it. A stage whose key is still
        taken is a retry that overtook the end of its previous attempt (a client's retry
        after its gateway or coordinator died: the cancellation of the old attempt travels
        through the coordinator and may arrive after the new one; or the old stage still
        holds its KV while it is being aborted or pushed): it waits up to
        `superseded_wait_s` for the key to be free rather than being refused as a duplicate.

        KV the stage brings in reserved blocks (`KvInBlocks`) is the engine's once the stage
        is taken; whenever it is not (refused, busy, or the caller cancelled while waiting),
        those blocks are released here: no path leaves them reserved for nobody."""
        give_up = time.monotonic() + superseded_wait_s
        self._adding += 1
        in_engine_hands = False  # an _Add sent whose answer has not come back: _accepted decides
        try:
            while True:
                if spec.key in self._streams:  # the previous attempt's stream is still open
                    closed = self._closed.setdefault(spec.key, asyncio.Event())
                    try:
                        await asyncio.wait_for(closed.wait(), max(0.0, give_up - time.monotonic()))
                    except asyncio.TimeoutError:
                        raise StageBusy(f"request_id {spec.key.request_id!r} (stage {spec.key.stage_index}) "
                                        "is already in the engine") from None
                    continue
                events: asyncio.Queue = asyncio.Queue()
                accepted = self.loop.create_future()
                self._send(_Add(spec, accepted, events))
                in_engine_hands = True
                try:
                    await accepted
                    return events
                except ValueError as err:  # refused: the blocks are still only reserved
                    in_engine_hands = False
                    if not isinstance(err, StageKeyTaken):
                        raise
                    if time.monotonic() >= give_up:
                        raise StageBusy(str(err)) from None
                await asyncio.sleep(0.05)  # a bounded retry of the add, not synchronisation
        except BaseException:
            if not in_engine_hands:
                self._release_reserved_kv(spec)
            raise
        finally:
            self._adding -= 1

    def release_reserved(self, block_ids) -> None:
        """Give reserved KV blocks back; sent to the engine thread now, nobody need await it."""
        blocks = list(block_ids)
        self.call(lambda engine: engine.release_reserved(blocks))

    def _release_reserved_kv(self, spec: StageSpec) -> None:
        if isinstance(spec.kv, KvInBlocks) and spec.kv.block_ids:
            self.release_reserved(spec.kv.block_ids)

    def _accepted(self, command: "_Add", error: BaseException | None) -> None:
        """On the event loop, in order with the step events: open the stage's stream."""
        if command.accepted.done():  # the caller went away while the engine took the stage
            if error is None:
                self._send(("abort", command.spec.key))  # the stage frees its blocks
            else:
                self._release_reserved_kv(command.spec)  # refused: they are still only reserved
            return
        if error is not None:
            command.accepted.set_exception(error)
            return
        if command.spec.key in self._streams:  # cannot happen: one attempt per key at a time
            self._send(("abort", command.spec.key))
            command.accepted.set_exception(StageKeyTaken(
                f"request_id {command.spec.key.request_id!r} (stage {command.spec.key.stage_index}) "
                "is already in the engine"))
            return
        self._streams[command.spec.key] = command.events
        command.accepted.set_result(None)

    def abort(self, key: StageKey) -> bool:
        """Abort at the next step boundary; the blocks are freed then."""
        known = self._close_stream(key)
        self._send(("abort", key))
        return known

    def _close_stream(self, key: StageKey) -> bool:
        """Forget a stage's stream; wake an attempt of the same stage waiting for it (`add`)."""
        known = self._streams.pop(key, None) is not None
        waiter = self._closed.pop(key, None)
        if waiter is not None:
            waiter.set()
        return known

    def watch(self, key: StageKey, callback: Callable[[int, list[int]], None]) -> None:
        """Report a stage's KV progress after every step that advances it (chunked push)."""
        self._watchers[key] = callback

    def unwatch(self, key: StageKey) -> None:
        self._watchers.pop(key, None)
        watchers = getattr(self.engine, "layer_watchers", None)
        if watchers is not None:
            watchers.pop(key, None)

    def watch_layers(self, key: StageKey, stop_at: int, callback: Callable[[int, list[int]], None]) -> bool:
        """Call `callback(layer, block_table)` on the engine thread as each layer writes its KV in the
        step that completes the stage's KV [0, stop_at) (per-layer push); False if the engine can't."""
        watchers = getattr(self.engine, "layer_watchers", None)
        if watchers is None:
            return False
        watchers[key] = (stop_at, callback)  # one dict store: safe beside the engine thread's reads
        return True

    def call(self, fn: Callable[[Engine], Any],
             undo: Callable[[Engine, Any], Any] | None = None) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread between steps; resolves with its result.

        `undo(engine, result)` runs on the engine thread when nobody is left to take the
        result (its awaiting caller was cancelled, e.g. its gRPC call ended with the
        coordinator that made it): a reservation or a lease `fn` took would otherwise leak."""
        fut = self.loop.create_future()
        self._send(("call", fn, fut, undo))
        return fut

    def reserve_kv(self, num_tokens: int, wait: bool,
                   undo: Callable[[Engine, Any], Any] | None = None) -> asyncio.Future:
        """Reserve blocks for `num_tokens` of KV another worker will write. No room: fails with
        KvCapacityError, or with `wait` joins the line of reservations waiting for room and
        resolves when blocks free (the caller bounds the wait by cancelling; `undo` then frees
        what a late grant took). Nobody overtakes the line: with anyone waiting, a reservation
        that does not wait fails; and stages already in the engine that the last step left
        short of blocks come before both (`Scheduler.kv_short`)."""
        fut = self.loop.create_future()
        self._send(("reserve", num_tokens, fut, undo, wait))
        return fut

    # ---- engine thread ------------------------------------------------------------
    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        if self.thread_init is not None:
            self.thread_init()
        while not self._stopping:
            self._apply_commands()
            if self._reservation_line:
                self._grant_reservations()
            if engine.has_unfinished():
                started = time.perf_counter()
                try:
                    events = engine.step()
                except Exception:  # a failed step must not kill the worker silently
                    log.exception("engine step failed; aborting its requests")
                    events = engine.abort_all()
                self.steps += 1
                if engine.last_step_tokens:  # a step that ran nothing is idling, not work
                    self.busy_s += time.perf_counter() - started
                self.snapshot = self._take_snapshot()
                if self._watchers:
                    self._report_progress()
                if events:
                    self.loop.call_soon_threadsafe(self._deliver, events)
                if not engine.last_step_tokens:  # nothing fits (KV held elsewhere) or held back: don't spin
                    self._wake.wait(self._idle_wait(engine.last_output.hold_until))
                    self._wake.clear()
            else:
                self.snapshot = self._take_snapshot()
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                try:
                    self.engine.add_stage(command.spec)
                    self.loop.call_soon_threadsafe(self._accepted, command, None)
                except Exception as err:  # ValueError for bad input; anything else is reported too
                    self.loop.call_soon_threadsafe(self._accepted, command, err)
            elif command[0] == "abort":
                self.engine.abort(command[1])
                self._watched_progress.pop(command[1], None)
            elif command[0] == "call":
                _, fn, fut, undo = command
                try:
                    result, error = fn(self.engine), None
                except Exception as err:
                    result, error = None, err
                self.loop.call_soon_threadsafe(self._resolve, fut, result, error, undo)
            elif command[0] == "reserve":
                _, num_tokens, fut, undo, wait = command
                try:
                    if wait and num_tokens <= self.engine.kv_capacity_tokens:
                        self._reservation_line.append((num_tokens, fut, undo))
                        continue  # granted in line below (more than the whole cache never is: fails now)
                    if self._reservation_line:
                        raise KvCapacityError(f"{len(self._reservation_line)} KV reservation(s) are waiting "
                                              "for room first")
                    if self.engine.kv_short:
                        raise KvCapacityError("stages already here are waiting for KV blocks first")
                    result, error = self.engine.reserve_kv(num_tokens), None
                except Exception as err:
                    result, error = None, err
                self.loop.call_soon_threadsafe(self._resolve, fut, result, error, undo)

    def _grant_reservations(self) -> None:
        """Give waiting reservations their blocks, in line, while there is room — after the
        stages already in the engine: none while the last step left one short of blocks."""
        line = self._reservation_line
        while line and not self.engine.kv_short:
            num_tokens, fut, undo = line[0]
            if fut.done():  # its caller stopped waiting (a read of a flag set on the event loop)
                line.popleft()
                continue
            try:
                result, error = self.engine.reserve_kv(num_tokens), None
            except KvCapacityError:
                return  # not yet: the head waits, and nobody overtakes it
            except Exception as err:
                result, error = None, err
            line.popleft()
            self.loop.call_soon_threadsafe(self._resolve, fut, result, error, undo)

    def _resolve(self, fut: asyncio.Future, result, error, undo) -> None:
        """On the event loop: hand a call's result to its caller, or undo it if the caller left."""
        if fut.done():  # cancelled: nobody will own what fn took
            if error is None and undo is not None:
                self.call(lambda engine: undo(engine, result))
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def _idle_wait(self, hold_until: float | None) -> float:
        """How long to sleep when a step ran nothing: until the policy's hold ends, at most idle_wait_s."""
        if hold_until is None:
            return self.idle_wait_s
        return min(self.idle_wait_s, max(0.0, hold_until - self.engine.clock()))

    def _report_progress(self) -> None:
        for key, callback in list(self._watchers.items()):
            progress = self.engine.progress(key)
            if progress is None or self._watched_progress.get(key) == progress[0]:
                continue
            computed, table = progress
            self._watched_progress[key] = computed
            self.loop.call_soon_threadsafe(callback, computed, list(table))

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(self.engine.load(), self.engine.prefill_queue(), time.time(),
                              self.engine.session_stats())

    # ---- event loop side ---------------------------------------------------------
    def _deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            stream = self._streams.get(ev.key)
            if stream is None:
                continue  # aborted by the caller meanwhile
            stream.put_nowait(ev)
            if ev.finished:
                self._close_stream(ev.key)
