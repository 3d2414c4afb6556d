"""Prometheus metrics of the gateway (process-wide registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from splitserve.telemetry import percentile_buckets

REQUESTS = Counter("splitserve_gateway_requests_total", "Finished requests by API and status.", ["api", "status"])
PROMPT_TOKENS = Counter("splitserve_gateway_prompt_tokens_total", "Prompt tokens of admitted requests.")
COMPLETION_TOKENS = Counter("splitserve_gateway_completion_tokens_total", "Output tokens delivered to clients.")
TTFT = Histogram("splitserve_gateway_ttft_seconds", "Time from arrival to the first output delta.",
                 buckets=percentile_buckets(60.0))
ITL = Histogram("splitserve_gateway_itl_seconds", "Time between consecutive output deltas.",
                buckets=percentile_buckets(10.0))
E2E = Histogram("splitserve_gateway_e2e_seconds", "Time from arrival to the end of the response.",
                buckets=percentile_buckets(600.0))
QUEUE_WAIT = Histogram("splitserve_gateway_queue_wait_seconds", "Time spent in the admission queue.",
                       buckets=percentile_buckets(60.0))
IN_FLIGHT = Gauge("splitserve_gateway_in_flight_requests", "Requests holding an admission slot.")
QUEUED = Gauge("splitserve_gateway_queued_requests", "Requests waiting in the admission queue.")
