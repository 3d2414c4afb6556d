"""The GlobalScheduler gRPC service: Place, ReportCompletion, ClusterState, SetPolicy.

Run it with `python -m services.global_scheduler.server` (config from SPLITSERVE_* env
vars), `main(config)`, or in-process with `start_scheduler(config)` (tests: port 0, then
read `handle.port`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
from opentelemetry.trace import SpanKind

from services.global_scheduler import metrics
from services.global_scheduler.policy import (
    ClusterView,
    CompletionReport,
    NoWorkerAvailable,
    Placement,
    PlacementPolicy,
    PlacementRequest,
    configured_policy_params,
    known_policies,
    learns_from_completions,
    make_policy,
)
from services.global_scheduler.pool_control import PoolControlLoop
from services.global_scheduler.view import ClusterViewSource
from splitserve.config import SchedulerConfig, load_config
from splitserve.core.designs import resolve_design
from splitserve.errors import InvalidArgument, SplitserveError, abort
from splitserve.request_rules import check_prompt_len, check_request_id, check_token_positions
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc, types_pb2
from splitserve.service import ServiceRuntime, channel_factory, run
from splitserve.telemetry import end_span, incoming_context, start_span
from splitserve.wire import load_to_proto
from splitserve.state.store import RedisRetryPolicy, StateStore, StateUnavailableError
from splitserve.core.records import DIFFUSION

log = logging.getLogger(__name__)

SERVICE_NAME = "scheduler"
# The health service name clients of this proto service check.
GRPC_SERVICE_NAME = "splitserve.v1.GlobalScheduler"
# Plans cover prompt_len + RequestMeta.max_tokens; callers that leave it unset get the
# predicted output length or SamplingParams' own default.
DEFAULT_MAX_TOKENS = 16
ENGINE_FAMILIES = ("", DIFFUSION)  # RequestMeta.engine_family: autoregressive, diffusion


def placement_request_from_meta(meta: types_pb2.RequestMeta) -> PlacementRequest:
    """Validate a RequestMeta and turn it into a PlacementRequest; InvalidArgument names the field."""
    if not meta.request_id:
        raise InvalidArgument("request_id must not be empty", param="request_id")
    check_request_id(meta.request_id)
    check_prompt_len(meta.prompt_len, param="prompt_len")
    if meta.history_len > meta.prompt_len:
        raise InvalidArgument(
            f"history_len {meta.history_len} exceeds prompt_len {meta.prompt_len}", param="history_len"
        )
    if meta.engine_family not in ENGINE_FAMILIES:
        raise InvalidArgument(f"engine_family must be one of {ENGINE_FAMILIES}, got {meta.engine_family[:64]!r}",
                              param="engine_family")
    # Presence, not the value, tells a client's hint (0 included) from no hint.
    hint = meta.predicted_output_len if meta.HasField("predicted_output_len") else None
    max_tokens = meta.max_tokens or hint or DEFAULT_MAX_TOKENS
    check_token_positions(meta.prompt_len, max_tokens)
    return PlacementRequest(
        request_id=meta.request_id,
        session_id=meta.session_id,
        prompt_len=meta.prompt_len,
        history_len=meta.history_len,
        bound_worker=meta.bound_worker,
        predicted_output_len=hint,
        max_tokens=max_tokens,
        slo_ttft_ms=meta.slo.ttft_ms,
        slo_itl_ms=meta.slo.itl_ms,
        priority=meta.priority,
        avoid_workers=tuple(meta.avoid_workers),
        engine_family=meta.engine_family,
    )


def placement_to_plan(request_id: str, placement: Placement) -> types_pb2.Plan:
    """Placement -> Plan proto; only the last stage emits tokens to the client."""
    last = len(placement.stages) - 1
    stages = [
        types_pb2.Stage(request_id=request_id, stage_index=index, worker_id=stage.worker_id,
                        start=stage.start, end=stage.end, emit=index == last,
                        push_kv=stage.push_kv and index < last)
        for index, stage in enumerate(placement.stages)
    ]
    return types_pb2.Plan(stages=stages, policy=placement.policy, reason=placement.reason,
                          decision=dict(placement.decision))


def completion_from_proto(report: scheduler_pb2.CompletionReport) -> CompletionReport:
    """CompletionReport message -> the plain record policies receive."""
    return CompletionReport(
        request_id=report.request_id,
        session_id=report.session_id,
        finish_reason=report.finish_reason,
        prompt_tokens=report.prompt_tokens,
        output_tokens=report.output_tokens,
        ttft_ms=report.ttft_ms,
        mean_itl_ms=report.mean_itl_ms,
        e2e_ms=report.e2e_ms,
        worker_ids=tuple(report.worker_ids),
        error=report.error,
    )


def view_to_worker_loads(view: ClusterView) -> list[types_pb2.WorkerLoad]:
    """The view's workers as WorkerLoad messages."""
    return [load_to_proto(w.load) for w in view.workers]


