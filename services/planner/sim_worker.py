"""One simulated worker: the real Scheduler, BlockManager and BatchPolicy on a virtual clock.

Only the forward pass is replaced: a step lasts what `PerfModel.step_time` predicts for
the entries the real scheduler chose, and every sampled token is the fake id 1 with EOS
ignored, so a sequence ends at max_tokens or at its stage's end (`stop_at`) exactly
where `Engine.step` ends it. Admission, chunked prefill, preemption, prefix caching and
block accounting are the engine's own code (architecture principle 1); the block manager
is the engine's with an incremental, equivalent `commit_computed` (`sim_blocks`).

KV of a stage that a later stage continues is pushed in chunks of `kv_chunk_tokens`
while the stage computes, as `workers.kv_stages` does: a chunk leaves once the stage's
computed tokens cover it, over this worker's one outgoing link (chunks of all its
requests queue on it), each taking `PerfModel.kv_transfer_time(chunk)`. The remainder
goes when the stage ends, so only the last chunk's transfer is not overlapped with
compute (unless the link is the bottleneck). The sender keeps the stage's blocks until
its last chunk has arrived.

Fast-forward: most steps of a long simulation are runs of identical decode-only steps
(every running sequence, one token, nothing waiting or no room to admit it). For a batch policy whose choice in
that state is exactly that whatever the time (`STEADY_DECODE_POLICIES`), the scheduler
decides the run's first and last step, and the steps between are applied in bulk with
the effect `Scheduler.on_step_done` has on decode entries (computed counts, blocks,
prefix-cache index, `policy.observe` per step), each step's time still from the
performance model. Any outside change (a stage added, KV reserved or freed, an abort)
first settles the run at that instant, and load snapshots inside a run are computed for
their instant, so results equal stepping one step at a time (tested).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from splitserve.perf_model import PerfModel
from services.planner.sim_blocks import make_block_manager
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import FinishReason, Sequence
from workers.policies import make_batch_policy
from workers.policies.base import ExecutedBatch

__all__ = ["FAKE_TOKEN_ID", "STEADY_DECODE_POLICIES", "StageRun", "SimWorker", "WorkerLoad"]

FAKE_TOKEN_ID = 1
# Batch policies that, with only decodes running and nothing waiting, always choose every
# running sequence with one token: their runs of such steps may be fast-forwarded.
STEADY_DECODE_POLICIES = frozenset({"fcfs"})
_MIN_RUN_STEPS = 3  # shorter runs are cheaper stepped one by one
_LENGTH, _STAGE_END, _ABORT = FinishReason.LENGTH, FinishReason.STAGE_END, FinishReason.ABORT


@dataclass(eq=False, slots=True)
class StageRun:
    """One stage of one request on one worker: its token range, sequence and KV push state."""

    engine_id: str  # "<request id>/<stage index>", as the real worker names it
    index: int
    start: int
    end: int
    worker: SimWorker
    token_times: array  # the request's token times (s); every stage appends to the same one
    owner: object = None  # the simulator's record of the request
    seq: Sequence | None = None
    pushes_kv: bool = False  # a later stage continues from this stage's KV
    stop_at: int = 0  # where the pushed KV ends (the stage's end)
    pushed_upto: int = 0
    push_done_at: float = 0.0  # when this stage's last queued chunk has arrived
    reserved_blocks: list[int] | None = None  # on this worker: room for the previous stage's KV
    finish_reason: FinishReason | None = None
    last_token_pending: bool = False  # sampled by the last step; delivered after the push


class WorkerLoad(NamedTuple):
    """The load figures a worker publishes (what `Engine.stats` reports)."""

    free_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int


class SimWorker:
    """The engine of one worker, stepped in virtual time by the simulator."""

    def __init__(self, worker_id: str, perf_model: PerfModel, *, clock: Callable[[], float], num_kv_blocks: int,
                 block_size: int = 16, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 batch_policy: str = "fcfs", batch_policy_options: dict | None = None,
                 enable_prefix_caching: bool = True, role: str = "both", kv_chunk_tokens: int = 64,
                 view_refresh_s: float = 0.1, fast_forward: bool = True):
        self.worker_id = worker_id
        self.perf_model = perf_model
        self.role = role
        self.draining = False
        self.block_manager = make_block_manager(num_kv_blocks, block_size, enable_prefix_caching)
        policy = make_batch_policy(batch_policy, **(batch_policy_options or {}))
        self.scheduler = Scheduler(self.block_manager, policy, max_num_batched_tokens, max_num_seqs, clock)
        # Pushed chunks are whole blocks, as workers.kv_stages rounds them.
        self.kv_chunk_tokens = max(block_size, -(-max(kv_chunk_tokens, 1) // block_size) * block_size)
        self.fast_forward = fast_forward and batch_policy in STEADY_DECODE_POLICIES
        self.stages: dict[str, StageRun] = {}
        self.stepping = False
        self.step_end = 0.0  # end of the step (or fast-forwarded run) in progress
        self.generation = 0  # changes whenever step_end moves earlier: older step-done events are void
        self.step_moved = False  # step_end moved since the simulator last scheduled it
        self.link_free_at = 0.0
        self.num_steps = 0
        self.busy_s = 0.0
        self._out: SchedulerOutput | None = None
        self._duration = 0.0
        # A fast-forwarded run: its first step's output, every step's duration and end.
        self._run_out: SchedulerOutput | None = None
        self._run_durations: list[float] = []
        self._run_ends: list[float] = []
        # Load as of the last view refresh (see `load_at`).
        self._refresh_s = view_refresh_s
        self._snapshot_tick = -1
        self._snapshot: WorkerLoad | None = None

    # ---- capacity and KV reservations -------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def admission_error(self, total_len: int) -> str | None:
        """The engine's rejection of a request too long for this worker's KV cache, else None."""
        if total_len > self.kv_capacity_tokens:
            return (f"InvalidArgument: prompt + max_tokens = {total_len} tokens exceeds the KV cache capacity "
                    f"({self.kv_capacity_tokens} tokens)")
        return None

    def reserve_kv(self, num_tokens: int, now: float) -> list[int] | None:
        """Blocks for KV another worker will push (Worker.PrepareKv); None when there is no room."""
        self._before_change(now)
        bm = self.block_manager
        n = bm.blocks_for_tokens(num_tokens)
        return bm.reserve(n) if n <= bm.num_free_blocks else None

    def release_reserved(self, block_ids: list[int], now: float) -> None:
        """Return a reservation no stage adopted (the request ended before its next stage)."""
        self._before_change(now)
        self.block_manager.release_reserved(block_ids)

    # ---- stages -------------------------------------------------------------------------
    def add_stage(self, stage: StageRun, token_ids: list[int], prompt_len: int, max_tokens: int,
                  prefix_len: int, now: float) -> None:
        """Queue a stage as `Engine.add_request` does; with reserved blocks its prefix KV is in place."""
        self._before_change(now)
        total = prompt_len + max_tokens
        stop_at = stage.end if 0 < stage.end < total else None
        seq = Sequence(stage.engine_id, token_ids, prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       0, now, keep_kv=stage.pushes_kv, stop_at=stop_at)
        stage.seq = seq
        stage.stop_at = stop_at or total
        if stage.reserved_blocks is not None:
            self.block_manager.adopt(seq, stage.reserved_blocks, prefix_len)
            stage.reserved_blocks = None
        self.scheduler.add(seq)
        self.stages[stage.engine_id] = stage

    def release(self, stage: StageRun, now: float) -> None:
        """Free the KV a finished, pushing stage kept until its last chunk arrived."""
        self._before_change(now)
        self.scheduler.release(stage.engine_id)
        self.stages.pop(stage.engine_id, None)

    def abort(self, stage: StageRun, now: float) -> None:
        """Drop a stage and free its blocks at once (`Engine.abort`)."""
        self._before_change(now)
        seq = stage.seq
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, _ABORT)
        self.scheduler.release(stage.engine_id)
        self.stages.pop(stage.engine_id, None)

    # ---- engine steps --------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule the next step (or a fast-forwarded run of steps); its end, or None when idle."""
        self._touch(now)
        out = self.scheduler.schedule()
        if not out.entries:
            return None
        duration, decode_ctx, all_decodes = self._step_shape(out)
        self._out, self._duration = out, duration
        self.stepping = True
        self.num_steps += 1
        self.busy_s += duration
        self.step_end = now + duration
        sched = self.scheduler
        # Waiting requests change nothing while the running set is full (no admission until
        # a sequence finishes, which ends the run): a saturated decode worker fast-forwards too.
        if (self.fast_forward and all_decodes and not out.preempted
                and (not sched.waiting or len(sched.running) >= sched.budget.max_num_seqs)
                and len(out.entries) == len(sched.running)):
            steps = self._steady_steps(out)
            if steps >= _MIN_RUN_STEPS:
                self._begin_run(out, duration, decode_ctx, steps)
        return self.step_end

    def finish_step(self, now: float) -> list[StageRun]:
        """Complete the step ending at `now`: sample, record token times, end stages; the ended stages."""
        self._touch(now)
        if self._run_out is not None:  # a run's last step: apply the others, then run it for real
            last = len(self._run_ends) - 1
            self._apply_run_steps(last)
            self._run_out = None
            self._out, self._duration = self.scheduler.schedule(), self._run_durations[last]
        out, self._out = self._out, None
        self.stepping = False
        scheduler = self.scheduler
        scheduler.on_step_done(out, self._duration)
        ended: list[StageRun] = []
        stages = self.stages
        for e in out.entries:
            seq = e.seq
            stage = stages.get(seq.request_id)
            if stage is None:
                continue  # aborted while the step ran
            if stage.pushes_kv:
                self._push_chunks(stage, seq.num_computed_tokens, now)
            tokens = seq.token_ids
            if e.start + e.num_new_tokens == len(tokens):  # this entry samples the next token
                tokens.append(FAKE_TOKEN_ID)
                if len(tokens) - seq.prompt_len >= seq.params.max_tokens:
                    reason = _LENGTH
                elif seq.reached_stage_end:
                    reason = _STAGE_END
                else:
                    stage.token_times.append(now)
                    continue
                if stage.pushes_kv:
                    stage.last_token_pending = True  # the worker yields it after finish_push
                else:
                    stage.token_times.append(now)
            elif seq.reached_stage_end:  # a prefill-only stage: KV done, nothing sampled
                reason = _STAGE_END
            else:
                continue
            scheduler.finish(seq, reason)
            stage.finish_reason = reason
            if stage.pushes_kv:
                if reason is _STAGE_END and stage.pushed_upto < stage.stop_at:
                    self._push(stage, stage.stop_at - stage.pushed_upto, now)
                stage.push_done_at = max(stage.push_done_at, now)
            else:
                del stages[stage.engine_id]
            ended.append(stage)
        return ended

    def _step_shape(self, out: SchedulerOutput) -> tuple[float, int, bool]:
        """(seconds, summed decode context, whether every entry is a decode) of a scheduled step."""
        prefills = []
        decodes = decode_ctx = 0
        for e in out.entries:
            if e.num_new_tokens == 1 and e.start >= e.seq.prompt_len:
                decodes += 1
                decode_ctx += e.start + 1  # KV read by this decode, the new token's included
            else:
                prefills.append((e.start, e.num_new_tokens))
        seconds = self.perf_model.step_time(prefills, decodes, decode_ctx / decodes if decodes else 0.0)
        return seconds, decode_ctx, not prefills

    # ---- fast-forwarded runs of decode steps -----------------------------------------------
    def _steady_steps(self, out: SchedulerOutput) -> int:
        """How many identical decode steps follow from this one: until the first sequence ends,
        if the KV blocks they need are free now (else 0)."""
        steps = 1 << 62
        for e in out.entries:
            seq = e.seq
            if self.stages[seq.request_id].pushes_kv:
                return 0  # its chunks are pushed step by step
            if e.start + 1 != len(seq.token_ids):
                return 0  # a 1-token recompute chunk past the prompt, not a decode: it samples nothing
            steps = min(steps, seq.params.max_tokens - (len(seq.token_ids) - seq.prompt_len))
            if seq.stop_at is not None:
                steps = min(steps, seq.stop_at - e.start)
        bm = self.block_manager
        need = sum(bm.blocks_for_tokens(e.start + steps) - len(e.seq.block_table) for e in out.entries)
        return steps if need <= bm.num_free_blocks else 0

    def _begin_run(self, out: SchedulerOutput, first_duration: float, decode_ctx: int, steps: int) -> None:
        durations = self._decode_durations(len(out.entries), decode_ctx, steps)
        ends = np.cumsum(np.concatenate(((self.step_end - first_duration,), durations)))[1:]
        self._run_out, self._run_durations, self._run_ends = out, durations.tolist(), ends.tolist()
        self.num_steps += steps - 1
        self.busy_s += float(durations[1:].sum())
        self.step_end = self._run_ends[-1]

    def _decode_durations(self, batch: int, decode_ctx: int, steps: int) -> np.ndarray:
        """`PerfModel.step_time` of `steps` decode steps of `batch` sequences, every context one
        token longer per step, evaluated at once (the decode line of the model's formula);
        checked against `step_time` at both ends, else computed step by step."""
        step_time = self.perf_model.step_time
        ctx = (decode_ctx + batch * np.arange(steps, dtype=np.int64)) / batch
        d = self.perf_model.decode
        bctx = batch * ctx
        durations = np.maximum(d.c0 + d.c_seq * batch + d.c_ctx * bctx, d.m0 + d.m_seq * batch + d.m_ctx * bctx)
        if (durations[0] != step_time((), batch, float(ctx[0]))
                or durations[-1] != step_time((), batch, float(ctx[-1]))):
            durations = np.array([step_time((), batch, c) for c in ctx.tolist()])  # a model of another form
        return durations

    def _apply_run_steps(self, done: int) -> None:
        """Apply the first `done` steps of the run as `on_step_done` and sampling would."""
        if done <= 0:
            return
        out, bm, observe = self._run_out, self.block_manager, self.scheduler.policy.observe
        ends, batch = array("d", self._run_ends[:done]), len(out.entries)
        fake = [FAKE_TOKEN_ID] * done
        block_size = bm.block_size
        max_start = 0
        for e in out.entries:
            seq = e.seq
            bm.grow(seq, done)  # the scheduler grew it for the first step; blocks for the rest
            seq.num_computed_tokens = e.start + done
            seq.token_ids += fake
            if (e.start + done) // block_size > e.start // block_size:
                bm.commit_computed(seq)  # only a newly full block has anything to index
            self.stages[seq.request_id].token_times.extend(ends)
            max_start = max(max_start, e.start)
        if getattr(self.scheduler.policy, "observes_steps", True):
            for i in range(done):
                observe(ExecutedBatch(0, batch, max_start + i + 1, self._run_durations[i]))

    def _before_change(self, now: float) -> None:
        """Snapshot the load for a refresh that passed, and bring a fast-forwarded run to `now`."""
        self._touch(now)
        if self._run_out is None:
            return
        ends = self._run_ends
        last = len(ends) - 1
        done = min(bisect_right(ends, now), last)  # the step in progress is `done` (0-based)
        self._apply_run_steps(done)
        if done:
            self._out = self.scheduler.schedule()  # the step in progress, as decided at its start
        self._duration = self._run_durations[done]
        self.num_steps -= last - done
        self.busy_s -= sum(self._run_durations[done + 1:])
        self._run_out = None
        if ends[done] != self.step_end:
            self.step_end = ends[done]
            self.generation += 1
            self.step_moved = True

    def _run_load(self, t: float) -> WorkerLoad:
        """The load at instant `t` inside a fast-forwarded run, without applying it."""
        ends = self._run_ends
        scheduled = min(bisect_right(ends, t) + 1, len(ends))  # steps whose blocks are allocated by t
        bm = self.block_manager
        extra = 0
        for e in self._run_out.entries:
            extra += max(0, bm.blocks_for_tokens(e.start + scheduled) - len(e.seq.block_table))
        # Only decodes run and whatever waits waits unchanged all run long: only the blocks move.
        load = self.load_now()
        return load._replace(free_blocks=load.free_blocks - extra)

    # ---- KV push ---------------------------------------------------------------------------
    def _push_chunks(self, stage: StageRun, computed: int, now: float) -> None:
        # Only whole chunks while computing (their blocks are full and never written again),
        # and never the one holding the stage's last token: it goes when the stage ends.
        chunk, pushed = self.kv_chunk_tokens, stage.pushed_upto
        chunks = min((computed - pushed) // chunk, (stage.stop_at - pushed - 1) // chunk)
        if chunks > 0:
            self._push(stage, chunk, now, chunks)

    def _push(self, stage: StageRun, tokens: int, now: float, chunks: int = 1) -> None:
        """Queue `chunks` chunks of `tokens` tokens on the link, back to back."""
        self.link_free_at = max(self.link_free_at, now) + chunks * self.perf_model.kv_transfer_time(tokens)
        stage.pushed_upto += chunks * tokens
        stage.push_done_at = self.link_free_at

    # ---- load ----------------------------------------------------------------------------
    def load_now(self) -> WorkerLoad:
        """Free blocks, running and waiting counts, and queued prefill tokens, as `Engine.stats` counts them."""
        sched = self.scheduler
        queued = 0
        for s in sched.waiting:
            queued += len(s.token_ids) - s.num_computed_tokens
        for s in sched.running:
            uncomputed = len(s.token_ids) - s.num_computed_tokens
            if uncomputed > 1:  # still in prefill (prompt or recompute)
                queued += uncomputed
        return WorkerLoad(self.block_manager.num_free_blocks, len(sched.running), len(sched.waiting), queued)

    def load_at(self, tick: int) -> WorkerLoad:
        """The load published at refresh instant `tick * view_refresh_s` (the latest instant so far)."""
        if self._snapshot_tick == tick:
            return self._snapshot  # changed since that instant: the state saved just before the change
        return self._load_at_instant(tick * self._refresh_s)  # unchanged since before that instant

    def _load_at_instant(self, t: float) -> WorkerLoad:
        return self.load_now() if self._run_out is None else self._run_load(t)

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
