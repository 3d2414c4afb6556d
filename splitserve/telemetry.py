"""Logging (JSON, with request ids), Prometheus endpoint and OpenTelemetry tracing."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


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
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = f"{span.trace_id:032x}"
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


def setup_tracing(service: str, otlp_endpoint: str) -> None:
    """Export spans over OTLP when an endpoint is configured; otherwise tracing is a no-op."""
    if not otlp_endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"splitserve-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
    trace.set_tracer_provider(provider)


def outgoing_metadata(request_id: str = "") -> list[tuple[str, str]]:
    """gRPC metadata carrying the current trace context and request id to the next hop."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    md = list(carrier.items())
    if request_id:
        md.append(("x-request-id", request_id))
    return md


def incoming_context(metadata: Iterable[tuple[str, str]] | None) -> otel_context.Context:
    """The trace context a caller sent in its gRPC metadata."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def now_ns() -> int:
    return time.time_ns()


def percentile_buckets(upper_s: float, count: int = 16) -> Sequence[float]:
    """Histogram buckets growing geometrically from 0.5 ms to `upper_s`."""
    lo = 0.0005
    ratio = (upper_s / lo) ** (1 / (count - 1))
    return [round(lo * ratio**i, 6) for i in range(count)]
