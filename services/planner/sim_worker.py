"""One simulated worker: a driver of the serving core in virtual time.

Like the real engine (`workers.engine.Engine`) and the emulated one, it only executes
what `Scheduler.schedule()` returns and feeds the result to `update_from_output()`;
admission, chunked prefill, preemption, prefix caching, block accounting, finishing and
step shape are the core's (architecture principle 1). What is simulated:

* a step lasts `step_time(perf_model, out.shape)` of virtual time;
* every sampled token is the fake id 1 with EOS ignored, so a stage ends at max_tokens
  or at its end, where the core ends it;
* the KV of a stage that a later stage continues leaves in the chunks `KvPushPlan`
  releases (as `workers.kv_stages` pushes them), over this worker's one outgoing link
  (chunks of all its requests queue on it), each taking `PerfModel.kv_transfer_time`;
  the sender keeps the stage's blocks until its last chunk has arrived;
* runs of identical decode steps are applied in bulk (`splitserve.core.decode_run`),
  each step's time still from the performance model. Any outside change (a stage added,
  KV reserved or freed, an abort) first settles the run at that instant, and load
  snapshots inside a run are computed for their instant, so results equal stepping one
  step at a time (tested).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable

import numpy as np

from splitserve.core import (BlockManager, DecodeRun, FinishReason, KvCapacityError, KvInBlocks, KvPushPlan, KvSink, SamplingParams,
                             Scheduler, SchedulerConfig, SchedulerOutput, Sequence, StageKey, StageSlo, StageSpec,
                             build_batch_policy, step_time, whole_block_chunk)
from splitserve.core.sequence import SessionHold
from splitserve.perf.model import PerfModel
from services.planner.sim_config import MAX_NUM_SEQS
from splitserve.core.records import WorkerLoad

__all__ = ["FAKE_TOKEN_ID", "StageRun", "SimWorker"]

FAKE_TOKEN_ID = 1
_MIN_RUN_STEPS = 3  # shorter runs are cheaper stepped one by one
# Requests are bounded by the KV cache only, as the perf-model presets are.
_UNBOUNDED = 1 << 62


@dataclass(eq=False, slots=True)
class StageRun:
    """One stage of one request on one worker: its token range, sequence and KV push state."""

    key: StageKey
    start: int
    end: int
    worker: SimWorker
    token_times: array  # the request's token times (s); every stage appends to the same one
    owner: object = None  # the simulator's record of the request
    push_kv: bool = True  # the plan lets this stage push its KV to the next stage's worker
    seq: Sequence | None = None
    push: KvPushPlan | None = None  # set when a later stage continues from this stage's KV
    push_done_at: float = 0.0  # when this stage's last queued chunk has arrived
    reserved_blocks: list[int] | None = None  # on this worker: room for the previous stage's KV
    finish_reason: FinishReason | None = None
    last_token_pending: bool = False  # sampled by the last step; delivered after the push
    added_at: float = 0.0  # when the stage reached this worker (its TTFT sample starts there)
    last_token_at: float | None = None  # when this worker last produced a token of it
    pulled_tokens: int = 0  # history KV in place before it started: pulled into `reserved_blocks`
    # from `kv_start` on (AMPD lazy pull), before that held in this worker's own prefix cache
    kv_start: int = 0  # `reserved_blocks` hold tokens [kv_start, ...); before it: this worker's cache
    held_blocks: list[int] | None = None  # own cached blocks held until the stage is added
    history_prepared: bool = False  # the lazy pull of its session's history was set up (or not needed)
    push_from: int = 0  # first token its push sends (the next worker holds the history before it)
    kv_wait_until: float | None = None  # waiting in line for the next worker's KV reservation until then
    receive_tokens: int = 0  # kv_receive="blocking": KV tokens the first step scheduling it here pulls first

    @property
    def index(self) -> int:
        """Position in the request's plan."""
        return self.key.stage_index


