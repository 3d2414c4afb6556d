"""The GlobalScheduler service in-process over real gRPC, with real Redis state.

Every test gets its own key prefix (deleted afterwards) and its own scheduler on a free
port. pytest-asyncio is not a dependency: each test runs one coroutine with asyncio.run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from redis_support import REDIS_URL, delete_prefixed
from services.global_scheduler.server import SchedulerHandle, serve, start_scheduler
from services.global_scheduler.view import ClusterViewSource
from splitserve.config import SchedulerConfig, load_config
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc, types_pb2
from splitserve.state.store import RedisRetryPolicy, StateStore, WorkerInfo, WorkerLoad

REPO_ROOT = Path(__file__).resolve().parents[2]
LONG_TTL_S = 30.0  # outlives every test; expiry is triggered explicitly where tested


@pytest.fixture
def prefix() -> Any:
    """A key prefix no other test uses; its keys are deleted afterwards."""
    unique = f"sstest:sched:{uuid.uuid4().hex}:"
    yield unique
    asyncio.run(delete_prefixed(unique))


def scheduler_config(prefix: str, **overrides: Any) -> SchedulerConfig:
    values = dict(redis_url=REDIS_URL, redis_prefix=prefix, port=0, metrics_port=0, host="127.0.0.1",
                  policy="round_robin", view_refresh_s=0.02, log_json=False, redis_connect_attempts=2)
    values.update(overrides)
    return load_config(SchedulerConfig, values, environ={})  # type: ignore[return-value]


class Cluster:
    """A scheduler under test, a channel to it, and a store to fake workers' Redis records."""

    def __init__(self, handle: SchedulerHandle, channel: grpc.aio.Channel, store: StateStore):
        self.handle = handle
        self.channel = channel
        self.store = store
        self.scheduler = scheduler_pb2_grpc.GlobalSchedulerStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def add_worker(self, worker_id: str, *, role: str = "both", free: int = 100, running: int = 0,
                         draining: bool = False) -> None:
        """Register a worker record and publish its load, as a live worker would."""
        await self.store.register_worker(
            WorkerInfo(worker_id, f"127.0.0.1:{60000 + len(worker_id)}", role=role, engine_kind="emulated"),
            ttl_s=LONG_TTL_S)
        await self.store.publish_load(
            WorkerLoad(worker_id, role=role, engine_kind="emulated", free_blocks=free, total_blocks=100,
                               block_size=16, running=running, draining=draining), ttl_s=LONG_TTL_S)

    async def place(self, request_id: str = "r", prompt_len: int = 10, predicted: int = 5) -> types_pb2.Plan:
        meta = types_pb2.RequestMeta(request_id=request_id, prompt_len=prompt_len, predicted_output_len=predicted)
        return await self.scheduler.Place(meta, timeout=5)

    async def placed_worker(self, request_id: str = "r") -> str:
        plan = await self.place(request_id)
        assert len(plan.stages) == 1
        return plan.stages[0].worker_id

    async def worker_ids_in_state(self) -> list[str]:
        state = await self.scheduler.ClusterState(scheduler_pb2.ClusterStateRequest(), timeout=5)
        return [w.worker_id for w in state.workers]


@contextlib.asynccontextmanager
async def running_cluster(prefix: str, **overrides: Any) -> AsyncIterator[Cluster]:
    store = StateStore(REDIS_URL, prefix, retry_policy=RedisRetryPolicy(attempts=2, base_delay_s=0.05))
    await store.connect()
    handle = await start_scheduler(scheduler_config(prefix, **overrides))
    channel = grpc.aio.insecure_channel(handle.address)
    try:
        yield Cluster(handle, channel, store)
    finally:
        await channel.close()
        await handle.stop(grace_s=0)
        await store.close()


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll `check` until it returns True; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what or check}")
        await asyncio.sleep(0.02)


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await call
    return excinfo.value


def counter_value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- tests -------------------------------------------------------------------------


