"""The Coordinator service: Submit → Place → Execute stages → one stitched token stream."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid

import grpc
from prometheus_client import Counter, Histogram

from splitserve.config import CoordinatorConfig, load_config
from splitserve.errors import DeadlineExceeded, InvalidArgument, SplitserveError, Unavailable, abort, from_rpc_error
from splitserve.proto import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    types_pb2,
    worker_pb2,
)
from splitserve.service import ServiceRuntime, insecure_channel, run
from splitserve.state import RedisRetryPolicy, RequestRecord, StateStore, StateUnavailableError
from splitserve.telemetry import outgoing_metadata, percentile_buckets, request_id_var
from services.coordinator.workers import WorkerDirectory

log = logging.getLogger(__name__)

REQUESTS = Counter("splitserve_coordinator_requests_total", "Requests finished, by outcome", ["outcome"])
PLACE_SECONDS = Histogram("splitserve_coordinator_place_seconds", "Time to get a plan", buckets=percentile_buckets(1.0))
TTFT = Histogram("splitserve_coordinator_ttft_seconds", "Submit to first token", buckets=percentile_buckets(30.0))
MIGRATIONS = Counter("splitserve_coordinator_migrations_total", "Requests continued on another worker after a failure")
E2E = Histogram("splitserve_coordinator_e2e_seconds", "Submit to last token", buckets=percentile_buckets(600.0))

# Placement is retried when a worker dies before producing a token.
MAX_PLACEMENT_ATTEMPTS = 3


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Owns each request's lifecycle from plan to the last token."""

    def __init__(self, config: CoordinatorConfig, store: StateStore, scheduler: scheduler_pb2_grpc.GlobalSchedulerStub,
                 workers: WorkerDirectory):
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.workers = workers
        self._calls: dict[str, grpc.aio.Call] = {}
        self._stages: dict[str, list[dict]] = {}  # request id -> its latest plan, for the request record
        self._background: set[asyncio.Task] = set()

    async def Submit(self, request: coordinator_pb2.SubmitRequest, context):
        request_id = request.request_id or uuid.uuid4().hex
        request_id_var.set(request_id)
        started = time.monotonic()
        deadline = started + (context.time_remaining() or self.config.request_timeout_s)
        emitted: list[int] = []
        outcome = "error"
        try:
            if not request.prompt_token_ids:
                raise InvalidArgument("prompt_token_ids must contain at least 1 token", param="prompt_token_ids")
            if request_id in self._calls:
                raise InvalidArgument(f"request_id {request_id!r} is already in flight", param="request_id")
            async for chunk in self._run(request, request_id, deadline, emitted):
                if emitted and len(emitted) == len(chunk.token_ids):
                    TTFT.observe(time.monotonic() - started)
                yield chunk
                if chunk.finish_reason:
                    outcome = chunk.finish_reason
        except SplitserveError as err:
            outcome = err.code.name.lower()
            await abort(context, err)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            REQUESTS.labels(outcome).inc()
            E2E.observe(time.monotonic() - started)
            self._spawn(self._finish(request, request_id, outcome, emitted, started))

    async def Cancel(self, request: types_pb2.CancelRequest, context):
        call = self._calls.get(request.request_id)
        if call is not None:
            call.cancel()
        return types_pb2.CancelResponse(cancelled=call is not None)

    # ---- lifecycle ----------------------------------------------------------------
    async def _run(self, request, request_id: str, deadline: float, emitted: list[int]):
        """Place and execute; on a worker failure, continue elsewhere from the tokens so far.

        Before the first token a failure simply re-places the request. After it, the
        request migrates: a new single stage recomputes the KV from prompt + emitted
        tokens (counter-based sampling keeps the output identical).
        """
        migration_deadline = None
        attempt = 0
        while True:
            attempt += 1
            plan = await self._place(request, request_id, deadline)
            if emitted:  # migrating: one stage, everything recomputed from tokens
                last = plan.stages[-1]
                del plan.stages[:]
                plan.stages.append(types_pb2.Stage(request_id=request_id, worker_id=last.worker_id, start=0,
                                                   end=last.end, emit=True))
            self._stages[request_id] = [_stage_dict(s) for s in plan.stages]
            await self.store.put_request(
                RequestRecord(request_id, "running", stages=self._stages[request_id], emitted_token_ids=list(emitted)),
                self.config.request_record_ttl_s,
            )
            try:
                async for chunk in self._execute(request, request_id, plan, deadline, emitted):
                    yield chunk
                return
            except Unavailable as err:
                # Free what the failed plan reserved before placing again, so a late cancel
                # cannot hit the next attempt on the same worker.
                await asyncio.gather(*(self._cancel_on(st.worker_id, request_id) for st in plan.stages))
                now = time.monotonic()
                if not emitted and attempt >= MAX_PLACEMENT_ATTEMPTS:
                    raise
                if emitted:
                    migration_deadline = migration_deadline or now + self.config.migration_timeout_s
                    if now > migration_deadline:
                        raise Unavailable(f"request could not be migrated after a worker failure: {err.message}")
                    MIGRATIONS.inc()
                log.warning("attempt %d failed after %d tokens (%s); placing again", attempt, len(emitted), err.message)
                await asyncio.sleep(min(0.05 * attempt, 0.5))  # back off while the registry drops the dead worker

    async def _place(self, request, request_id: str, deadline: float) -> types_pb2.Plan:
        sampling = request.sampling
        meta = types_pb2.RequestMeta(
            request_id=request_id, session_id=request.session_id, prompt_len=len(request.prompt_token_ids),
            max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else 16,
            slo=request.slo, priority=request.priority, arrival_unix_ms=time.time_ns() // 1_000_000,
        )
        t = time.monotonic()
        try:
            plan = await self.scheduler.Place(meta, timeout=_remaining(deadline), metadata=outgoing_metadata(request_id))
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        PLACE_SECONDS.observe(time.monotonic() - t)
        if not plan.stages:
            raise Unavailable("the scheduler returned an empty plan")
        return plan

    async def _wire_kv(self, request_id: str, stage: types_pb2.Stage, following: types_pb2.Stage,
                       deadline: float) -> None:
        """Reserve KV on the next stage's worker; stage pushes there, `following` reads it."""
        transfer_id = f"{request_id}:{stage.stage_index}"
        stub = await self.workers.stub(following.worker_id)
        try:
            reply = await stub.PrepareKv(worker_pb2.PrepareKvRequest(
                request_id=request_id, transfer_id=transfer_id, num_tokens=stage.end), timeout=_remaining(deadline))
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        if not reply.ok:  # no room there now: the next stage recomputes this range instead
            log.info("no KV reservation on %s (%s); the next stage recomputes", following.worker_id, reply.error)
            return
        stage.kv_sink.CopyFrom(types_pb2.KvSink(worker_id=following.worker_id, transfer_id=transfer_id,
                                                chunk_tokens=self.config.kv_chunk_tokens, block_ids=reply.block_ids))
        following.kv_sources.append(types_pb2.KvSource(worker_id=stage.worker_id, start=0, end=stage.end,
                                                       transfer_id=transfer_id))

    async def _execute(self, request, request_id: str, plan: types_pb2.Plan, deadline: float, emitted: list[int]):
        stages = list(plan.stages)
        for index, stage in enumerate(stages):
            stage.stage_index = index
            stage.prompt_token_ids[:] = request.prompt_token_ids
            stage.generated_token_ids[:] = emitted
            stage.sampling.CopyFrom(request.sampling)
            if index + 1 < len(stages):
                await self._wire_kv(request_id, stage, stages[index + 1], deadline)
            stub = await self.workers.stub(stage.worker_id)
            call = stub.Execute(stage, timeout=_remaining(deadline), metadata=outgoing_metadata(request_id))
            self._calls[request_id] = call
            try:
                async for chunk in call:
                    emitted.extend(chunk.token_ids)
                    if chunk.finish_reason == "stage_end":
                        if chunk.token_ids:  # the first stage's last token(s): still part of the output
                            chunk.finish_reason = ""
                            yield chunk
                        break  # the next stage continues the stream
                    yield chunk
                    if chunk.finish_reason:
                        if index + 1 < len(stages):  # finished early (EOS/stop): later stages never run
                            await self._cancel_on(stages[index + 1].worker_id, request_id)
                        return
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.CANCELLED and request_id not in self._calls:
                    return
                raise from_rpc_error(err) from None
            finally:
                self._calls.pop(request_id, None)
                call.cancel()  # no-op when finished; frees the worker's blocks when the caller left

    async def _cancel_on(self, worker_id: str, request_id: str) -> None:
        try:
            stub = await self.workers.stub(worker_id)
            await stub.Cancel(types_pb2.CancelRequest(request_id=request_id, reason="finished early"), timeout=2.0)
        except (grpc.aio.AioRpcError, SplitserveError) as err:
            log.warning("cancelling %s on %s failed: %s", request_id, worker_id, err)

    async def _finish(self, request, request_id: str, outcome: str, emitted: list[int], started: float) -> None:
        try:
            stages = self._stages.pop(request_id, [])
            await self.store.put_request(
                RequestRecord(request_id, outcome, stages=stages, emitted_token_ids=emitted),
                self.config.request_record_ttl_s,
            )
            await self.scheduler.ReportCompletion(scheduler_pb2.CompletionReport(
                request_id=request_id, session_id=request.session_id, finish_reason=outcome,
                prompt_tokens=len(request.prompt_token_ids), output_tokens=len(emitted),
                e2e_ms=(time.monotonic() - started) * 1000,
            ), timeout=5.0)
        except Exception as err:  # bookkeeping must never fail a request
            log.warning("completion bookkeeping for %s failed: %s", request_id, err)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        while self._calls:
            await asyncio.sleep(0.05)  # polling in-flight requests, bounded by the drain timeout
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed before it finished")
    return left


def _stage_dict(stage: types_pb2.Stage) -> dict:
    return {"worker_id": stage.worker_id, "start": stage.start, "end": stage.end, "emit": stage.emit}


async def serve(config: CoordinatorConfig) -> None:
    """Run the coordinator until SIGTERM."""
    runtime = ServiceRuntime("coordinator", config, config.port)
    store = StateStore(config.redis_url, config.redis_prefix,
                       retry_policy=RedisRetryPolicy(attempts=max(1, config.redis_connect_attempts)))
    try:
        await store.connect()
    except StateUnavailableError as err:
        log.error("cannot reach Redis: %s", err)
        sys.exit(2)
    channel = insecure_channel(config.scheduler_address, config)
    workers = WorkerDirectory(store, config)
    servicer = CoordinatorServicer(config, store, scheduler_pb2_grpc.GlobalSchedulerStub(channel), workers)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, runtime.server)
    await runtime.start()
    await runtime.set_serving(True)
    await runtime.serve_until_signalled(drain=servicer.drain)
    await workers.close()
    await channel.close()
    await store.close()


def main(config: CoordinatorConfig | None = None) -> None:
    run(lambda: serve(config or load_config(CoordinatorConfig)))


if __name__ == "__main__":
    main()