class SimWorker:
    """The engine of one worker, stepped in virtual time by the simulator."""

    def __init__(self, worker_id: str, perf_model: PerfModel, *, clock: Callable[[], float], num_kv_blocks: int,
                 block_size: int = 16, max_num_batched_tokens: int = 2048, max_num_seqs: int = MAX_NUM_SEQS,
                 batch_policy: str = "fcfs", batch_policy_options: dict | None = None,
                 enable_prefix_caching: bool = True, role: str = "both", kv_chunk_tokens: int = 64,
                 view_refresh_s: float = 0.1, fast_forward: bool = True, signals_window_s: float | None = None):
        self.worker_id = worker_id
        self.perf_model = perf_model
        self.role = role
        self.pool = ""  # LAPS spatial mode: the prefill pool the controller put it in
        self.draining = False
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        # The token ids are stand-ins naming prefix blocks (sim_workload), not a vocabulary's.
        config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len=_UNBOUNDED, vocab_size=None)
        # A policy that predicts step latency (slo_aware) starts from this worker's own model.
        policy = build_batch_policy(batch_policy, batch_policy_options, perf_model=perf_model)
        self.scheduler = Scheduler(config, self.block_manager, policy, clock)
        self.kv_chunk_tokens = whole_block_chunk(kv_chunk_tokens, block_size)
        self.fast_forward = fast_forward
        self.stages: dict[StageKey, StageRun] = {}
        self.stepping = False
        self.hold_until: float | None = None  # the batch policy holds work back until then
        self.wake_at: float | None = None  # when the simulator will start a step for that hold
        self.step_end = 0.0  # end of the step (or fast-forwarded run) in progress
        self.generation = 0  # changes whenever step_end moves earlier: older step-done events are void
        self.step_moved = False  # step_end moved since the simulator last scheduled it
        self.link_free_at = 0.0
        self.pending_receives = 0  # stages here whose blocking KV receive has not run yet
        self.num_steps = 0
        self.busy_s = 0.0
        self._out: SchedulerOutput | None = None
        self._duration = 0.0
        # A fast-forwarded run: its steps' durations and ends.
        self._run: DecodeRun | None = None
        self._run_durations: np.ndarray = np.empty(0)
        self._run_ends: list[float] = []
        # Load as of the last view refresh (see `load_at`).
        self._refresh_s = view_refresh_s
        self._snapshot_tick = -1
        self._snapshot: WorkerLoad | None = None
        # Windowed TTFT/ITL of this worker's tokens, kept only when the placement policy
        # reads them (AMPD; the real worker's samples go to Redis instead).
        self.ttft_window = WindowedMean(signals_window_s) if signals_window_s else None
        self.itl_window = WindowedMean(signals_window_s) if signals_window_s else None

    # ---- capacity and KV reservations -------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.scheduler.kv_capacity_tokens

    def reserve_kv(self, num_tokens: int, now: float) -> list[int] | None:
        """Blocks for KV another worker will push (Worker.PrepareKv); None when there is no room."""
        self._before_change(now)
        try:
            return self.scheduler.reserve_kv(num_tokens)
        except KvCapacityError:
            return None

    def release_session(self, session_id: str, now: float) -> None:
        """Drop a session's pinned history (Worker.ReleaseSession)."""
        self._before_change(now)
        self.scheduler.release_session(session_id)

    def lease_session(self, session_id: str, max_tokens: int, now: float) -> list[int]:
        """Lend a pinned session history's whole blocks to a lazy pull (Worker.LeaseSessionKv)."""
        self._before_change(now)
        return self.scheduler.lease_session_kv(session_id, max_tokens)

    def hold_cached_prefix(self, token_ids: list[int], max_tokens: int, now: float) -> list[int]:
        """Hold this worker's cached blocks of the longest cached prefix (`Scheduler.hold_cached_prefix`)."""
        self._before_change(now)
        return self.scheduler.hold_cached_prefix(token_ids, max_tokens)

    def release_lease(self, block_ids: list[int], now: float) -> None:
        """Give back lent or held blocks."""
        self._before_change(now)
        self.scheduler.release_lease(block_ids)

    def pull_out(self, tokens: int, now: float) -> float:
        """Another worker reads `tokens` tokens of KV from here (a lazy pull): when they have arrived."""
        self.link_free_at = max(self.link_free_at, now) + self.perf_model.kv_transfer_time(tokens)
        return self.link_free_at

    def release_reserved(self, block_ids: list[int], now: float) -> None:
        """Return a reservation no stage adopted (the request ended before its next stage)."""
        self._before_change(now)
        self.scheduler.release_reserved(block_ids)

    # ---- stages -------------------------------------------------------------------------
    def add_stage(self, stage: StageRun, token_ids: list[int], prompt_len: int, max_tokens: int,
                  prefix_len: int, now: float, push_to: StageRun | None = None, slo: StageSlo = StageSlo(),
                  session: SessionHold | None = None) -> None:
        """Queue a stage (ValueError as the engine rejects it); with reserved blocks its prefix
        KV is in place; `push_to` is the next stage, whose reserved blocks this one fills; `slo`
        is the request's objectives (the coordinator copies them into every stage); `session`
        pins the stage's KV under its session when it finishes (the round's last stage)."""
        self._before_change(now)
        kv = KvInBlocks(tuple(stage.reserved_blocks), prefix_len, stage.kv_start) \
            if stage.reserved_blocks is not None else None
        sink = None
        if push_to is not None:
            sink = KvSink(push_to.worker.worker_id, str(stage.key), tuple(push_to.reserved_blocks),
                          self.kv_chunk_tokens)
        spec = StageSpec(stage.key, token_ids[:prompt_len], SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0),
                         output_ids=token_ids[prompt_len:], end=stage.end, kv=kv, sink=sink, arrival_time=now, slo=slo,
                         session=session)
        try:
            stage.seq = self.scheduler.add_stage(spec)
        finally:
            if stage.held_blocks:  # the stage holds its own references now (or was refused)
                self.scheduler.release_lease(stage.held_blocks)
            stage.held_blocks = None
        stage.reserved_blocks = None
        stage.added_at = now
        if stage.receive_tokens:
            self.pending_receives += 1
        if sink is not None:
            # Whole blocks before `push_from` are in place there already (a session's
            # history): only the rest moves (AMPD footnote 4).
            start = stage.push_from // self.block_manager.block_size * self.block_manager.block_size
            stage.push = KvPushPlan(self.kv_chunk_tokens, stage.seq.stop_at or stage.end, pushed_upto=start)
        self.stages[stage.key] = stage

    def release(self, stage: StageRun, now: float) -> None:
        """Free the KV a finished, pushing stage kept until its last chunk arrived."""
        self._before_change(now)
        self.scheduler.release(stage.key)
        self._drop(stage)

    def abort(self, stage: StageRun, now: float) -> None:
        """Drop a stage and free its blocks at once (`Scheduler.abort`)."""
        self._before_change(now)
        self.scheduler.abort(stage.key)
        self._drop(stage)

    def _drop(self, stage: StageRun) -> None:
        if self.stages.pop(stage.key, None) is not None and stage.receive_tokens:
            stage.receive_tokens = 0
            self.pending_receives -= 1

    # ---- engine steps --------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule the next step (or a fast-forwarded run of steps); its end, or None when idle
        (then `hold_until`, if set, is when the batch policy wants to be asked again)."""
        self._touch(now)
        out = self.scheduler.schedule()
        self.hold_until = out.hold_until
        if not out.entries:
            return None
        receiving = self._take_receives(out) if self.pending_receives else 0.0
        duration = step_time(self.perf_model, out.shape) + receiving
        self._out, self._duration = out, duration
        self.stepping = True
        self.num_steps += 1
        self.busy_s += duration
        self.step_end = now + duration
        if self.fast_forward and not receiving and not any(self.stages[e.seq.key].push for e in out.entries):
            run = DecodeRun.find(self.scheduler, out, FAKE_TOKEN_ID)  # pushing stages go step by step
            if run is not None and run.steps >= _MIN_RUN_STEPS:
                self._begin_run(run, duration)
        return self.step_end

    def _take_receives(self, out: SchedulerOutput) -> float:
        """Seconds this step spends pulling the KV of stages it schedules for the first time
        (kv_receive="blocking"), before its forward: one transfer per stage, back to back."""
        seconds = 0.0
        for e in out.entries:
            stage = self.stages[e.seq.key]
            if stage.receive_tokens:
                seconds += self.perf_model.kv_transfer_time(stage.receive_tokens)
                stage.receive_tokens = 0
                self.pending_receives -= 1
        return seconds

    def finish_step(self, now: float) -> list[StageRun]:
        """Complete the step ending at `now`: sample, record token times, end stages; the ended stages."""
        self._touch(now)
        if self._run is not None:  # a run's last step: apply the others, then run it for real
            last = self._run.steps - 1
            self._apply_run(last)
            self._run = None
            self._out, self._duration = self.scheduler.schedule(), float(self._run_durations[last])
        out, self._out = self._out, None
        self.stepping = False
        sampled = {e.seq.key: FAKE_TOKEN_ID for e in out.entries if e.samples}
        events = self.scheduler.update_from_output(out, sampled, self._duration)
        stages = self.stages
        for e in out.entries:
            stage = stages.get(e.seq.key)
            if stage is not None and stage.push is not None:
                for start, end in stage.push.ready(e.seq.num_computed_tokens):
                    self._push(stage, end - start, now)
        ended: list[StageRun] = []
        for ev in events:
            stage = stages[ev.key]
            if ev.token_ids:
                if self.ttft_window is not None:
                    self._sample_token(stage, now)
                if ev.finished and stage.push is not None:
                    stage.last_token_pending = True  # the worker yields it after its push completes
                else:
                    stage.token_times.append(now)
            if not ev.finished:
                continue
            stage.finish_reason = FinishReason(ev.finish_reason)
            if stage.push is not None:
                stage.push_done_at = max(stage.push_done_at, now)
            else:
                del stages[ev.key]
            ended.append(stage)
        return ended

    # ---- fast-forwarded runs of decode steps -----------------------------------------------
    def _begin_run(self, run: DecodeRun, first_duration: float) -> None:
        batch = len(run.out.entries)
        durations = self.perf_model.decode_run_times(batch, run.first_context_tokens, run.steps)
        ends = np.cumsum(np.concatenate(((self.step_end - first_duration,), durations)))[1:]
        self._run, self._run_durations, self._run_ends = run, durations, ends.tolist()
        self.num_steps += run.steps - 1
        self.busy_s += float(durations[1:].sum())
        self.step_end = self._run_ends[-1]

    def _apply_run(self, done: int) -> None:
        """Apply the run's steps before `done` to the scheduler and the stages' token times."""
        run = self._run
        first = run.applied
        run.apply(done, self._run_durations)
        if done > first:
            ends = array("d", self._run_ends[first:done])
            for e in run.out.entries:
                self.stages[e.seq.key].token_times.extend(ends)
            if self.itl_window is not None:
                self._sample_run(run.out.entries, first, done)

    def _before_change(self, now: float) -> None:
        """Snapshot the load for a refresh that passed, and bring a fast-forwarded run to `now`."""
        self._touch(now)
        if self._run is None:
            return
        ends = self._run_ends
        last = len(ends) - 1
        done = min(bisect_right(ends, now), last)  # the step in progress is `done` (0-based)
        self._apply_run(done)
        if done:
            self._out = self.scheduler.schedule()  # the step in progress, as decided at its start
        self._duration = float(self._run_durations[done])
        self.num_steps -= last - done
        self.busy_s -= float(self._run_durations[done + 1:].sum())
        self._run = None
        if ends[done] != self.step_end:
            self.step_end = ends[done]
            self.generation += 1
            self.step_moved = True

    # ---- windowed TTFT/ITL (AMPD's routing signals) ------------------------------------------
    def _sample_token(self, stage: StageRun, now: float) -> None:
        """A token of `stage` produced here now: its first is a TTFT sample, later ones ITL samples."""
        if stage.last_token_at is None:
            self.ttft_window.add(now, now - stage.added_at)
        else:
            self.itl_window.add(now, now - stage.last_token_at)
        stage.last_token_at = now

    def _sample_run(self, entries, first: int, done: int) -> None:
        """ITL samples of a fast-forwarded run's steps [first, done): one per request per step."""
        ends = self._run_ends
        batch = len(entries)
        previous = ends[first - 1] if first > 0 else None
        for index in range(first, done):
            end = ends[index]
            if previous is not None:
                self.itl_window.add(end, end - previous, batch)
            else:  # the run's first step: each request's gap since its own last token
                for e in entries:
                    stage = self.stages[e.seq.key]
                    if stage.last_token_at is not None:
                        self.itl_window.add(end, end - stage.last_token_at)
            previous = end
        for e in entries:
            self.stages[e.seq.key].last_token_at = ends[done - 1]

    def signals(self, now: float) -> tuple[float | None, float | None, list]:
        """Windowed mean TTFT and ITL (None without samples) and the pending prefills, as of now."""
        if self.ttft_window is None:
            return None, None, []
        return self.ttft_window.mean(now), self.itl_window.mean(now), self.scheduler.prefill_queue()

    # ---- KV push ---------------------------------------------------------------------------
    def _push(self, stage: StageRun, tokens: int, now: float) -> None:
        """Queue one chunk of `tokens` tokens on the link, after what is queued already."""
        self.link_free_at = max(self.link_free_at, now) + self.perf_model.kv_transfer_time(tokens)
        stage.push_done_at = self.link_free_at

    # ---- load ----------------------------------------------------------------------------
    def load_now(self) -> WorkerLoad:
        """This worker's load figures now (`Scheduler.load`)."""
        return self.scheduler.load()

    def load_at(self, tick: int) -> WorkerLoad:
        """The load published at refresh instant `tick * view_refresh_s` (the latest instant so far)."""
        if self._snapshot_tick == tick:
            return self._snapshot  # changed since that instant: the state saved just before the change
        return self._load_at_instant(tick * self._refresh_s)  # unchanged since before that instant

    def _load_at_instant(self, t: float) -> WorkerLoad:
        if self._run is None:
            return self.scheduler.load()
        scheduled = min(bisect_right(self._run_ends, t) + 1, len(self._run_ends))  # steps holding blocks by t
        return self._run.load_at_step(scheduled)

    def _touch(self, now: float) -> None:
        # Called before every change: the first change after a refresh instant saves the
        # state the refresh saw, so stale views cost one snapshot per tick, not per event.
        tick = int(now / self._refresh_s)
        if tick > self._snapshot_tick:
            self._snapshot = self._load_at_instant(tick * self._refresh_s)
            self._snapshot_tick = tick

    def has_work(self) -> bool:
        """Whether sequences are queued or running here."""
        return self.scheduler.has_unfinished()