class GlobalSchedulerServicer(scheduler_pb2_grpc.GlobalSchedulerServicer):
    """Places requests with the active policy over the in-memory cluster view."""

    def __init__(self, views: ClusterViewSource, policy: PlacementPolicy, *,
                 clock: Callable[[], float] = time.time, view_timeout_s: float = 2.0,
                 on_policy_change: Callable[[PlacementPolicy], Awaitable[None]] | None = None) -> None:
        self.views = views
        self.policy = policy
        self.clock = clock
        self.view_timeout_s = view_timeout_s
        self.on_policy_change = on_policy_change  # e.g. start or stop LAPS' pool controller

    async def Place(self, request: types_pb2.RequestMeta, context: grpc.aio.ServicerContext) -> types_pb2.Plan:
        policy = self.policy
        span = start_span("scheduler.place", incoming_context(context.invocation_metadata()), kind=SpanKind.SERVER,
                          attributes={"splitserve.request_id": request.request_id, "splitserve.policy": policy.name,
                                      "splitserve.prompt_len": request.prompt_len})
        try:
            placement_request = placement_request_from_meta(request)
            started = time.perf_counter()
            placement = await self.views.place(policy, placement_request, self.clock, self.view_timeout_s)
            metrics.PLACE_SECONDS.labels(policy.name).observe(time.perf_counter() - started)
            metrics.observe_decision(policy.name, placement.decision)
        except NoWorkerAvailable as err:
            metrics.NO_WORKER.labels(policy.name).inc()
            end_span(span, err)
            await abort(context, err)
        except SplitserveError as err:
            end_span(span, err)
            await abort(context, err)
        except BaseException as err:  # cancelled (the caller's deadline) or a policy bug: the span ends too
            end_span(span, err if not isinstance(err, asyncio.CancelledError) else None)
            raise
        span.set_attribute("splitserve.workers", list(placement.worker_ids))
        span.set_attribute("splitserve.reason", placement.reason)
        end_span(span)
        for worker_id in placement.worker_ids:
            metrics.PLACEMENTS.labels(placement.policy, worker_id).inc()
        log.debug("placed %s on %s (%s: %s)", request.request_id, placement.worker_ids,
                  placement.policy, placement.reason, extra={"request_id": request.request_id})
        plan = placement_to_plan(request.request_id, placement)
        plan.report_completion = learns_from_completions(policy)
        return plan

    async def ReportCompletion(self, request: scheduler_pb2.CompletionReport,
                               context: grpc.aio.ServicerContext) -> types_pb2.Ack:
        if not request.request_id:
            await abort(context, InvalidArgument("request_id must not be empty", param="request_id"))
        metrics.COMPLETIONS.labels(metrics.finish_reason_label(request.finish_reason)).inc()
        policy = self.policy
        if learns_from_completions(policy):
            try:
                policy.on_completion(completion_from_proto(request))
            except Exception:  # feedback is advisory: a policy bug must not fail the caller
                log.exception("policy %s failed to learn from %s", policy.name, request.request_id)
        return types_pb2.Ack()

    async def ClusterState(self, request: scheduler_pb2.ClusterStateRequest,
                           context: grpc.aio.ServicerContext) -> scheduler_pb2.ClusterStateResponse:
        try:
            view = await self.views.current(self.view_timeout_s)
        except SplitserveError as err:
            await abort(context, err)
        return scheduler_pb2.ClusterStateResponse(workers=view_to_worker_loads(view), policy=self.policy.name)

    async def SetPolicy(self, request: scheduler_pb2.SetPolicyRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.SetPolicyResponse:
        if request.policy not in known_policies():
            await abort(context, InvalidArgument(
                f"unknown placement policy {request.policy!r}; known: {', '.join(known_policies())}",
                param="policy"))
        try:
            new_policy = make_policy(request.policy, **dict(request.params))
        except ValueError as err:
            await abort(context, InvalidArgument(str(err), param="params"))
        previous, self.policy = self.policy, new_policy
        if self.on_policy_change is not None:
            await self.on_policy_change(new_policy)
        metrics.POLICY_SWITCHES.labels(new_policy.name).inc()
        log.info("placement policy switched from %s to %s", previous.name, new_policy.name)
        return scheduler_pb2.SetPolicyResponse(previous_policy=previous.name, policy=new_policy.name)


@dataclass
class SchedulerHandle:
    """A running scheduler service in this process."""

    config: SchedulerConfig
    runtime: ServiceRuntime
    servicer: GlobalSchedulerServicer
    views: ClusterViewSource
    store: StateStore
    pool_control: PoolControlLoop | None = None  # LAPS' pool controller, while the policy has one

    @property
    def port(self) -> int:
        """The bound gRPC port (the real one when config.port is 0)."""
        return self.runtime.bound_port

    @property
    def address(self) -> str:
        """host:port to dial."""
        return f"{self.config.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        """Health status of the server and of the GlobalScheduler service."""
        await self.runtime.set_serving(serving)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving, stop the server, the view refresh and the Redis connections."""
        await self.set_serving(False)
        await self.runtime.server.stop(grace_s)
        await self.release()

    async def release(self) -> None:
        """Stop the pool controller, the view refresh and the Redis connections (after the server stopped)."""
        await self.use_policy(None)
        await self.views.stop()
        await self.store.close()

    async def use_policy(self, policy: PlacementPolicy | None) -> None:
        """Run the pool controller `policy` asks for (LAPS: `pool_controller()`), stopping any other."""
        if self.pool_control is not None:
            await self.pool_control.stop()
            self.pool_control = None
        boundary = getattr(policy, "boundary", None)  # LAPS' L_m(H), for the metrics
        if boundary is not None:
            for history in (0, 1024, 8192):
                l_m = boundary.tokens(history)
                metrics.LENGTH_BOUNDARY.labels(str(history)).set(l_m if l_m != float("inf") else -1.0)
        make_controller = getattr(policy, "pool_controller", None)
        controller = make_controller() if make_controller is not None else None
        if controller is not None:
            self.views.with_signals = True  # its SLA term reads the workers' windowed TTFT
            holder = f"scheduler@{self.address}#{os.getpid()}"
            self.pool_control = PoolControlLoop(self.views, self.store, controller, holder,
                                                channel_factory=channel_factory(self.config))
            self.pool_control.start()


async def start_scheduler(config: SchedulerConfig) -> SchedulerHandle:
    """Connect to Redis, load the first cluster view, start serving; raises StateUnavailableError."""
    runtime = ServiceRuntime(SERVICE_NAME, config, config.port, GRPC_SERVICE_NAME)  # first: it configures logging
    # --policy, else the --design's placement (its workers take the design's local batching).
    placement = resolve_design(config.policy, design=config.design).placement
    params = configured_policy_params(placement, config.split_ratio, config.policy_params)
    policy = make_policy(placement, **params)  # ValueError before touching Redis
    store = StateStore(config.redis_url, config.redis_prefix,
                       retry_policy=RedisRetryPolicy(attempts=config.redis_connect_attempts))
    views = ClusterViewSource(store, config.view_refresh_s, idle_refresh_s=config.view_idle_refresh_s)
    try:
        await store.connect()
        await views.start()
        servicer = GlobalSchedulerServicer(views, policy)
        scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(servicer, runtime.server)
        await runtime.start()
    except BaseException:
        await views.stop()
        await store.close()
        raise
    handle = SchedulerHandle(config, runtime, servicer, views, store)
    servicer.on_policy_change = handle.use_policy
    await handle.use_policy(policy)
    await handle.set_serving(True)
    log.info("global scheduler serving on %s with policy %s (prefix %r)",
             handle.address, policy.name, config.redis_prefix)
    return handle


async def serve(config: SchedulerConfig, runtime_ready: asyncio.Event | None = None) -> None:
    """Run the scheduler until SIGTERM; exits non-zero when Redis or the policy is unusable."""
    try:
        handle = await start_scheduler(config)
    except StateUnavailableError as err:
        log.error("global scheduler cannot start: Redis state store unreachable: %s", err)
        raise SystemExit(2) from None
    except ValueError as err:
        log.error("global scheduler cannot start: %s", err)
        raise SystemExit(2) from None
    if runtime_ready is not None:
        runtime_ready.set()

    async def mark_not_serving() -> None:
        await handle.set_serving(False)

    try:
        await handle.runtime.serve_until_signalled(drain=mark_not_serving)
    finally:
        await handle.release()


def main(config: SchedulerConfig) -> None:
    """Run the scheduler service process."""
    run(lambda: serve(config))


if __name__ == "__main__":
    main(load_config(SchedulerConfig))