def test_place_follows_the_policy_and_set_policy_switches_it(prefix):
    async def scenario() -> None:
        async with running_cluster(prefix, policy="round_robin") as cluster:
            await cluster.add_worker("w-a", free=10, running=5)  # busy
            await cluster.add_worker("w-b")
            await eventually(lambda: _has_workers(cluster, 2), what="both workers in the view")

            plan = await cluster.place("req-1", prompt_len=12, predicted=7)
            assert plan.policy == "round_robin"
            assert not plan.report_completion  # baselines take no feedback: no ReportCompletion RPC
            [stage] = plan.stages
            assert (stage.request_id, stage.stage_index, stage.start, stage.end, stage.emit) == ("req-1", 0, 0, 19, True)
            picks = [stage.worker_id] + [await cluster.placed_worker(f"req-{n}") for n in range(2, 5)]
            assert picks == ["w-a", "w-b", "w-a", "w-b"]

            switched = await cluster.scheduler.SetPolicy(scheduler_pb2.SetPolicyRequest(policy="least_loaded"))
            assert (switched.previous_policy, switched.policy) == ("round_robin", "least_loaded")
            state = await cluster.scheduler.ClusterState(scheduler_pb2.ClusterStateRequest())
            assert state.policy == "least_loaded"
            before = counter_value("splitserve_scheduler_placements_total", policy="least_loaded", worker_id="w-b")
            for n in range(3):  # the busy worker stays more loaded even with inflight counted
                plan = await cluster.place(f"ll-{n}")
                assert (plan.policy, plan.stages[0].worker_id) == ("least_loaded", "w-b")
            after = counter_value("splitserve_scheduler_placements_total", policy="least_loaded", worker_id="w-b")
            assert after - before == 3

    asyncio.run(scenario())


async def _has_workers(cluster: Cluster, count: int) -> bool:
    return len(await cluster.worker_ids_in_state()) == count


def test_cluster_state_lists_workers_with_their_load(prefix):
    async def scenario() -> None:
        async with running_cluster(prefix) as cluster:
            await cluster.add_worker("w-a", free=40, running=3)
            await cluster.add_worker("w-b", role="prefill", draining=True)
            await eventually(lambda: _has_workers(cluster, 2), what="both workers in the view")
            state = await cluster.scheduler.ClusterState(scheduler_pb2.ClusterStateRequest())
            assert state.policy == "round_robin"
            a, b = state.workers
            assert (a.worker_id, a.role, a.engine_kind, a.free_blocks, a.total_blocks, a.block_size, a.running,
                    a.draining) == ("w-a", "both", "emulated", 40, 100, 16, 3, False)
            assert (b.worker_id, b.role, b.draining) == ("w-b", "prefill", True)
            # The draining worker is listed but never placed on.
            assert {await cluster.placed_worker(f"r{n}") for n in range(4)} == {"w-a"}

    asyncio.run(scenario())


def test_bad_input_is_invalid_argument_naming_the_field(prefix):
    async def scenario() -> None:
        async with running_cluster(prefix) as cluster:
            await cluster.add_worker("w-a")
            cases = [
                (cluster.place(request_id=""), "request_id"),
                (cluster.place(prompt_len=0), "prompt_len"),
                (cluster.scheduler.Place(types_pb2.RequestMeta(request_id="r", prompt_len=4, history_len=5)),
                 "history_len"),
                (cluster.scheduler.SetPolicy(scheduler_pb2.SetPolicyRequest(policy="fastest_possible")),
                 "fastest_possible"),
                (cluster.scheduler.SetPolicy(scheduler_pb2.SetPolicyRequest(
                    policy="least_loaded", params={"request_scale": "-1"})), "request_scale"),
                (cluster.scheduler.ReportCompletion(scheduler_pb2.CompletionReport()), "request_id"),
            ]
            for call, field in cases:
                err = await rpc_error(call)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err)
                assert field in err.details(), (field, err.details())
            state = await cluster.scheduler.ClusterState(scheduler_pb2.ClusterStateRequest())
            assert state.policy == "round_robin"  # a rejected SetPolicy changes nothing

    asyncio.run(scenario())


def test_no_eligible_worker_is_unavailable(prefix):
    async def scenario() -> None:
        async with running_cluster(prefix) as cluster:
            before = counter_value("splitserve_scheduler_no_worker_total", policy="round_robin")
            err = await rpc_error(cluster.place())
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert counter_value("splitserve_scheduler_no_worker_total", policy="round_robin") == before + 1

            await cluster.add_worker("w-a", draining=True)
            await eventually(lambda: _has_workers(cluster, 1), what="the draining worker in the view")
            err = await rpc_error(cluster.place())
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()

    asyncio.run(scenario())


