"""Logging (JSON, with request ids), Prometheus endpoint and OpenTelemetry tracing."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
from typing import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
# The trace of the request being handled (32 hex digits), for log lines: spans are passed
# explicitly, not made current, so the current span does not tell it.
trace_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("trace_id", default="")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, request id."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        trace_id = trace_id_var.get()
        if not trace_id:
            span = trace.get_current_span().get_span_context()
            trace_id = f"{span.trace_id:032x}" if span.is_valid else ""
        if trace_id:
            entry["trace_id"] = trace_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(service: str, level: str = "INFO", as_json: bool = True) -> None:
    """Configure the root logger for a service process."""
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def start_metrics_server(host: str, port: int) -> int:
    """Serve Prometheus /metrics on a background thread; returns the bound port."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    return server.server_port


def otlp_traces_endpoint(otlp_endpoint: str = "") -> str:
    """Where spans go: `otlp_endpoint` (--otlp-endpoint), else the standard
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT; "" when none is set."""
    return otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or \
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


def otlp_span_exporter(endpoint: str):
    """The OTLP/gRPC span exporter for `endpoint`. Its transport follows OpenTelemetry's exporter
    specification, read by the exporter itself from the standard variables (no `insecure` is
    passed, which would override them): an https:// endpoint is TLS; an http:// endpoint is
    plaintext unless OTEL_EXPORTER_OTLP_(TRACES_)INSECURE=false; an endpoint without a scheme
    (host:port) is TLS unless OTEL_EXPORTER_OTLP_(TRACES_)INSECURE=true. TLS trusts the CA file
    of OTEL_EXPORTER_OTLP_(TRACES_)CERTIFICATE (else the system's roots) and presents the client
    certificate of OTEL_EXPORTER_OTLP_(TRACES_)CLIENT_CERTIFICATE / _CLIENT_KEY when set;
    headers, timeout and compression come from their OTEL_EXPORTER_OTLP_* variables too."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def setup_tracing(service: str, otlp_endpoint: str) -> bool:
    """Export spans over OTLP/gRPC to `otlp_endpoint`, else to the standard
    OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT (OTEL_SERVICE_NAME names the service when set); with
    neither, tracing stays a no-op (spans are not recorded). Plaintext or TLS as
    `otlp_span_exporter` says. Whether export was set up."""
    endpoint = otlp_traces_endpoint(otlp_endpoint)
    if not endpoint:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or f"splitserve-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    # A short delay: a request's spans reach the collector within a second of its end.
    provider.add_span_processor(BatchSpanProcessor(otlp_span_exporter(endpoint), schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the span exporter (at process exit, so the last spans are not lost)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def outgoing_metadata(request_id: str = "", parent: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying a trace context (`parent`, else the current one) and the request
    id to the next hop (W3C traceparent / tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=parent)
    md = list(carrier.items())
    if request_id:
        md.append(("x-request-id", request_id))
    return md


def incoming_context(metadata: Iterable[tuple[str, str]] | None) -> otel_context.Context:
    """The trace context a caller sent in its gRPC metadata (or HTTP headers)."""
    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def http_parent_context(headers: Iterable[tuple[str, str]]) -> otel_context.Context:
    """The parent of a request handled over HTTP: the web framework's own server span when it
    traces requests (FastAPI does once a tracer provider is set; it read `traceparent` already),
    else the caller's context from the headers."""
    if trace.get_current_span().get_span_context().is_valid:
        return otel_context.get_current()
    return incoming_context(headers)


def tracer(name: str = "splitserve") -> trace.Tracer:
    return trace.get_tracer(name)


def start_span(name: str, parent: otel_context.Context | None = None, *, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
               attributes: dict | None = None, start_time_ns: int | None = None) -> trace.Span:
    """A span under `parent`, ended by the caller. Spans are passed explicitly (`span_context`)
    rather than made current: a request's work crosses async generators and threads, where an
    attached context would be detached in the wrong place."""
    span = tracer().start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_time_ns)
    if kind is trace.SpanKind.SERVER:  # a service's span of the request it handles: its log lines carry the trace
        ids = span.get_span_context()
        if ids.is_valid:
            trace_id_var.set(f"{ids.trace_id:032x}")
    return span


def span_context(span: trace.Span) -> otel_context.Context:
    """The context whose current span is `span` (the parent of its children, the next hop's caller)."""
    return trace.set_span_in_context(span)


def record_interval(name: str, parent: trace.Span, start_ns: int, end_ns: int, attributes: dict | None = None) -> None:
    """A finished child span of `parent` from timestamps taken earlier (e.g. a stage's queue wait)."""
    span = start_span(name, span_context(parent), attributes=attributes, start_time_ns=start_ns)
    span.end(end_time=max(start_ns, end_ns))


def end_span(span: trace.Span, error: BaseException | None = None) -> None:
    """End `span`, marked as failed with the error's message when one is given."""
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error) or type(error).__name__))
    span.end()


def now_ns() -> int:
    return time.time_ns()


def percentile_buckets(upper_s: float, count: int = 16) -> Sequence[float]:
    """Histogram buckets growing geometrically from 0.5 ms to `upper_s`."""
    lo = 0.0005
    ratio = (upper_s / lo) ** (1 / (count - 1))
    return [round(lo * ratio**i, 6) for i in range(count)]
