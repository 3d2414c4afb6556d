"""Which OTLP endpoint spans go to (the transport is the exporter's, tested over real connections
in tests/integration/test_otlp_export_transport.py)."""

from __future__ import annotations

from splitserve import telemetry


def test_the_flag_wins_then_the_traces_endpoint_then_the_general_one(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://general:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://traces:4317")
    assert telemetry.otlp_traces_endpoint("http://flag:4317") == "http://flag:4317"
    assert telemetry.otlp_traces_endpoint("") == "https://traces:4317"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    assert telemetry.otlp_traces_endpoint("") == "https://general:4317"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert telemetry.otlp_traces_endpoint("") == ""