def test_worker_registered_since_the_last_refresh_is_placed_at_once(prefix):
    """No eligible worker in the view: Place re-reads Redis once before answering UNAVAILABLE."""

    async def scenario() -> None:
        # A background refresh that never comes during the test: only the re-read can see w-a.
        async with running_cluster(prefix, view_refresh_s=60.0) as cluster:
            await cluster.add_worker("w-a")
            assert await cluster.placed_worker() == "w-a"
            assert await cluster.worker_ids_in_state() == ["w-a"]

    asyncio.run(scenario())


def test_concurrent_refreshes_share_one_redis_read(prefix):
    async def scenario() -> None:
        async with StateStore(REDIS_URL, prefix) as store:
            views = ClusterViewSource(store, refresh_s=60.0)
            reads = 0
            original = store.list_workers

            async def counted_list_workers():
                nonlocal reads
                reads += 1
                return await original()

            store.list_workers = counted_list_workers  # type: ignore[method-assign]
            await asyncio.gather(*(views.refresh() for _ in range(8)))
            assert reads == 1
            await views.refresh()
            assert reads == 2

    asyncio.run(scenario())


def test_health_reports_serving(prefix):
    async def scenario() -> None:
        async with running_cluster(prefix) as cluster:
            for service in ("", "splitserve.v1.GlobalScheduler"):
                reply = await cluster.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, service

    asyncio.run(scenario())


def test_report_completion_is_acknowledged_and_counted(prefix):
    async def scenario() -> None:
        async with running_cluster(prefix) as cluster:
            before = counter_value("splitserve_scheduler_completions_total", finish_reason="length")
            report = scheduler_pb2.CompletionReport(request_id="r", finish_reason="length", prompt_tokens=10,
                                                    output_tokens=5, worker_ids=["w-a"])
            assert isinstance(await cluster.scheduler.ReportCompletion(report), types_pb2.Ack)
            assert counter_value("splitserve_scheduler_completions_total", finish_reason="length") == before + 1

    asyncio.run(scenario())


def test_worker_with_expired_heartbeat_disappears_from_placements(prefix):
    async def scenario() -> None:
        async with running_cluster(prefix, policy="round_robin") as cluster:
            await cluster.add_worker("w-a")
            await cluster.add_worker("w-b")
            await eventually(lambda: _has_workers(cluster, 2), what="both workers in the view")
            assert {await cluster.placed_worker(f"r{n}") for n in range(4)} == {"w-a", "w-b"}

            # w-a's last heartbeat: its registration now lapses in 0.2 s and is not renewed.
            assert await cluster.store.heartbeat("w-a", ttl_s=0.2)

            async def only_w_b_placed() -> bool:
                picks = {await cluster.placed_worker(f"after-{uuid.uuid4().hex[:6]}") for _ in range(3)}
                return picks == {"w-b"}

            await eventually(only_w_b_placed, what="w-a to leave the placements")
            assert await cluster.worker_ids_in_state() == ["w-b"]

    asyncio.run(scenario())


def test_view_source_counts_placements_until_the_next_load_snapshot(prefix):
    async def scenario() -> None:
        async with StateStore(REDIS_URL, prefix) as store:
            for worker_id in ("w-a", "w-b"):
                await store.register_worker(WorkerInfo(worker_id, "127.0.0.1:1"), ttl_s=LONG_TTL_S)
                await store.publish_load(WorkerLoad(worker_id, updated_unix=100.0), ttl_s=LONG_TTL_S)
            views = ClusterViewSource(store, refresh_s=0.02)
            await views.start()
            try:
                views.note_placed(["w-a", "w-a", "w-b"])
                view = await views.current()
                assert [w.inflight_assigned for w in view.workers] == [2, 1]
                await store.publish_load(WorkerLoad("w-a", updated_unix=101.0), ttl_s=LONG_TTL_S)

                async def w_a_reset() -> bool:
                    return [w.inflight_assigned for w in (await views.current()).workers] == [0, 1]

                await eventually(w_a_reset, what="w-a's counter to reset on its new snapshot")
            finally:
                await views.stop()

    asyncio.run(scenario())