class WindowedMean:
    """Mean of the samples of the last `window_s` seconds, in one-second buckets (O(1) per sample).

    The real worker records every sample in Redis and the scheduler averages those newer
    than the window; whole buckets here make the window up to one bucket longer, which
    is well inside the refresh lag the policy already lives with."""

    __slots__ = ("window_s", "bucket_s", "_buckets")

    def __init__(self, window_s: float, bucket_s: float = 1.0):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s, self.bucket_s = window_s, min(bucket_s, window_s)
        self._buckets: dict[int, list[float]] = {}  # bucket index -> [sum, count]

    def add(self, at: float, value: float, count: int = 1) -> None:
        bucket = self._buckets.setdefault(int(at / self.bucket_s), [0.0, 0])
        bucket[0] += value * count
        bucket[1] += count

    def mean(self, now: float) -> float | None:
        oldest = int((now - self.window_s) / self.bucket_s)
        total, count = 0.0, 0
        for index in [i for i in self._buckets if i < oldest]:
            del self._buckets[index]
        for value_sum, value_count in self._buckets.values():
            total += value_sum
            count += value_count
        return total / count if count else None


def published(worker: SimWorker, load: WorkerLoad, engine_kind: str, taken_at: float) -> WorkerLoad:
    """`load` with the worker's identity, as the real worker publishes it."""
    # Built field by field: dataclasses.replace costs ~10x more, once per worker per refresh.
    return WorkerLoad(worker_id=worker.worker_id, role=worker.role, engine_kind=engine_kind,
                      free_blocks=load.free_blocks, total_blocks=load.total_blocks, block_size=load.block_size,
                      running=load.running, waiting=load.waiting, queued_prefill_tokens=load.queued_prefill_tokens,
                      num_preemptions=load.num_preemptions, prefix_hit_rate=load.prefix_hit_rate,
                      draining=worker.draining, updated_unix=taken_at, pool=worker.pool,
                      # The share of time stepping, sampled at the refresh instant: whether the
                      # worker had work then (the same with and without fast-forwarded runs).
                      busy_fraction=1.0 if load.running or load.waiting else 0.0,
                      length_boundary=load.length_boundary)
