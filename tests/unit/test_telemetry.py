"""Trace helpers (splitserve/telemetry.py) with OpenTelemetry's in-memory exporter: spans passed
explicitly, W3C context carried through gRPC metadata, intervals from recorded timestamps."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from splitserve import telemetry


@pytest.fixture
def exporter(monkeypatch):
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    # A local provider: the global one can be set once per process, and other tests must not record.
    monkeypatch.setattr(telemetry, "tracer", lambda name="splitserve": provider.get_tracer(name))
    return memory


def test_context_crosses_a_hop_in_grpc_metadata(exporter):
    root = telemetry.start_span("gateway.request", kind=SpanKind.SERVER)
    metadata = telemetry.outgoing_metadata("req-1", telemetry.span_context(root))
    assert ("x-request-id", "req-1") in metadata
    traceparent = dict(metadata)["traceparent"]
    ids = root.get_span_context()
    assert traceparent.startswith(f"00-{ids.trace_id:032x}-{ids.span_id:016x}-")  # then the flags (sampled)
    # The next hop: metadata keys may arrive in any case.
    child = telemetry.start_span("coordinator.request",
                                 telemetry.incoming_context([(k.upper(), v) for k, v in metadata]))
    telemetry.end_span(child)
    telemetry.end_span(root)
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert finished["coordinator.request"].context.trace_id == ids.trace_id
    assert finished["coordinator.request"].parent.span_id == ids.span_id
    assert finished["gateway.request"].kind is SpanKind.SERVER


def test_no_context_starts_a_new_trace_and_an_empty_carrier_carries_none(exporter):
    assert [k for k, _ in telemetry.outgoing_metadata("r")] == ["x-request-id"]  # nothing current
    span = telemetry.start_span("gateway.request", telemetry.incoming_context([]))
    telemetry.end_span(span)
    (finished,) = exporter.get_finished_spans()
    assert finished.parent is None and finished.context.is_valid


def test_intervals_from_recorded_timestamps_and_errors(exporter):
    stage = telemetry.start_span("worker.stage")
    telemetry.record_interval("worker.queue", stage, 1_000, 5_000, {"k": 1})
    telemetry.record_interval("worker.prefill", stage, 5_000, 4_000)  # clock skew: never negative
    telemetry.end_span(stage, ValueError("boom"))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert (spans["worker.queue"].start_time, spans["worker.queue"].end_time) == (1_000, 5_000)
    assert spans["worker.queue"].attributes["k"] == 1
    assert spans["worker.prefill"].end_time == spans["worker.prefill"].start_time == 5_000
    assert spans["worker.queue"].parent.span_id == stage.get_span_context().span_id
    assert spans["worker.stage"].status.status_code is StatusCode.ERROR
    assert spans["worker.stage"].status.description == "boom"


def test_http_parent_prefers_the_frameworks_server_span(exporter):
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    # No span current: the caller's context from the headers.
    parent = telemetry.http_parent_context([("traceparent", caller)])
    assert trace.get_current_span(parent).get_span_context().span_id == 0xB7AD6B7169203331
    server = telemetry.start_span("POST /v1/completions", parent)
    with trace.use_span(server, end_on_exit=True):
        chosen = telemetry.http_parent_context([("traceparent", caller)])
        assert trace.get_current_span(chosen) is server


def test_tracing_is_exported_only_when_an_endpoint_is_configured(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert telemetry.setup_tracing("gateway", "") is False


def test_log_lines_carry_the_request_and_trace_of_the_server_span(exporter):
    import contextvars
    import json
    import logging

    def handle():
        telemetry.request_id_var.set("req-9")
        span = telemetry.start_span("worker.stage", kind=SpanKind.SERVER)
        record = logging.LogRecord("w", logging.INFO, __file__, 1, "stage done", None, None)
        line = json.loads(telemetry.JsonFormatter("worker").format(record))
        telemetry.end_span(span)
        return line, f"{span.get_span_context().trace_id:032x}"

    line, trace_id = contextvars.copy_context().run(handle)  # as each request's task has its own context
    assert (line["request_id"], line["trace_id"], line["service"]) == ("req-9", trace_id, "worker")