def test_view_source_reads_windowed_latencies_and_prefill_queues_for_ampd(prefix):
    # AMPD's routing reads each worker's windowed TTFT/ITL and prefill queue from Redis
    # (§3); the view carries them once a policy that asks for them places a request.
    from services.global_scheduler.ampd import AmpdPolicy
    from services.global_scheduler.policy import PlacementRequest
    from splitserve.state.store import PrefillTask

    async def scenario() -> None:
        async with StateStore(REDIS_URL, prefix, latency_window_s=10.0) as store:
            now = time.time()
            for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
                await store.register_worker(WorkerInfo(worker_id, "127.0.0.1:1", role=role), ttl_s=LONG_TTL_S)
                await store.publish_load(WorkerLoad(worker_id, role=role, free_blocks=10, total_blocks=10,
                                                    updated_unix=now), ttl_s=LONG_TTL_S)
            await store.record_latencies("p0", [0.5, 0.7], [], now - 1)
            await store.record_latencies("p0", [9.0], [], now - 60)  # outside the window
            await store.record_latencies("d0", [], [0.02, 0.04], now - 1)
            await store.publish_prefill_queue("p0", [PrefillTask("t1", 0, 4000, now)], ttl_s=LONG_TTL_S)
            views = ClusterViewSource(store, refresh_s=60.0)
            await views.start()
            try:
                assert all(w.signals is None for w in (await views.current()).workers)  # not asked for yet
                policy = AmpdPolicy(perf_model="H100/llama-3-8b")
                placement = await views.place(
                    policy, PlacementRequest("r", 1000, 10, slo_ttft_ms=350, slo_itl_ms=40), time.time)
                view = await views.current()
                p0, d0 = view.get("p0"), view.get("d0")
                assert p0.signals.ttft_mean_s == pytest.approx(0.6) and p0.signals.itl_mean_s is None
                assert [t.l_incr for t in p0.signals.prefill_queue] == [4000]
                assert d0.signals.itl_mean_s == pytest.approx(0.03) and d0.signals.prefill_queue == ()
                # p0's 600 ms is past 0.9 x 350 ms and d0's 30 ms within 0.85 x 40 ms: local.
                assert placement.worker_ids == ("d0",) and placement.decision["rule"] == 2.0
            finally:
                await views.stop()

    asyncio.run(scenario())


def test_serve_exits_non_zero_when_redis_is_unreachable(prefix):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    config = scheduler_config(prefix, redis_url=f"redis://127.0.0.1:{dead_port}/0", redis_connect_attempts=1)
    with pytest.raises(SystemExit) as excinfo:
        asyncio.run(serve(config))
    assert excinfo.value.code != 0


def test_module_runs_as_a_process_and_drains_on_sigterm(prefix):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "SPLITSERVE_REDIS_URL": REDIS_URL, "SPLITSERVE_REDIS_PREFIX": prefix,
           "SPLITSERVE_SCHEDULER_PORT": str(port), "SPLITSERVE_SCHEDULER_METRICS_PORT": "0",
           "SPLITSERVE_SCHEDULER_POLICY": "least_loaded", "SPLITSERVE_LOG_JSON": "false"}
    process = subprocess.Popen([sys.executable, "-m", "services.global_scheduler.server"], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        async def wait_serving() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)

                async def serving() -> bool:
                    assert process.poll() is None, "scheduler process exited early"
                    try:
                        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    except grpc.aio.AioRpcError:
                        return False
                    return reply.status == health_pb2.HealthCheckResponse.SERVING

                await eventually(serving, timeout_s=10, what="the scheduler process to serve")
                state = await scheduler_pb2_grpc.GlobalSchedulerStub(channel).ClusterState(
                    scheduler_pb2.ClusterStateRequest(), timeout=5)
                assert state.policy == "least_loaded" and not state.workers

        asyncio.run(wait_serving())
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=10)
        assert process.returncode == 0, output
        assert "stopped" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_the_laps_policy_runs_the_pool_controller_and_exports_l_m_until_switched_away(prefix):
    async def scenario() -> None:
        async with running_cluster(prefix, policy="laps", policy_params="boundary_tokens=100,period_s=0.05") as c:
            assert counter_value("splitserve_scheduler_length_boundary_tokens", history="0") == 100.0
            control = c.handle.pool_control
            assert control is not None
            await eventually(lambda: _true(control.leader), what="the pool controller to take the leader lock")
            await c.scheduler.SetPolicy(scheduler_pb2.SetPolicyRequest(policy="least_loaded"), timeout=5)
            assert c.handle.pool_control is None and not control.leader  # stopped, lock released
            async with StateStore(REDIS_URL, prefix) as other:
                assert await other.try_acquire_leader("pool-controller", "another-replica", ttl_s=1.0) is not None

    asyncio.run(scenario())


async def _true(value: bool) -> bool:
    return value
