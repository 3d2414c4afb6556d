"""A request's lifecycle from plan to the last token, without the gRPC server around it.

`Coordinator.submit` is what the Coordinator service's `Submit` runs, and what a gateway
with an embedded coordinator calls directly (one process and one gRPC hop less per
request and per token).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Histogram

from services.coordinator.placement import Placer
from services.coordinator.records import RequestRecordWriter
from services.coordinator.sessions import SessionService
from services.coordinator.stage_wire import KvLink, LentHistory, SessionHoldSpec, migration_plan, stage_message
from services.coordinator.vllm_metrics import RequestMetrics as VllmRequestMetrics
from services.coordinator.workers import WorkerDirectory
from splitserve.config import CoordinatorConfig
from splitserve.errors import DeadlineExceeded, InvalidArgument, SplitserveError, Unavailable, from_rpc_error
from splitserve.request_rules import check_prompt_len, check_request_id
from splitserve.proto import coordinator_pb2, scheduler_pb2, types_pb2, worker_pb2
from splitserve.core.sampling import request_seed
from splitserve.state.store import DIFFUSION, RequestRecord, SessionRecord
from splitserve.telemetry import end_span, outgoing_metadata, percentile_buckets, record_interval, span_context, start_span

log = logging.getLogger(__name__)

REQUESTS = Counter("splitserve_coordinator_requests_total", "Requests finished, by outcome", ["outcome"])
PLACE_SECONDS = Histogram("splitserve_coordinator_place_seconds", "Time to get a plan", buckets=percentile_buckets(1.0))
TTFT = Histogram("splitserve_coordinator_ttft_seconds", "Submit to first token", buckets=percentile_buckets(30.0))
MIGRATIONS = Counter("splitserve_coordinator_migrations_total", "Requests continued on another worker after a failure")
E2E = Histogram("splitserve_coordinator_e2e_seconds", "Submit to last token", buckets=percentile_buckets(600.0))

# A request is placed again when a worker it runs on dies (before its first token: re-placed;
# after: migrated), at most this many attempts in all, within migration_timeout_s.
MAX_ATTEMPTS = 8


_MAX_KV_RESERVE_WAIT_S = 3600.0  # PrepareKv's wait_ms is a uint32; an hour is already far past any deadline


class Coordinator:
    """Owns each request's lifecycle: place, execute stages, stitch, migrate, record."""

    def __init__(self, config: CoordinatorConfig, placer: Placer, workers: WorkerDirectory,
                 records: RequestRecordWriter, sessions: SessionService | None = None):
        if not 0 <= config.kv_reserve_wait_s <= _MAX_KV_RESERVE_WAIT_S:
            raise ValueError(f"kv_reserve_wait_s: must be between 0 and {_MAX_KV_RESERVE_WAIT_S:g} s, "
                             f"got {config.kv_reserve_wait_s!r}")
        self.config = config
        self.placer = placer
        self.workers = workers
        self.records = records
        self.sessions = sessions
        self._calls: dict[str, grpc.aio.Call] = {}
        self._background: set[asyncio.Task] = set()

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def ready(self, timeout_s: float = 1.0, engine_family: str = "") -> tuple[bool, str, int]:
        """(ready, why not, eligible workers): ready when placement has a worker of the model's
        engine family to use now."""
        try:
            count = await self.placer.eligible_workers(timeout_s, engine_family)
        except SplitserveError as err:
            return False, f"placement unavailable: {err.message}", 0
        except Exception as err:  # a readiness probe reports, it does not raise
            return False, f"placement unavailable: {err}", 0
        kind = "diffusion " if engine_family == DIFFUSION else ""
        return count > 0, "" if count else f"no eligible {kind}worker is registered yet", count

    async def submit(self, request: coordinator_pb2.SubmitRequest, deadline: float,
                     trace_context: Context | None = None) -> AsyncIterator[types_pb2.TokenChunk]:
        """Stream the request's tokens; `deadline` is on the monotonic clock. Raises SplitserveError.
        Traced as `coordinator.request` (placement and each stage below it) under `trace_context`."""
        request_id = request.request_id or uuid.uuid4().hex
        started = time.monotonic()
        # A request sent again after its coordinator died carries what was delivered already.
        emitted: list[int] = list(request.generated_token_ids)
        outcome = "error"
        plan_holder: list[types_pb2.Plan] = []
        session: SessionRecord | None = None
        span = start_span("coordinator.request", trace_context, kind=SpanKind.SERVER, attributes={
            "splitserve.request_id": request_id, "gen_ai.usage.input_tokens": len(request.prompt_token_ids)})
        vllm_request = VllmRequestMetrics(request.model, len(request.prompt_token_ids), started, resumed=bool(emitted))
        error: BaseException | None = None
        try:
            check_prompt_len(len(request.prompt_token_ids))
            check_request_id(request_id)
            max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
            if emitted and (len(emitted) >= max_tokens or request.session_id or request.engine_family == DIFFUSION):
                raise InvalidArgument(f"generated_token_ids ({len(emitted)}) must be fewer than max_tokens "
                                      f"({max_tokens}), and only for a request outside sessions and diffusion",
                                      param="generated_token_ids")
            if request_id in self._calls:
                # Most often an earlier attempt of this very request whose client connection
                # broke (gateway died, resubmit) and whose end is not noticed yet: retriable.
                raise Unavailable(f"request_id {request_id!r} is still in flight (an earlier attempt has not "
                                  f"ended yet); retry")
            if not request.sampling.HasField("seed"):
                # Fixed here, once: each worker would otherwise draw its own, and a request split,
                # disaggregated or migrated across workers would not sample the tokens one worker does.
                request.sampling.seed = request_seed(request_id)
            if request.session_id:
                session = await self._sessions().begin_round(request.session_id, request_id,
                                                             len(request.prompt_token_ids))
            async for chunk in self._run(request, request_id, deadline, emitted, plan_holder, session,
                                         span_context(span)):
                if emitted and len(emitted) == len(chunk.token_ids):
                    TTFT.observe(time.monotonic() - started)
                vllm_request.deliver(len(chunk.token_ids), time.monotonic())
                if chunk.finish_reason:  # before yielding: a consumer may stop at the last chunk
                    outcome = chunk.finish_reason
                    if session is not None:  # free the session before the client can send its next round
                        await self._end_round(session, request_id, plan_holder[-1], outcome,
                                              len(request.prompt_token_ids) + len(emitted))
                        session = None
                yield chunk
        except SplitserveError as err:
            outcome, error = err.code.name.lower(), err
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if outcome == "error":  # closed before the last chunk
                outcome = "cancelled"
            raise
        finally:
            span.set_attribute("splitserve.outcome", outcome)
            span.set_attribute("gen_ai.usage.output_tokens", len(emitted))
            end_span(span, error)
            if session is not None:  # the round failed: the session stays where it was, free for a retry
                self._spawn(self._end_round(session, request_id, None, outcome, 0))
            REQUESTS.labels(outcome).inc()
            E2E.observe(time.monotonic() - started)
            vllm_request.finish(outcome, time.monotonic())
            plan = plan_holder[-1] if plan_holder else None
            if plan is not None and len(plan.stages) > 1 and outcome not in ("stop", "length"):
                # Ended early (cancel, error, deadline): later stages' workers hold KV
                # reservations for this request; free them now rather than at their TTL.
                for worker_id in {s.worker_id for s in plan.stages[1:]}:
                    self._spawn(self._cancel_on(worker_id, request_id))
            self.records.put(RequestRecord(request_id, outcome, stages=_stage_dicts(plan), emitted_token_ids=emitted,
                                           decision=dict(plan.decision) if plan is not None else {}))
            if plan is not None and plan.report_completion:
                self._spawn(self._report(request, request_id, outcome, plan, len(emitted), started))

    def cancel(self, request_id: str) -> bool:
        call = self._calls.get(request_id)
        if call is not None:
            call.cancel()
        return call is not None

    # ---- lifecycle ----------------------------------------------------------------
    async def _run(self, request, request_id: str, deadline: float, emitted: list[int],
                   plan_holder: list[types_pb2.Plan], session: SessionRecord | None = None,
                   trace: Context | None = None):
        """Place and execute; on a worker failure, continue elsewhere from the tokens so far.

        Before the first token a failure simply re-places the request. After it, the
        request migrates: a new single stage recomputes the KV from prompt + emitted
        tokens (counter-based sampling keeps the output identical).
        """
        migration_deadline = None
        attempt = 0
        calling = _Calling()
        failed_workers: list[str] = []  # never placed there again by this request
        while True:
            attempt += 1
            calling.worker_id = ""
            plan = None
            try:
                # Inside the retry: while a dead worker is still in the scheduler's view, or
                # none of the family is left for a moment, placing again is what may fail.
                plan = await self._place(request, request_id, deadline, session, failed_workers, trace)
                if emitted:  # migrating: one stage, everything recomputed from tokens
                    plan = migration_plan(plan, request_id)
                plan_holder.append(plan)
                self.records.put(RequestRecord(request_id, "running", stages=_stage_dicts(plan),
                                               emitted_token_ids=list(emitted), decision=dict(plan.decision)))
                async for chunk in self._execute(request, request_id, plan, deadline, emitted, session, calling,
                                                 trace):
                    yield chunk
                return
            except Unavailable as err:
                if calling.worker_id and calling.worker_id not in failed_workers:
                    failed_workers.append(calling.worker_id)
                if plan is not None:
                    # Free what the failed plan reserved before placing again, so a late cancel
                    # cannot hit the next attempt on the same worker.
                    await asyncio.gather(*(self._cancel_on(st.worker_id, request_id) for st in plan.stages))
                if emitted and request.engine_family == DIFFUSION:
                    # Its blocks came from a denoising run whose seed and cache lived on the
                    # failed worker: no stage can continue it from tokens.
                    raise Unavailable(f"a diffusion request cannot migrate once output was delivered: {err.message}")
                # Before the first token the client could retry itself, but only the SDK does;
                # after it, only a migration keeps the stream whole. Both are bounded by
                # attempts and by time since the first failure, then fail retriably.
                now = time.monotonic()
                migration_deadline = migration_deadline or now + self.config.migration_timeout_s
                if attempt >= MAX_ATTEMPTS or now > migration_deadline:
                    what = "migrated" if emitted else "placed"
                    raise Unavailable(f"request could not be {what} after {attempt} attempts: {err.message}") from None
                if emitted:
                    MIGRATIONS.inc()
                log.warning("attempt %d failed after %d tokens (%s); placing again", attempt, len(emitted), err.message)
                self.workers.forget_soon()
                await asyncio.sleep(min(0.05 * attempt, 0.5))  # back off while the registry drops the dead worker

    async def _place(self, request, request_id: str, deadline: float, session: SessionRecord | None = None,
                     avoid_workers: list[str] = (), trace: Context | None = None) -> types_pb2.Plan:
        sampling = request.sampling
        meta = types_pb2.RequestMeta(
            request_id=request_id, session_id=request.session_id, prompt_len=len(request.prompt_token_ids),
            max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else 16,
            slo=request.slo, priority=request.priority, arrival_unix_ms=time.time_ns() // 1_000_000,
            engine_family=request.engine_family,
        )
        if request.HasField("predicted_output_len"):  # absent stays absent: the scheduler then predicts
            meta.predicted_output_len = request.predicted_output_len
        meta.avoid_workers[:] = avoid_workers
        if session is not None and session.decode_worker:
            # At least the last prompt token is computed again (its logits give the first token).
            meta.history_len = min(session.history_len, len(request.prompt_token_ids) - 1)
            meta.bound_worker = session.decode_worker
        t = time.monotonic()
        span = start_span("coordinator.place", trace, attributes={"splitserve.avoid_workers": list(avoid_workers)})
        try:
            plan = await self.placer.place(meta, _remaining(deadline), span_context(span))
        except BaseException as err:
            end_span(span, err)
            raise
        PLACE_SECONDS.observe(time.monotonic() - t)
        span.set_attribute("splitserve.policy", plan.policy)
        span.set_attribute("splitserve.workers", [s.worker_id for s in plan.stages])
        end_span(span)
        if not plan.stages:
            raise Unavailable("the scheduler returned an empty plan")
        return plan

    async def _wire_kv(self, request_id: str, stage: types_pb2.Stage, index: int, following: types_pb2.Stage,
                       deadline: float, calling: _Calling, start: int = 0) -> KvLink | None:
        """Reserve KV on the next stage's worker for what stage `index` computes, waiting in line
        up to --kv-reserve-wait-s for room there; None when none came (the next stage then
        recomputes the range from tokens, in that worker's own queue). Waiting rather than
        recomputing at once: a recompute is a whole prefill on the worker that decodes, the
        interference disaggregation exists to avoid, while waiting only delays this request —
        and little, as the worker it is sent to is usually behind a backlog of its own.
        `start` > 0: that worker holds [0, start) already, so only the rest travels."""
        transfer_id = f"{request_id}:{index}"
        calling.worker_id = following.worker_id
        stub = await self.workers.stub(following.worker_id)
        try:
            reply = await stub.PrepareKv(worker_pb2.PrepareKvRequest(
                request_id=request_id, transfer_id=transfer_id, num_tokens=stage.end, start=start,
                wait_ms=round(self.config.kv_reserve_wait_s * 1000)),
                timeout=_remaining(deadline))
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        if not reply.ok:
            log.info("no KV reservation on %s (%s); the next stage recomputes", following.worker_id, reply.error)
            return None
        return KvLink(transfer_id=transfer_id, from_worker=stage.worker_id, to_worker=following.worker_id,
                      start=start, end=stage.end, block_ids=tuple(reply.block_ids),
                      chunk_tokens=self.config.kv_chunk_tokens)

    async def _lend_history(self, request_id: str, session: SessionRecord, first: types_pb2.Stage,
                            last: types_pb2.Stage, prompt_len: int, deadline: float,
                            calling: _Calling) -> LentHistory | None:
        """A session round whose prefill runs away from the decode worker holding the history
        (AMPD §3, a remote incremental prefill): that worker lends the pinned history, the first
        stage pulls it lazily instead of recomputing it, and only the KV computed after it comes
        back. None: nothing lent (whole blocks only), everything is computed and pushed."""
        history = min(session.history_len, prompt_len - 1, first.end - 1)
        if (history <= 0 or not session.decode_worker or last.worker_id != session.decode_worker
                or first.worker_id == last.worker_id or not first.push_kv):
            return None
        calling.worker_id = last.worker_id
        stub = await self.workers.stub(last.worker_id)
        try:
            lease = await stub.LeaseSessionKv(worker_pb2.LeaseSessionKvRequest(
                session_id=session.session_id, request_id=request_id, max_tokens=history),
                timeout=_remaining(deadline))
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        if lease.num_tokens == 0:  # the pin is gone (evicted, expired): the round recomputes it
            return None
        return LentHistory(worker_id=last.worker_id, transfer_id=f"{request_id}:history",
                           num_tokens=lease.num_tokens, block_ids=tuple(lease.block_ids))

    async def _execute(self, request, request_id: str, plan: types_pb2.Plan, deadline: float, emitted: list[int],
                       session: SessionRecord | None, calling: _Calling, trace: Context | None = None):
        planned = list(plan.stages)  # what the scheduler decided; each call gets its own Stage
        hold = None
        if session is not None:  # the last stage's worker keeps the round's KV for the next round
            hold = SessionHoldSpec(session_id=session.session_id, ttl_s=max(1, round(session.ttl_s)),
                                   history_len=session.history_len if planned[-1].worker_id == session.decode_worker
                                   else 0)
        history = None
        if session is not None and len(planned) == 2:
            history = await self._lend_history(request_id, session, planned[0], planned[1],
                                               len(request.prompt_token_ids), deadline, calling)
        receives: KvLink | None = None  # what the previous stage pushes to this one
        for index, planned_stage in enumerate(planned):
            span = start_span("coordinator.stage", trace, kind=SpanKind.CLIENT, attributes={
                "splitserve.stage_index": index, "splitserve.worker_id": planned_stage.worker_id,
                "splitserve.start": planned_stage.start, "splitserve.end": planned_stage.end,
                "splitserve.push_kv": planned_stage.push_kv})
            error: BaseException | None = None
            try:
                pushes = None
                if index + 1 < len(planned) and planned_stage.push_kv:  # else the next stage recomputes this range
                    wired = time.time_ns()
                    pushes = await self._wire_kv(request_id, planned_stage, index, planned[index + 1], deadline,
                                                 calling, history.num_tokens if history else 0)
                    record_interval("coordinator.kv_reserve", span, wired, time.time_ns(),
                                    {"splitserve.worker_id": planned[index + 1].worker_id})
                stage = stage_message(planned_stage, index, request, emitted, pushes=pushes, receives=receives,
                                      history=history if index == 0 else None,
                                      hold=hold if index + 1 == len(planned) else None)
                receives = pushes
                calling.worker_id = stage.worker_id
                stub = await self.workers.stub(stage.worker_id)
                call = stub.Execute(stage, timeout=_remaining(deadline),
                                    metadata=outgoing_metadata(request_id, span_context(span)))
            except BaseException as err:
                end_span(span, err)
                raise
            self._calls[request_id] = call
            try:
                async for chunk in call:
                    emitted.extend(chunk.token_ids)
                    if chunk.finish_reason == "stage_end":
                        # The first stage's last token(s), or the prompt logprobs it scored: still
                        # part of the output.
                        if chunk.token_ids or chunk.prompt_logprobs:
                            chunk.finish_reason = ""
                            yield chunk
                        break  # the next stage continues the stream
                    if chunk.finish_reason and index + 1 < len(planned):
                        # Finished early (EOS/stop/length): later stages never run. Free the next
                        # worker's KV reservation from a task started before the last chunk goes
                        # out, because a consumer may close the stream as soon as it has that chunk.
                        self._spawn(self._cancel_on(planned[index + 1].worker_id, request_id))
                    yield chunk
                    if chunk.finish_reason:
                        return
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.CANCELLED and request_id not in self._calls:
                    return
                error = from_rpc_error(err)
                raise error from None
            finally:
                self._calls.pop(request_id, None)
                call.cancel()  # no-op when finished; frees the worker's blocks when the caller left
                end_span(span, error)

    # ---- sessions ------------------------------------------------------------------
    def _sessions(self) -> SessionService:
        if self.sessions is None:
            raise Unavailable("this coordinator serves no sessions (it was started without session state)")
        return self.sessions

    async def open_session(self, session_id: str, ttl_s: float, owner: str) -> tuple[str, float]:
        return await self._sessions().open(session_id, ttl_s, owner)

    async def close_session(self, session_id: str, owner: str) -> bool:
        """Close a session and drop its pinned history on its worker; whether it was open."""
        record = await self._sessions().close(session_id, owner)
        if record is None:
            return False
        if record.decode_worker:
            await self._release_session_on(record.decode_worker, session_id)
        return True

    async def _end_round(self, session: SessionRecord, request_id: str, plan: types_pb2.Plan | None,
                         outcome: str, total_tokens: int) -> None:
        """The round is over: a finished one moved the history to its last stage's worker."""
        worker = None
        history = None
        if plan is not None and outcome in ("stop", "length"):
            worker = plan.stages[-1].worker_id
            history = total_tokens - 1  # the last token's KV is computed by the next round
        try:
            await self._sessions().end_round(session, request_id, worker, history)
        except SplitserveError as err:  # the session then unblocks at its busy_until
            log.warning("ending round %s of session %s failed: %s", request_id, session.session_id, err)
        if worker and session.decode_worker and worker != session.decode_worker:
            self._spawn(self._release_session_on(session.decode_worker, session.session_id))  # re-bound

    async def _release_session_on(self, worker_id: str, session_id: str) -> None:
        try:
            stub = await self.workers.stub(worker_id)
            await stub.ReleaseSession(worker_pb2.ReleaseSessionRequest(session_id=session_id), timeout=2.0)
        except (grpc.aio.AioRpcError, SplitserveError) as err:  # the pin's idle TTL frees it anyway
            log.info("releasing session %s on %s failed: %s", session_id, worker_id, err)

    async def _cancel_on(self, worker_id: str, request_id: str) -> None:
        try:
            stub = await self.workers.stub(worker_id)
            await stub.Cancel(types_pb2.CancelRequest(request_id=request_id, reason="finished early"), timeout=2.0)
        except (grpc.aio.AioRpcError, SplitserveError) as err:
            log.warning("cancelling %s on %s failed: %s", request_id, worker_id, err)

    async def _report(self, request, request_id: str, outcome: str, plan: types_pb2.Plan, output_tokens: int,
                      started: float) -> None:
        try:
            await self.placer.report_completion(scheduler_pb2.CompletionReport(
                request_id=request_id, session_id=request.session_id, finish_reason=outcome,
                prompt_tokens=len(request.prompt_token_ids), output_tokens=output_tokens,
                e2e_ms=(time.monotonic() - started) * 1000, worker_ids=[s.worker_id for s in plan.stages],
            ))
        except Exception as err:  # feedback must never fail a request
            log.warning("completion report for %s failed: %s", request_id, err)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for in-flight requests and background reports; then flush the records."""
        while self._calls:
            await asyncio.sleep(0.05)  # polling in-flight requests, bounded by the drain timeout
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.records.flush()


@dataclass
class _Calling:
    """The worker a request's attempt is talking to, so that a failure names the worker to avoid."""

    worker_id: str = ""


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed before it finished")
    return left


def _stage_dicts(plan: types_pb2.Plan | None) -> list[dict]:
    if plan is None:
        return []
    return [{"worker_id": s.worker_id, "start": s.start, "end": s.end, "emit": s.emit, "push_kv": s.push_kv}
            for s in plan.stages]
