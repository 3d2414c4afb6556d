"""One simulation run: a heap of virtual-time events driving sends, placement, stages and KV handoffs.

Mirrors the real request path: the load generator's send (open loop, closed loop,
max_concurrency, sessions with tool delays, a duration limit that cuts requests off),
`GlobalScheduler.Place` (the real policy over a stale `ClusterView`), the
coordinator's stage loop (reserve the next stage's KV before running a stage, run
stages in order, cancel what a finished request no longer needs) and each worker's
engine loop (`SimWorker`). Results are `loadgen.metrics.RequestResult`s, as `bench` records.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from loadgen.metrics import RequestResult
from loadgen.runner import CUT_OFF
from loadgen.sessions import Session
from services.global_scheduler.policy import (CompletionReport, NoWorkerAvailable, PlacementRequest,
                                              learns_from_completions, make_policy, orient_kv_transfers)
from services.planner.sim_config import SimulatorConfig, worker_id
from services.planner.sim_view import SimClusterView
from services.planner.sim_worker import SimWorker, StageRun
from services.planner.sim_workload import PromptIds, SimItem
from splitserve.core import FinishReason, StageKey, StageSlo
from splitserve.core.sequence import SessionHold

__all__ = ["SimRun", "SimStats", "STALLED", "VirtualClock", "gc_paused"]

STALLED = "simulation stalled: no event left that could finish the request"
# Event kinds; ties in time run in push order.
_SEND, _SEND_WITH_SLOT, _STAGE_START, _STEP_DONE, _KV_DONE, _WAKE, _CONTROL, _KV_WAIT_OVER = range(8)
# The services' defaults: the workers' TTFT/ITL window (`--latency-window-s`) and a session's
# idle TTL (`--session-ttl-s`).
LATENCY_WINDOW_S = 10.0
SESSION_TTL_S = 600.0


@dataclass
class SimStats:
    """What a run cost and did: wall time, events, engine steps, KV transfers, preemptions."""

    wall_s: float = 0.0
    virtual_s: float = 0.0
    events: int = 0
    steps: int = 0
    kv_transfers: int = 0
    kv_recomputes: int = 0
    kv_reserve_waits: int = 0  # stages sent only once the next worker had room for their KV
    kv_reserve_wait_s: float = 0.0  # their summed wait
    kv_pulls: int = 0  # session histories read by a remote incremental prefill (AMPD)
    kv_pulled_tokens: int = 0
    history_cached_tokens: int = 0  # of those histories, found in the prefill worker's own cache
    # Where session rounds after the first ran their prefill: on the worker that decodes
    # them (local) or on another one (remote): AMPD's routing share.
    incremental_prefills_local: int = 0
    incremental_prefills_remote: int = 0
    preemptions: int = 0
    view_refreshes: int = 0
    worker_busy_fraction: float = 0.0
    # LAPS' pool controller (Alg. 2), when the placement policy runs one: instances moved
    # between the short and long prefill pools, and every control period's pool pressures
    # and sizes ([t, P_s, P_l, n_s, n_l], for the plot of its moves over time).
    pool_moves: int = 0
    pool_timeline: list[list[float]] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _Item:
    """Progress of one workload item: a request, or a session's rounds."""

    item: SimItem
    history: list[int] | None = None  # a session's prompt and outputs so far, until its next round


@dataclass(eq=False, slots=True)
class _Request:
    """One request (or session round) in flight: its prompt, stages and token times."""

    request_id: str
    session_id: str | None
    round_index: int
    item: _Item
    prompt_ids: list[int]  # becomes the first stage's sequence, which appends its outputs
    max_tokens: int
    sent_at: float
    prompt_len: int = 0
    token_times: array = field(default_factory=lambda: array("d"))
    stages: list[StageRun] = field(default_factory=list)
    done: bool = False
    history_len: int = 0  # tokens of the session's history whose KV `bound_worker` holds
    bound_worker: str = ""  # the session's worker when the round was placed ("" : none)
    lent_blocks: list[int] | None = None  # the history's blocks `bound_worker` lends to the lazy pull

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt_ids)


