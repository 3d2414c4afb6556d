"""OTLP span export over a real gRPC connection: plaintext or TLS as OpenTelemetry's standard
variables say (OTEL_EXPORTER_OTLP_INSECURE, OTEL_EXPORTER_OTLP_CERTIFICATE, the endpoint's
scheme), not forced to plaintext."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from splitserve import telemetry
from tests.tls_support import make_test_certs

OTEL_VARS = ("OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_CERTIFICATE",
             "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
             "OTEL_EXPORTER_OTLP_CLIENT_KEY", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
             "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TIMEOUT",
             "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.names: list[str] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.names.extend(span.name for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certs(tmp_path_factory.mktemp("otlp-certs"))


def _serve(credentials: grpc.ServerCredentials | None):
    sink = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials is not None
            else server.add_insecure_port("127.0.0.1:0"))
    server.start()
    return server, sink, port


@pytest.fixture
def plaintext():
    server, sink, port = _serve(None)
    yield sink, port
    server.stop(grace=None)


@pytest.fixture
def tls(certs):
    creds = grpc.ssl_server_credentials([(certs["service_key"].read_bytes(), certs["service"].read_bytes())])
    server, sink, port = _serve(creds)
    yield sink, port
    server.stop(grace=None)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    # A wrong transport fails fast instead of retrying for the default 10 s.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")


def _finished_span(name: str):
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("test").start_span(name).end()
    return memory.get_finished_spans()


def _export(endpoint: str, name: str) -> SpanExportResult:
    exporter = telemetry.otlp_span_exporter(endpoint)
    try:
        return exporter.export(_finished_span(name))
    finally:
        exporter.shutdown()


def test_https_endpoint_uses_tls_with_the_ca_of_otel_exporter_otlp_certificate(tls, certs, monkeypatch):
    sink, port = tls
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(certs["ca"]))
    assert _export(f"https://localhost:{port}", "over-tls") is SpanExportResult.SUCCESS
    assert sink.names == ["over-tls"]


def test_endpoint_without_scheme_is_tls_by_default(tls, certs, monkeypatch):
    sink, port = tls
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(certs["ca"]))
    assert _export(f"localhost:{port}", "schemeless-tls") is SpanExportResult.SUCCESS
    assert sink.names == ["schemeless-tls"]


def test_otel_exporter_otlp_insecure_true_makes_a_schemeless_endpoint_plaintext(plaintext, monkeypatch):
    sink, port = plaintext
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    assert _export(f"127.0.0.1:{port}", "insecure-by-env") is SpanExportResult.SUCCESS
    assert sink.names == ["insecure-by-env"]


def test_http_endpoint_is_plaintext(plaintext):
    sink, port = plaintext
    assert _export(f"http://127.0.0.1:{port}", "over-http") is SpanExportResult.SUCCESS
    assert sink.names == ["over-http"]


def test_otel_exporter_otlp_insecure_false_makes_an_http_endpoint_tls(tls, certs, monkeypatch):
    sink, port = tls
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "false")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(certs["ca"]))
    assert _export(f"http://localhost:{port}", "http-but-tls") is SpanExportResult.SUCCESS
    assert sink.names == ["http-but-tls"]
