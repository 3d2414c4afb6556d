"""The Coordinator service: Submit → Place → Execute stages → one stitched token stream.

The lifecycle itself lives in `services.coordinator.core.Coordinator`; this module is its
gRPC face and the process around it. `open_coordinator(config)` builds a ready
Coordinator (Redis, placement, worker directory, record writer) for this service and for
gateways that embed it (`--coordinator-address embedded`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import uuid
from typing import AsyncIterator

from services.coordinator.core import Coordinator
from services.coordinator.placement import LocalPlacer, Placer, SchedulerPlacer, check_placement
from services.coordinator.records import RequestRecordWriter
from services.coordinator.sessions import SessionLimits, SessionService
from services.coordinator.workers import WorkerDirectory
from splitserve.config import CoordinatorConfig, load_config
from splitserve.errors import SplitserveError, abort
from splitserve.proto import coordinator_pb2, coordinator_pb2_grpc, types_pb2
from splitserve.service import ServiceRuntime, open_channel, run
from splitserve.state.store import RedisRetryPolicy, StateStore, StateUnavailableError
from splitserve.telemetry import incoming_context, request_id_var

log = logging.getLogger(__name__)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """gRPC face of a Coordinator."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    async def Submit(self, request, context):
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        request_id_var.set(request.request_id)
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining or self.coordinator.config.request_timeout_s)
        try:
            async for chunk in self.coordinator.submit(request, deadline,
                                                       incoming_context(context.invocation_metadata())):
                yield chunk
        except SplitserveError as err:
            await abort(context, err)

    async def Ready(self, request: coordinator_pb2.ReadyRequest, context):
        remaining = context.time_remaining()
        ready, reason, count = await self.coordinator.ready(min(remaining or 1.0, 2.0), request.engine_family)
        return coordinator_pb2.ReadyResponse(ready=ready, reason=reason, eligible_workers=count)

    async def Cancel(self, request: types_pb2.CancelRequest, context):
        return types_pb2.CancelResponse(cancelled=self.coordinator.cancel(request.request_id))

    async def CreateSession(self, request: coordinator_pb2.CreateSessionRequest, context):
        try:
            session_id, ttl = await self.coordinator.open_session(request.session_id, request.ttl_s, request.owner)
        except SplitserveError as err:
            await abort(context, err)
        return coordinator_pb2.CreateSessionResponse(session_id=session_id, ttl_s=max(1, round(ttl)))

    async def DeleteSession(self, request: coordinator_pb2.DeleteSessionRequest, context):
        try:
            closed = await self.coordinator.close_session(request.session_id, request.owner)
        except SplitserveError as err:
            await abort(context, err)
        return coordinator_pb2.DeleteSessionResponse(closed=closed)


@contextlib.asynccontextmanager
async def open_coordinator(config: CoordinatorConfig) -> AsyncIterator[Coordinator]:
    """A started Coordinator for the `async with` body; raises StateUnavailableError / ValueError."""
    check_placement(config.placement)
    store = StateStore(config.redis_url, config.redis_prefix,
                       retry_policy=RedisRetryPolicy(attempts=max(1, config.redis_connect_attempts)))
    placer: Placer | None = None
    if config.placement == "local":  # ValueError for an unknown policy before any I/O
        placer = LocalPlacer.from_config(store, config.policy, config.split_ratio, config.view_refresh_s,
                                         config.policy_params, config.view_idle_refresh_s)
    workers = WorkerDirectory(store, config)
    records = RequestRecordWriter(store, config.request_record_ttl_s, config.record_flush_interval_s)
    async with contextlib.AsyncExitStack() as stack:
        await store.connect()
        stack.push_async_callback(store.close)
        if placer is None:
            placer = SchedulerPlacer(open_channel(config.scheduler_address, config))
        else:
            await placer.start()
        stack.push_async_callback(placer.close)
        await workers.start()
        stack.push_async_callback(workers.close)
        records.start()
        stack.push_async_callback(records.close)
        log.info("coordinator placement: %s", "scheduler at " + config.scheduler_address
                 if config.placement == "scheduler" else f"local policy {config.policy}")
        limits = SessionLimits(config.session_ttl_s, config.max_session_ttl_s, config.max_sessions_per_key,
                               config.max_session_history_tokens, config.request_timeout_s)
        yield Coordinator(config, placer, workers, records, SessionService(store, limits))


async def serve(config: CoordinatorConfig) -> None:
    """Run the coordinator until SIGTERM."""
    runtime = ServiceRuntime("coordinator", config, config.port)
    try:
        async with open_coordinator(config) as coordinator:
            coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), runtime.server)
            await runtime.start()
            await runtime.set_serving(True)
            await runtime.serve_until_signalled(drain=coordinator.drain)
    except StateUnavailableError as err:
        log.error("cannot reach Redis: %s", err)
        sys.exit(2)
    except ValueError as err:
        log.error("invalid coordinator configuration: %s", err)
        sys.exit(2)


def main(config: CoordinatorConfig | None = None) -> None:
    run(lambda: serve(config or load_config(CoordinatorConfig)))


if __name__ == "__main__":
    main()
