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
from dataclasses import dataclass, field
from typing import Any, Callable

from workers.engine.engine import Engine, EngineStats, TokenEvent
from workers.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineSnapshot:
    """Load figures read off the engine thread after each step."""

    stats: EngineStats
    # (request_id, tokens already with KV, tokens left to prefill, enqueue time) per prefilling request
    prefill_queue: list[tuple[str, int, int, float]] = field(default_factory=list)
    taken_at: float = 0.0


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int]
    keep_kv: bool
    accepted: asyncio.Future
    events: asyncio.Queue
    stop_at: int | None = None
    prefix_blocks: list[int] | None = None
    prefix_len: int = 0


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
        self._streams: dict[str, asyncio.Queue] = {}
        # request id -> callback(num_computed_tokens, block_table), called after steps that advance it
        self._watchers: dict[str, Callable[[int, list[int]], None]] = {}
        self._watched_progress: dict[str, int] = {}
        self.snapshot = self._take_snapshot()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def request_ids(self) -> list[str]:
        return list(self._streams)

    async def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        output_ids: list[int] | None = None, keep_kv: bool = False, *,
        stop_at: int | None = None, prefix_blocks: list[int] | None = None, prefix_len: int = 0,
    ) -> asyncio.Queue:
        """Queue a request; raises the engine's ValueError for bad input. Returns its event queue."""
        events: asyncio.Queue = asyncio.Queue()
        accepted = self.loop.create_future()
        self._streams[request_id] = events
        self._send(_Add(request_id, prompt_ids, params, list(output_ids or []), keep_kv, accepted, events,
                        stop_at, prefix_blocks, prefix_len))
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return events

    def abort(self, request_id: str) -> bool:
        """Abort at the next step boundary; the blocks are freed then."""
        known = self._streams.pop(request_id, None) is not None
        self._send(("abort", request_id))
        return known

    def watch(self, request_id: str, callback: Callable[[int, list[int]], None]) -> None:
        """Report a request's KV progress after every step that advances it (chunked push)."""
        self._watchers[request_id] = callback

    def unwatch(self, request_id: str) -> None:
        self._watchers.pop(request_id, None)

    def call(self, fn: Callable[[Engine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread between steps; resolves with its result."""
        fut = self.loop.create_future()
        self._send(("call", fn, fut))
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
            if engine.has_unfinished():
                try:
                    events = engine.step()
                except Exception:  # a failed step must not kill the worker silently
                    log.exception("engine step failed; aborting its requests")
                    events = self._abort_all_running()
                self.steps += 1
                self.snapshot = self._take_snapshot()
                if self._watchers:
                    self._report_progress()
                if events:
                    self.loop.call_soon_threadsafe(self._deliver, events)
                if not engine.last_step_tokens:  # nothing fits (KV held elsewhere): don't spin
                    self._wake.wait(self.idle_wait_s)
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
                    self.engine.add_request(
                        command.request_id, command.prompt_ids, command.params,
                        output_token_ids=command.output_ids, keep_kv=command.keep_kv, stop_at=command.stop_at,
                        prefix_blocks=command.prefix_blocks, prefix_len=command.prefix_len,
                    )
                    self.loop.call_soon_threadsafe(_resolve, command.accepted, None, None)
                except Exception as err:  # ValueError for bad input; anything else is reported too
                    self.loop.call_soon_threadsafe(_resolve, command.accepted, None, err)
            elif command[0] == "abort":
                self.engine.abort(command[1])
                self._watched_progress.pop(command[1], None)
            elif command[0] == "call":
                _, fn, fut = command
                try:
                    result, error = fn(self.engine), None
                except Exception as err:
                    result, error = None, err
                self.loop.call_soon_threadsafe(_resolve, fut, result, error)

    def _report_progress(self) -> None:
        sequences = self.engine.scheduler.sequences
        for request_id, callback in list(self._watchers.items()):
            seq = sequences.get(request_id)
            if seq is None or self._watched_progress.get(request_id) == seq.num_computed_tokens:
                continue
            self._watched_progress[request_id] = seq.num_computed_tokens
            self.loop.call_soon_threadsafe(callback, seq.num_computed_tokens, list(seq.block_table))

    def _abort_all_running(self) -> list[TokenEvent]:
        events = []
        for seq in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort(seq.request_id)
            events.append(TokenEvent(seq.request_id, [], "", "abort", seq.prompt_len, seq.num_output_tokens))
        return events

    def _take_snapshot(self) -> EngineSnapshot:
        sched = self.engine.scheduler
        prefilling = [s for s in sched.running if s.in_prefill] + list(sched.waiting)
        queue_meta = [(s.request_id, s.num_computed_tokens, s.num_uncomputed_tokens, s.arrival_time) for s in prefilling]
        return EngineSnapshot(self.engine.stats(), queue_meta, time.time())

    # ---- event loop side ---------------------------------------------------------
    def _deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue  # aborted by the caller meanwhile
            stream.put_nowait(ev)
            if ev.finished:
                del self._streams[ev.request_id]


def _resolve(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