class VirtualClock:
    """The engine schedulers' injected clock: the simulation's current time (seconds)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off: it would only keep walking the KV blocks (hundreds of
    thousands of objects); a run holds no reference cycles once its requests have ended."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class SimRun:
    """Simulates `items` sent at `offsets` (or by `concurrency` closed-loop clients) on a fresh cluster."""

    def __init__(self, config: SimulatorConfig, items: Sequence[SimItem], offsets: np.ndarray | None, *,
                 max_concurrency: int | None = None, concurrency: int | None = None,
                 duration_limit_s: float | None = None):
        self.config = config
        self.clock = VirtualClock()
        self.policy = make_policy(config.placement_policy, deployment_perf_model=config.perf_model, **config.policy_params)
        self.policy_learns = learns_from_completions(self.policy)  # a Protocol isinstance costs ~25 us
        # A policy that reads windowed TTFT/ITL and prefill queues (AMPD) gets them, as the
        # scheduler reads them from Redis; others do not pay for them.
        with_signals = bool(getattr(self.policy, "view_signals", False))
        self.workers = [
            SimWorker(worker_id(i), config.perf_model_of(i), clock=self.clock, num_kv_blocks=config.kv_blocks_of(i),
                      block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
                      max_num_seqs=config.max_num_seqs, batch_policy=config.batch_policy,
                      batch_policy_options=config.batch_policy_options,
                      enable_prefix_caching=config.enable_prefix_caching, role=role,
                      kv_chunk_tokens=config.kv_chunk_tokens, view_refresh_s=config.view_refresh_s,
                      fast_forward=config.fast_forward,
                      signals_window_s=LATENCY_WINDOW_S if with_signals else None)
            for i, role in enumerate(config.worker_roles)
        ]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.view = SimClusterView(self.workers, config.view_refresh_s, with_signals=with_signals)
        # LAPS' instance-pressure controller: one per cluster, every control period (as the
        # scheduler's leader runs it), moving prefill workers between the short and long pools.
        make_controller = getattr(self.policy, "pool_controller", None)
        self.pool_controller = make_controller() if make_controller is not None else None
        # Open sessions, as Redis holds them (`session:{id}`): the worker holding the
        # history's KV and the history's length (AMPD binding; the coordinator's records).
        self.sessions: dict[str, tuple[str, int]] = {}
        self.latency = config.latency
        self.blocking_receive = config.kv_receive == "blocking"  # (see sim_config.KV_RECEIVE_MODES)
        # Every stage carries the request's objectives, as the coordinator sends them (local
        # policies schedule by them: slo_aware's ITL target).
        self.stage_slo = StageSlo(config.slo_ttft_ms / 1000 or None, config.slo_itl_ms / 1000 or None)
        self.prompts = PromptIds()
        self.items = [_Item(item) for item in items]
        self.offsets = offsets
        self.concurrency = concurrency
        self.free_slots = max_concurrency
        self.limit = duration_limit_s
        self.results: list[RequestResult] = []
        self.stats = SimStats()
        self._heap: list = []
        self._order = itertools.count()
        self._in_flight: dict[str, _Request] = {}
        self._waiting_for_slot: deque[tuple[_Item, int]] = deque()
        # Stages waiting, in line per worker, for that worker to have room for the KV they will
        # push to it (Worker.PrepareKv with a wait): sent when it has, FIFO.
        self._kv_waiters: dict[str, deque[StageRun]] = {}
        self._next_item = 0
        self._closing = False  # cutting off: nothing new is sent

    @property
    def now(self) -> float:
        """The current virtual time (seconds since the first send)."""
        return self.clock.now

    @now.setter
    def now(self, value: float) -> None:
        self.clock.now = value

    # ---- the loop ----------------------------------------------------------------------
    def execute(self) -> list[RequestResult]:
        """Run every event (up to the duration limit); results sorted by (arrival, request id)."""
        started = time.perf_counter()
        if self.concurrency:
            for _ in range(min(self.concurrency, len(self.items))):
                self._next_closed_loop_item()
        else:
            for item, offset in zip(self.items, self.offsets):
                self._push(float(offset), _SEND, (item, 0))
        if self.pool_controller is not None:
            self._push(0.0, _CONTROL, None)
        heap, pop = self._heap, heapq.heappop
        limit = self.limit if self.limit is not None else float("inf")
        events = 0
        cut = False
        with gc_paused():
            while heap:
                t, _, kind, payload, generation = pop(heap)
                if kind == _KV_WAIT_OVER and payload.kv_wait_until != t:
                    continue  # the stage got its reservation in time: not an event (nor the run's end)
                if t > limit:
                    cut = True
                    break
                self.now = t
                events += 1
                if kind == _STEP_DONE:
                    if generation != payload.generation:
                        continue  # the step was cut short: a later event replaced this one
                    for stage in payload.finish_step(t):
                        self._stage_ended(stage)
                    self._kick(payload)
                else:
                    self._dispatch(kind, payload)
        if self._in_flight:
            # Past the duration limit requests are cut off, as bench cuts them; with no event
            # left, what is still in flight can never finish (e.g. KV reservations deadlocked).
            self._closing = True
            if cut:
                self._cut_off(limit, CUT_OFF)
            else:
                self._cut_off(self.now, STALLED)
        self._finish_stats(events, time.perf_counter() - started)
        return sorted(self.results, key=lambda r: (r.arrival_s, r.request_id))

    def _dispatch(self, kind: int, payload: object) -> None:
        if kind == _STAGE_START:
            self._start_stage(payload)
        elif kind == _WAKE:
            self._kick(payload)
        elif kind == _KV_DONE:
            self._kv_done(payload)
        elif kind == _CONTROL:
            self._control()
        elif kind == _KV_WAIT_OVER:
            self._kv_wait_over(payload)
        else:
            self._send(*payload, holds_slot=kind == _SEND_WITH_SLOT)

    def _push(self, t: float, kind: int, payload: object, generation: int = 0) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, payload, generation))

    def _kick(self, worker: SimWorker) -> None:
        """After any change to a worker: start its next step unless one is running (the engine
        loop steps back to back), or reschedule the end of a fast-forwarded run cut short."""
        if worker.worker_id in self._kv_waiters:
            self._grant_kv_waiters(worker)
        if worker.stepping:
            if worker.step_moved:
                worker.step_moved = False
                self._push(worker.step_end, _STEP_DONE, worker, worker.generation)
            return
        end = worker.start_step(self.now)
        if end is not None:
            self._push(end, _STEP_DONE, worker, worker.generation)
        elif worker.hold_until is not None and worker.hold_until > self.now and worker.wake_at != worker.hold_until:
            worker.wake_at = worker.hold_until  # the batch policy holds work back until then: ask it again
            self._push(worker.hold_until, _WAKE, worker)

    def _control(self) -> None:
        """One period of the pool controller: its SetRole calls reach the workers at once; the
        placement policy sees the new pools from the next view refresh, as in the services."""
        controller = self.pool_controller
        decision = controller.step(self.view.current(self.now), self.now)
        for change in decision.changes:
            self.by_id[change.worker_id].pool = change.to_pool
        if decision.move is not None:
            self.stats.pool_moves += 1
        pools = [w.pool for w in self.workers if w.role == "prefill"]
        self.stats.pool_timeline.append([round(self.now, 3), round(decision.short_pressure, 4),
                                         round(decision.long_pressure, 4), pools.count("short"), pools.count("long")])
        if self._heap:  # anything left to happen: keep controlling until the run is over
            self._push(self.now + controller.config.period_s, _CONTROL, None)

    # ---- sends and placement -------------------------------------------------------------
    def _send(self, item: _Item, round_index: int, holds_slot: bool = False) -> None:
        if self.free_slots is not None and not holds_slot:
            if self.free_slots == 0:
                self._waiting_for_slot.append((item, round_index))  # sent when a request ends
                return
            self.free_slots -= 1
        spec = item.item
        if isinstance(spec, Session):
            rnd = spec.rounds[round_index]
            prompt = self.prompts.for_round(item.history or [], rnd.incr_prompt_len)
            request = _Request(f"{spec.session_id}/r{round_index}", spec.session_id, round_index, item, prompt,
                               rnd.output_len, self.now)
        else:
            request = _Request(spec.request_id, None, 0, item, self.prompts.for_request(spec), spec.output_len,
                               self.now)
        item.history = None
        self._in_flight[request.request_id] = request
        bound_worker, history_len = self.sessions.get(request.session_id, ("", 0)) if request.session_id else ("", 0)
        # At least the last prompt token is computed again (its logits give the first token).
        request.history_len = min(history_len, request.prompt_len - 1)
        placement_request = PlacementRequest(
            request_id=request.request_id, prompt_len=request.prompt_len, max_tokens=request.max_tokens,
            session_id=request.session_id or "", history_len=request.history_len, bound_worker=bound_worker,
            slo_ttft_ms=self.config.slo_ttft_ms, slo_itl_ms=self.config.slo_itl_ms,
            predicted_output_len=None if isinstance(spec, Session) else spec.predicted_output_len)
        try:
            view = self.view.current(self.now)
            placement = orient_kv_transfers(self.policy.place(placement_request, view, self.now), view)
        except NoWorkerAvailable as err:
            self._fail(request, f"UNAVAILABLE: {err}")
            return
        self.view.note_placed(placement.worker_ids)
        for index, sp in enumerate(placement.stages):
            request.stages.append(StageRun(StageKey(request.request_id, index), sp.start, sp.end,
                                           self.by_id[sp.worker_id], request.token_times, request, push_kv=sp.push_kv))
        if request.session_id:
            if round_index > 0:
                if len(request.stages) == 1:
                    self.stats.incremental_prefills_local += 1
                else:
                    self.stats.incremental_prefills_remote += 1
            request.bound_worker = bound_worker if bound_worker in self.by_id else ""
            last = request.stages[-1]
            if bound_worker and last.worker.worker_id != bound_worker and bound_worker in self.by_id:
                # The session moves: its old worker's pinned history is of no use any more.
                self.by_id[bound_worker].release_session(request.session_id, self.now)
                self._kick(self.by_id[bound_worker])
                request.history_len, request.bound_worker = 0, ""  # recomputed where it runs now
            elif request.history_len and len(request.stages) > 1:
                # The history stays on the session's worker: the stage before it pushes only the new KV.
                request.stages[-2].push_from = min(request.history_len, request.stages[-2].end)
        self._push(self.now + self.latency.dispatch_s, _STAGE_START, request.stages[0])

    # ---- stages ------------------------------------------------------------------------------
    def _start_stage(self, stage: StageRun) -> None:
        request: _Request | None = stage.owner
        if request is None or request.done:
            return
        worker = stage.worker
        if stage.index == 0 and request.bound_worker and worker.worker_id != request.bound_worker \
                and request.history_len and not stage.history_prepared and len(request.stages) == 2:
            # AMPD's remote incremental prefill, as the coordinator and workers run it: the
            # session's worker lends the history's whole blocks; this worker pulls those its own
            # prefix cache lacks (the lazy pull, §6) over that worker's link before the prefill
            # runs, and pushes back only the KV after the history. No room: recomputed.
            stage.history_prepared = True
            bound = self.by_id[request.bound_worker]
            request.lent_blocks = bound.lease_session(request.session_id, min(request.history_len, stage.end - 1),
                                                      self.now)
            bs = worker.block_manager.block_size
            lent = len(request.lent_blocks) * bs
            stage.push_from = lent  # the session's worker holds [0, lent): only the rest goes back
            if lent:
                stage.held_blocks = worker.hold_cached_prefix(request.prompt_ids, lent, self.now)
                local = len(stage.held_blocks) * bs
                self.stats.history_cached_tokens += local
                blocks = worker.reserve_kv(lent - local, self.now) if local < lent else None
                if blocks is not None:
                    stage.reserved_blocks, stage.pulled_tokens, stage.kv_start = blocks, lent, local
                    self.stats.kv_pulls += 1
                    self.stats.kv_pulled_tokens += lent - local
                    self._push(bound.pull_out(lent - local, self.now), _STAGE_START, stage)
                    return
        if not self._reserve_next(stage):
            return  # sent once the next worker has room (or the wait is over)
        self._run_stage(stage)

    def _reserve_next(self, stage: StageRun) -> bool:
        """The coordinator reserves the next stage's KV before sending this one. No room there:
        the stage waits in line for it (False), up to `kv_reserve_wait_s`; then, or with no
        push up the worker order, the next stage recomputes this range."""
        request: _Request = stage.owner
        following = request.stages[stage.index + 1] if stage.index + 1 < len(request.stages) else None
        if following is None or not stage.push_kv:
            return True
        worker = following.worker
        # Stages already in line go first, and before them the stages already on that worker
        # that its last step left short of blocks (as the worker's engine loop grants them).
        reserved = worker.worker_id not in self._kv_waiters and not worker.scheduler.kv_short and self._reserved(stage)
        if not reserved and self.config.kv_reserve_wait_s > 0:
            stage.kv_wait_until = self.now + self.config.kv_reserve_wait_s
            self._kv_waiters.setdefault(worker.worker_id, deque()).append(stage)
            self._push(stage.kv_wait_until, _KV_WAIT_OVER, stage)
        self._kick(worker)  # (the reservation attempt brought a fast-forwarded run to now)
        return stage.kv_wait_until is None

    def _reserved(self, stage: StageRun) -> bool:
        """Reserve the next stage's blocks for what `stage` pushes; False when there is no room."""
        request: _Request = stage.owner
        following = request.stages[stage.index + 1]
        start = stage.push_from if request.lent_blocks else 0  # what the session's worker lent it has
        blocks = following.worker.reserve_kv(stage.end - start, self.now)
        if blocks is None:
            return False
        following.reserved_blocks, following.kv_start = blocks, start
        return True

    def _grant_kv_waiters(self, worker: SimWorker) -> None:
        """Send the stages waiting for room on `worker`, in line, while it has room."""
        waiters = self._kv_waiters[worker.worker_id]
        while waiters and not worker.scheduler.kv_short:
            stage = waiters[0]
            request: _Request | None = stage.owner
            if request is None or request.done or stage.kv_wait_until is None:
                waiters.popleft()  # ended meanwhile, or its wait is over
                continue
            if not self._reserved(stage):
                break
            waiters.popleft()
            self._waited(stage)
            self._run_stage(stage)
        if not waiters and self._kv_waiters.get(worker.worker_id) is waiters:
            del self._kv_waiters[worker.worker_id]  # (a stage sent above may have sent the rest)

    def _kv_wait_over(self, stage: StageRun) -> None:
        """The wait for room is over: send the stage; the next one recomputes its range."""
        request: _Request | None = stage.owner
        if request is None or request.done or stage.kv_wait_until is None:
            return  # ended, or sent, meanwhile
        self._waited(stage)
        self._run_stage(stage)

    def _waited(self, stage: StageRun) -> None:
        self.stats.kv_reserve_waits += 1
        self.stats.kv_reserve_wait_s += self.now - (stage.kv_wait_until - self.config.kv_reserve_wait_s)
        stage.kv_wait_until = None

    def _run_stage(self, stage: StageRun) -> None:
        request: _Request = stage.owner
        worker = stage.worker
        following = request.stages[stage.index + 1] if stage.index + 1 < len(request.stages) else None
        if stage.index == 0:
            tokens, prefix_len = request.prompt_ids, stage.pulled_tokens
        else:
            previous = request.stages[stage.index - 1]
            tokens = previous.seq.token_ids
            prefix_len = previous.end if stage.reserved_blocks is not None else 0
            if stage.reserved_blocks is None:
                self.stats.kv_recomputes += 1
            elif self.blocking_receive:
                stage.receive_tokens = previous.end - stage.kv_start  # pulled in its first step there
        push_to = following if following is not None and following.reserved_blocks is not None else None
        session = None
        if request.session_id and following is None:  # the round's last stage keeps the history
            session = SessionHold(request.session_id, SESSION_TTL_S,
                                  request.history_len if worker.worker_id == request.bound_worker else 0)
        try:
            worker.add_stage(stage, tokens, request.prompt_len, request.max_tokens, prefix_len, self.now, push_to,
                             self.stage_slo, session)
        except ValueError as err:  # what the worker answers INVALID_ARGUMENT to
            self._fail(request, f"InvalidArgument: {err}")
            return
        if request.lent_blocks is not None and worker.worker_id == request.bound_worker:
            worker.release_lease(request.lent_blocks, self.now)  # the pull is long done
            request.lent_blocks = None
        self._kick(worker)

    def _stage_ended(self, stage: StageRun) -> None:
        if stage.push is not None:
            self.stats.kv_transfers += 1
            if self.blocking_receive and stage.finish_reason is FinishReason.STAGE_END:
                # Handed over now; the next worker pulls the KV in its own step (`_run_stage`).
                self._deliver_pending_token(stage)
                self._start_next(stage)
            self._push(stage.push_done_at, _KV_DONE, stage)  # the worker reports the end after its push
        elif stage.finish_reason is FinishReason.STAGE_END:
            self._start_next(stage)
        else:
            self._complete(stage.owner)

    def _start_next(self, stage: StageRun) -> None:
        """The coordinator sends the request's next stage once it hears of this one's end."""
        self._push(self.now + self.latency.handoff_s, _STAGE_START, stage.owner.stages[stage.index + 1])

    def _deliver_pending_token(self, stage: StageRun) -> None:
        """The token the stage's last step sampled, held back while its KV was pushed."""
        if stage.last_token_pending:
            stage.token_times.append(self.now)
            stage.last_token_pending = False

    def _kv_done(self, stage: StageRun) -> None:
        if stage.owner is None:
            return  # the request ended meanwhile: its stages were aborted
        worker = stage.worker
        worker.release(stage, self.now)
        self._kick(worker)  # freed blocks may admit waiting work
        self._deliver_pending_token(stage)
        if stage.finish_reason is not FinishReason.STAGE_END:
            self._complete(stage.owner)
        elif not self.blocking_receive:  # (a blocking receive's next stage started at the stage's end)
            self._start_next(stage)

    # ---- endings -----------------------------------------------------------------------------
    def _complete(self, request: _Request) -> None:
        stream = self.latency.stream_s
        times = (np.frombuffer(request.token_times, dtype=np.float64) + stream).tolist()
        # The last stage that ran holds the whole sequence: prompt + output, the next round's history.
        history = next(s for s in reversed(request.stages) if s.seq is not None).seq.token_ids
        worker_ids = tuple(s.worker.worker_id for s in request.stages)
        self._end(request, RequestResult(
            request.request_id, request.session_id, request.round_index, request.sent_at, times[0], times,
            times[-1], request.prompt_len, len(times), True))
        if self.policy_learns:
            self.policy.on_completion(CompletionReport(
                request.request_id, "length", session_id=request.session_id or "",
                prompt_tokens=request.prompt_len, output_tokens=len(times),
                ttft_ms=(times[0] - request.sent_at) * 1000,
                mean_itl_ms=(times[-1] - times[0]) / max(1, len(times) - 1) * 1000,
                e2e_ms=(times[-1] - request.sent_at) * 1000, worker_ids=worker_ids))
        item = request.item
        spec = item.item
        if request.session_id:
            self.sessions[request.session_id] = (worker_ids[-1], len(history))
        if isinstance(spec, Session) and request.round_index + 1 < len(spec.rounds):
            item.history = history
            delay = spec.rounds[request.round_index + 1].delay_before_s
            self._push(times[-1] + delay, _SEND, (item, request.round_index + 1))
        else:
            self._close_session(request.session_id)
            self._item_done()

    def _fail(self, request: _Request, error: str) -> None:
        self._end(request, RequestResult(request.request_id, request.session_id, request.round_index,
                                         request.sent_at, None, [], self.now, request.prompt_len, 0, False, error))
        self._close_session(request.session_id)
        self._item_done()  # a failed round ends its session

    def _close_session(self, session_id: str | None) -> None:
        """The client closes its session (DeleteSession): its worker drops the pinned history."""
        bound = self.sessions.pop(session_id, None) if session_id else None
        if bound is not None and bound[0] in self.by_id:
            worker = self.by_id[bound[0]]
            worker.release_session(session_id, self.now)
            self._kick(worker)

    def _end(self, request: _Request, result: RequestResult) -> None:
        request.done = True
        self.results.append(result)
        del self._in_flight[request.request_id]
        if request.lent_blocks is not None and request.bound_worker in self.by_id:
            self.by_id[request.bound_worker].release_lease(request.lent_blocks, self.now)
            request.lent_blocks = None
        for stage in request.stages:  # reservations and stages the request no longer needs
            if stage.held_blocks:
                stage.worker.release_lease(stage.held_blocks, self.now)
                stage.held_blocks = None
            if stage.reserved_blocks is not None:
                stage.worker.release_reserved(stage.reserved_blocks, self.now)
                stage.reserved_blocks = None
                self._kick(stage.worker)
            elif stage.worker.stages.get(stage.key) is stage:
                stage.worker.abort(stage, self.now)
                self._kick(stage.worker)
            stage.owner = stage.seq = None  # no cycles left for a collector (it is off during runs)
        request.stages = []
        request.prompt_ids = []
        if self.free_slots is not None:
            if self._waiting_for_slot and not self._closing:
                # The slot passes straight to the longest waiting send (FIFO, as a semaphore).
                self._push(self.now, _SEND_WITH_SLOT, self._waiting_for_slot.popleft())
            else:
                self.free_slots += 1

    def _item_done(self) -> None:
        if self.concurrency:
            self._next_closed_loop_item()

    def _next_closed_loop_item(self) -> None:
        if self._next_item < len(self.items):
            item = self.items[self._next_item]
            self._next_item += 1
            self._push(self.now, _SEND, (item, 0))

    def _cut_off(self, at: float, error: str) -> None:
        self.now = at
        for request in list(self._in_flight.values()):
            self._end(request, RequestResult(request.request_id, request.session_id, request.round_index,
                                             request.sent_at, None, [], at, request.prompt_len, 0, False, error))

    def _finish_stats(self, events: int, wall_s: float) -> None:
        s = self.stats
        s.wall_s, s.virtual_s, s.events = wall_s, self.now, events
        s.steps = sum(w.num_steps for w in self.workers)
        s.preemptions = sum(w.scheduler.num_preemptions for w in self.workers)
        s.view_refreshes = self.view.num_refreshes
        if self.now > 0:
            s.worker_busy_fraction = sum(w.busy_s for w in self.workers) / (self.now * len(self.workers))
