"""Where the coordinator gets plans: the GlobalScheduler over gRPC, or the same policy in-process.

`SchedulerPlacer` asks the scheduler service (shared by every coordinator; required for
policies whose state must be global, and for SetPolicy at run time). `LocalPlacer` runs
the identical pure `PlacementPolicy` on a `ClusterViewSource` kept fresh from Redis in
the background, which removes a gRPC round trip (and the scheduler's CPU) from every
request; with several coordinators each then sees only its own in-flight placements until
the workers' next load snapshot (every `load_interval_s`, 100 ms by default).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import grpc
from opentelemetry.context import Context
from prometheus_client import Counter

from services.global_scheduler import metrics as scheduler_metrics
from services.global_scheduler.policy import (NoWorkerAvailable, PlacementPolicy, configured_policy_params,
                                              learns_from_completions, make_policy)
from services.global_scheduler.server import (
    completion_from_proto,
    placement_request_from_meta,
    placement_to_plan,
)
from services.global_scheduler.view import ClusterViewSource
from splitserve.errors import Unavailable, connection_failure, from_rpc_error
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc, types_pb2
from splitserve.core.records import engine_family as engine_family_of
from splitserve.state.store import StateStore
from splitserve.telemetry import outgoing_metadata

log = logging.getLogger(__name__)

SCHEDULER_WAITS = Counter("splitserve_coordinator_scheduler_waits_total",
                          "Place calls sent again after the scheduler could not be reached (restarting)")

PLACEMENTS = ("scheduler", "local")


class Placer(Protocol):
    """Plans requests and hands finished ones back to policies that learn from them."""

    async def place(self, meta: types_pb2.RequestMeta, timeout_s: float,
                    trace_context: Context | None = None) -> types_pb2.Plan: ...

    async def eligible_workers(self, timeout_s: float, engine_family: str = "") -> int:
        """Workers of `engine_family` placement may use now (readiness: none means a request would fail)."""
        ...

    async def report_completion(self, report: scheduler_pb2.CompletionReport) -> None: ...

    async def close(self) -> None: ...


class SchedulerPlacer:
    """Plans from the GlobalScheduler service.

    A scheduler that is down (killed, restarting) is waited for: a Place the channel could
    not deliver is sent again once the scheduler accepts connections, within the request's
    deadline and at most `wait_s` in all, so requests arriving during a scheduler restart
    are delayed rather than failed. An UNAVAILABLE the scheduler itself answered (no
    eligible worker) is passed on at once: the caller decides whether to retry.
    """

    def __init__(self, channel: grpc.aio.Channel, wait_s: float = 10.0):
        self.channel = channel
        self.stub = scheduler_pb2_grpc.GlobalSchedulerStub(channel)
        self.wait_s = wait_s

    async def place(self, meta: types_pb2.RequestMeta, timeout_s: float,
                    trace_context: Context | None = None) -> types_pb2.Plan:
        give_up = time.monotonic() + min(timeout_s, self.wait_s)
        end = time.monotonic() + timeout_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self.stub.Place(meta, timeout=max(0.001, end - time.monotonic()),
                                             metadata=outgoing_metadata(meta.request_id, trace_context))
            except grpc.aio.AioRpcError as err:
                if not (err.code() == grpc.StatusCode.UNAVAILABLE and connection_failure(err, self.channel)):
                    raise from_rpc_error(err) from None
                left = give_up - time.monotonic()
                if left <= 0:
                    raise from_rpc_error(err) from None
                if attempt == 1:
                    log.warning("scheduler unreachable (%s); waiting up to %.1f s for it", err.details(), left)
                SCHEDULER_WAITS.inc()
                # A backoff, not synchronisation: each try fails at once until the channel reconnects.
                await asyncio.sleep(min(0.02 * 2 ** attempt, 0.25, left))

    async def eligible_workers(self, timeout_s: float, engine_family: str = "") -> int:
        try:
            state = await self.stub.ClusterState(scheduler_pb2.ClusterStateRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return sum(1 for load in state.workers
                   if not load.draining and engine_family_of(load.engine_kind) == engine_family)

    async def report_completion(self, report: scheduler_pb2.CompletionReport) -> None:
        await self.stub.ReportCompletion(report, timeout=5.0)

    async def close(self) -> None:
        await self.channel.close()


class LocalPlacer:
    """Runs a placement policy in this process over a background-refreshed cluster view."""

    def __init__(self, store: StateStore, policy: PlacementPolicy, view_refresh_s: float,
                 view_timeout_s: float = 2.0, view_idle_refresh_s: float = 0.0):
        self.policy = policy
        self.views = ClusterViewSource(store, view_refresh_s, idle_refresh_s=view_idle_refresh_s)
        self.view_timeout_s = view_timeout_s

    @classmethod
    def from_config(cls, store: StateStore, policy_name: str, split_ratio: float,
                    view_refresh_s: float, policy_params: str = "",
                    view_idle_refresh_s: float = 0.0) -> "LocalPlacer":
        """ValueError for an unknown policy or bad parameters, before any I/O."""
        params = configured_policy_params(policy_name, split_ratio, policy_params)
        return cls(store, make_policy(policy_name, **params), view_refresh_s,
                   view_idle_refresh_s=view_idle_refresh_s)

    async def start(self) -> None:
        await self.views.start()

    async def place(self, meta: types_pb2.RequestMeta, timeout_s: float,
                    trace_context: Context | None = None) -> types_pb2.Plan:
        request = placement_request_from_meta(meta)  # traced by the caller's coordinator.place span
        started = time.perf_counter()
        try:
            placement = await self.views.place(self.policy, request, time.time, min(timeout_s, self.view_timeout_s))
        except NoWorkerAvailable:
            scheduler_metrics.NO_WORKER.labels(self.policy.name).inc()
            raise
        scheduler_metrics.PLACE_SECONDS.labels(self.policy.name).observe(time.perf_counter() - started)
        scheduler_metrics.observe_decision(self.policy.name, placement.decision)
        plan = placement_to_plan(meta.request_id, placement)
        plan.report_completion = learns_from_completions(self.policy)
        return plan

    async def eligible_workers(self, timeout_s: float, engine_family: str = "") -> int:
        view = (await self.views.current(min(timeout_s, self.view_timeout_s))).of_family(engine_family)
        if not view.eligible:  # one that registered since the last background refresh counts at once
            await self.views.refresh()
            view = (await self.views.current(min(timeout_s, self.view_timeout_s))).of_family(engine_family)
        return len(view.eligible)

    async def report_completion(self, report: scheduler_pb2.CompletionReport) -> None:
        if learns_from_completions(self.policy):
            try:
                self.policy.on_completion(completion_from_proto(report))
            except Exception:  # feedback is advisory
                log.exception("policy %s failed to learn from %s", self.policy.name, report.request_id)

    async def close(self) -> None:
        await self.views.stop()




def check_placement(name: str) -> None:
    if name not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {name!r}")


__all__ = ["LocalPlacer", "PLACEMENTS", "Placer", "SchedulerPlacer", "Unavailable", "check_placement"]
