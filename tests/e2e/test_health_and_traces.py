"""Health that tells the truth, and one trace per request across every service (issue 17).

The services run as real processes (scheduler, coordinator, gateway, then a worker), each
exporting its spans over OTLP/gRPC to a real OTLP trace receiver in this test process.

* Before any worker exists the gateway is live but not ready: `/health` answers 503 saying
  why, its gRPC health is NOT_SERVING ("liveness" SERVING). A request sent the moment
  `/health` first answers 200, after a worker starts, succeeds.
* A request that arrives with a W3C `traceparent` yields one trace: gateway, coordinator,
  scheduler and both workers of a prefill/decode split, whose parent links form one tree
  under the caller's span, with the worker's queue, prefill, decode and KV-transfer spans.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from concurrent import futures

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from real_model_support import until

from splitserve.cli.launcher import _serve_cmd, wait_port_healthy
from splitserve.redis_server import free_port

TRACE_ID = uuid.uuid4().hex  # the caller's trace (32 hex digits)
CALLER_SPAN = uuid.uuid4().hex[:16]


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint keeping every span it is sent, with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id_hex: str) -> list[tuple[str, object]]:
        with self._lock:
            return [(s, span) for s, span in self.spans if span.trace_id.hex() == trace_id_hex]


@pytest.fixture(scope="module")
def receiver():
    sink = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def services(receiver, tiny_model_dirs, tmp_path_factory):
    """Scheduler, coordinator and gateway (pd_disaggregated); workers are started by the tests."""
    _, endpoint = receiver
    logs = tmp_path_factory.mktemp("health-traces-logs")
    model = str(tiny_model_dirs["llama"])
    common = {"redis_url": os.environ["SPLITSERVE_TEST_REDIS_URL"], "redis_prefix": f"ss:tr-{uuid.uuid4().hex[:8]}:",
              "host": "127.0.0.1", "log_json": True, "otlp_endpoint": endpoint}
    ports = {name: free_port() for name in ("scheduler", "coordinator", "gateway", "http")}
    plan = [
        ("scheduler", {**common, "port": ports["scheduler"], "policy": "pd_disaggregated", "view_refresh_s": 0.05}),
        ("coordinator", {**common, "port": ports["coordinator"], "scheduler_address": f"127.0.0.1:{ports['scheduler']}"}),
        ("gateway", {**common, "port": ports["gateway"], "http_port": ports["http"], "model": model,
                     "coordinator_address": f"127.0.0.1:{ports['coordinator']}"}),
    ]
    procs: list[subprocess.Popen] = []

    def spawn(name, options):
        with open(logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(_serve_cmd(name.split("-")[0], {**options, "metrics_port": 0}), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        for name, options in plan:
            spawn(name, options)
        wait_port_healthy(f"127.0.0.1:{ports['scheduler']}", procs[0], 60)
        wait_port_healthy(f"127.0.0.1:{ports['coordinator']}", procs[1], 60)

        def start_worker(index: int, role: str, worker_model: str = model) -> subprocess.Popen:
            port = free_port()
            proc = spawn(f"worker-{index}", {**common, "port": port, "worker_id": f"tr-worker-{index}",
                                             "model": worker_model,
                                             "role": role, "kv_transport": "grpc",
                                             "kv_cache_memory_bytes": 16 << 20})
            wait_port_healthy(f"127.0.0.1:{port}", proc, 120)
            return proc

        yield {"http": f"http://127.0.0.1:{ports['http']}", "grpc": f"127.0.0.1:{ports['gateway']}",
               "gateway": procs[2], "start_worker": start_worker, "logs": logs,
               "scheduler": f"127.0.0.1:{ports['scheduler']}"}
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _grpc_health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=2).status


def test_ready_only_when_a_request_would_succeed_then_one_trace_across_services(services, receiver):
    http = services["http"]
    # The gateway process is up: live, not ready (no worker is registered anywhere).
    until(lambda: _live(http), 60, "the gateway's HTTP listener")
    reply = httpx.get(f"{http}/health", timeout=5)
    assert reply.status_code == 503 and "no eligible worker" in reply.json()["reason"]
    assert httpx.get(f"{http}/health/ready", timeout=5).status_code == 503
    assert _grpc_health(services["grpc"], "") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert _grpc_health(services["grpc"], "liveness") == health_pb2.HealthCheckResponse.SERVING

    # A worker of another engine family (a diffusion model) cannot serve this llama gateway: still not ready.
    from workers.diffusion.tiny_task import TINY_MODEL_DIR

    services["start_worker"](9, "both", str(TINY_MODEL_DIR))
    until(lambda: "tr-worker-9" in _scheduler_view(services["scheduler"]), 30, "the scheduler to see the worker")
    reply = httpx.get(f"{http}/health", timeout=5)
    assert reply.status_code == 503 and "no eligible worker" in reply.json()["reason"]

    services["start_worker"](0, "prefill")
    services["start_worker"](1, "decode")
    until(lambda: httpx.get(f"{http}/health", timeout=5).status_code == 200, 60, "/health to answer 200")
    # The moment it does: a request succeeds (pd_disaggregated needs both roles: both are placeable).
    traceparent = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
    reply = httpx.post(f"{http}/v1/completions", json={"prompt": "Hello, traces", "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True},
                       headers={"traceparent": traceparent}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 6
    until(lambda: _grpc_health(services["grpc"], "") == health_pb2.HealthCheckResponse.SERVING, 10,
           "the gateway's gRPC readiness")

    sink, _ = receiver
    wanted = {"gateway.request", "coordinator.request", "coordinator.place", "scheduler.place", "coordinator.stage",
              "coordinator.kv_reserve", "worker.stage", "worker.queue", "worker.prefill", "worker.decode",
              "worker.kv_push", "worker.kv_receive"}
    def whole_tree():
        """The trace once every wanted span is in and every span's parent too (services export
        in batches: a child can arrive before its parent; found by a CI run)."""
        found = sink.of_trace(TRACE_ID)
        ids = {span.span_id.hex() for _, span in found} | {CALLER_SPAN}
        if found and wanted <= {span.name for _, span in found} and all(
                span.parent_span_id.hex() in ids for _, span in found):
            return found
        return None

    spans = until(whole_tree, 30, f"spans {sorted(wanted)}, each with its parent")
    by_id = {span.span_id.hex(): (service, span) for service, span in spans}
    # One tree under the caller's span: one root (the gateway's: its request span, or the web
    # framework's server span above it when FastAPI traces requests itself), every other
    # span's parent a span of this trace.
    roots = [(service, span) for service, span in spans if span.parent_span_id.hex() == CALLER_SPAN]
    assert len(roots) == 1 and roots[0][0] == "splitserve-gateway"
    assert all(span.parent_span_id.hex() in by_id for _, span in spans if span is not roots[0][1])
    gateway = next(span for _, span in spans if span.name == "gateway.request")
    chain = [gateway]
    while chain[-1] is not roots[0][1]:
        chain.append(by_id[chain[-1].parent_span_id.hex()][1])
    assert all(by_id[span.span_id.hex()][0] == "splitserve-gateway" for span in chain)
    services_of = {name: {service for service, span in spans if span.name == name} for name in wanted}
    assert services_of["gateway.request"] == {"splitserve-gateway"}
    assert services_of["coordinator.request"] == {"splitserve-coordinator"}
    assert services_of["scheduler.place"] == {"splitserve-scheduler"}
    assert services_of["worker.stage"] == {"splitserve-worker"}
    stages = [span for _, span in spans if span.name == "worker.stage"]
    assert len(stages) == 2  # prefill worker and decode worker
    for stage in stages:  # each under the coordinator's span for that stage
        assert by_id[stage.parent_span_id.hex()][1].name == "coordinator.stage"
    parent_names = {span.name: by_id[span.parent_span_id.hex()][1].name for _, span in spans
                    if span.name in ("worker.queue", "worker.prefill", "worker.decode", "worker.kv_push",
                                     "worker.kv_receive", "scheduler.place", "coordinator.place",
                                     "coordinator.request", "coordinator.kv_reserve")}
    assert parent_names == {"worker.queue": "worker.stage", "worker.prefill": "worker.stage",
                            "worker.decode": "worker.stage", "worker.kv_push": "worker.stage",
                            "worker.kv_receive": "worker.stage", "scheduler.place": "coordinator.place",
                            "coordinator.place": "coordinator.request", "coordinator.request": "gateway.request",
                            "coordinator.kv_reserve": "coordinator.stage"}


def _scheduler_view(address: str) -> set[str]:
    from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        state = scheduler_pb2_grpc.GlobalSchedulerStub(channel).ClusterState(scheduler_pb2.ClusterStateRequest(),
                                                                            timeout=5)
    return {w.worker_id for w in state.workers}


def _live(http: str) -> bool:
    try:
        return httpx.get(f"{http}/health/live", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
