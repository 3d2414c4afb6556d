"""vLLM's Prometheus conventions: metric names, labels, buckets and the figures behind them.

splitserve exports these besides its own `splitserve_*` metrics, so what reads a `vllm serve`
pod's /metrics works unchanged: stock vLLM Grafana dashboards, KEDA's Prometheus scaler on
`vllm:num_requests_waiting`, the Gateway API Inference Extension's endpoint picker (it reads
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` from each model-server pod). Names,
label names and buckets are vLLM's (vllm/v1/metrics/loggers.py, v0.10-0.11). Where each is
exported: the per-engine gauges and prefix-cache counters on every worker's /metrics
(workers/vllm_metrics.py), the per-request histograms and token counters on the coordinator's,
which sees every request's stitched token stream (services/coordinator/vllm_metrics.py).

This module is pure: no metric is registered by importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.core.records import WorkerLoad

# vLLM labels every metric with the served model's name and its engine (data-parallel rank);
# one splitserve worker (or coordinator) is one engine: "0".
LABELS = ("model_name", "engine")
ENGINE = "0"

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # a fraction 0-1, as vLLM >= 0.10 (despite the name)
# vLLM < 0.10's name of the same gauge, still read by older endpoint pickers and dashboards.
GPU_CACHE_USAGE_PERC = "vllm:gpu_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # counters: exported with the _total suffix
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
TIME_PER_OUTPUT_TOKEN = "vllm:time_per_output_token_seconds"  # vLLM's older name of the ITL histogram
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# vLLM's FinishReason values (the `finished_reason` label of vllm:request_success_total).
FINISHED_REASONS = ("stop", "length", "abort")
# Outcomes of requests refused before they ran: vLLM's server rejects these before its engine
# sees them, so they are no finished request there either.
_REFUSED = frozenset({"invalid_argument", "not_found", "permission_denied", "unauthenticated",
                      "resource_exhausted", "failed_precondition", "already_exists", "out_of_range"})


def finished_reason(outcome: str) -> str | None:
    """vLLM's `finished_reason` of a request that ended with the coordinator's `outcome` (a
    finish reason, or an error code's name): stop and length as they are, a request refused
    before it ran None (not counted), any other end (cancelled, deadline, unavailable, internal
    error, a migration that gave up) "abort"."""
    if outcome in ("stop", "length"):
        return outcome
    if outcome in _REFUSED:
        return None
    return "abort"


def kv_cache_usage(load: WorkerLoad) -> float:
    """The share of KV blocks in use, 0-1 (vLLM's kv_cache_usage_perc); 0 without a KV cache."""
    if load.total_blocks <= 0:
        return 0.0
    return min(1.0, max(0.0, load.used_blocks / load.total_blocks))


def prefix_cache_queries(load: WorkerLoad) -> int:
    """Prompt tokens looked up in the prefix cache since start. The load record carries hits and
    the hit rate (hits / queries); queries are recovered from the two (exact: both come from the
    same integer counters). With no hit yet the rate is 0 and queries cannot be told: 0 then, so
    the hit ratio reads as "no data" rather than as a wrong figure."""
    if load.prefix_hit_tokens <= 0 or load.prefix_hit_rate <= 0.0:
        return 0
    return round(load.prefix_hit_tokens / load.prefix_hit_rate)


@dataclass
class TokenTiming:
    """When one request's tokens arrived: TTFT at its first delivery, inter-token latency at each
    later one (one observation per delivery, as vLLM observes one per engine step). Times on
    one monotonic clock; `resumed`: the request continues an earlier attempt's output (its first
    token was measured there), so its first delivery here is neither."""

    started: float
    resumed: bool = False
    last_at: float | None = None
    generated: int = 0

    def deliver(self, num_tokens: int, now: float) -> tuple[str, float] | None:
        """Record a delivery of `num_tokens` (> 0) tokens at `now`: ("ttft" | "itl", seconds), or
        None when it measures neither (a resumed request's first delivery)."""
        previous, self.last_at = self.last_at, now
        self.generated += num_tokens
        if previous is not None:
            return "itl", now - previous
        if self.resumed:
            return None
        return "ttft", now - self.started
