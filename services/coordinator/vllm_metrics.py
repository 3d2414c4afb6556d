"""Per-request latency histograms and token counters under vLLM's names, on the coordinator's
/metrics: the coordinator sees every request's stitched token stream whichever workers ran its
stages, so a split or disaggregated request is one request here, as it is to its client. Times
run from the coordinator's Submit: a gateway's admission queue is not in them (that is
`splitserve_gateway_queue_wait_seconds`, and `splitserve_gateway_ttft_seconds` includes it).
Names, labels and buckets: splitserve/vllm_metrics.py."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from splitserve import vllm_metrics as vllm

LABELS = list(vllm.LABELS)
TTFT = Histogram(vllm.TIME_TO_FIRST_TOKEN, "Histogram of time to first token in seconds.", LABELS,
                 buckets=vllm.TTFT_BUCKETS)
ITL = Histogram(vllm.INTER_TOKEN_LATENCY, "Histogram of inter-token latency in seconds.", LABELS,
                buckets=vllm.ITL_BUCKETS)
TPOT = Histogram(vllm.TIME_PER_OUTPUT_TOKEN,
                 "Histogram of time per output token in seconds. vLLM's older name: use "
                 "vllm:inter_token_latency_seconds.", LABELS, buckets=vllm.ITL_BUCKETS)
E2E = Histogram(vllm.E2E_REQUEST_LATENCY, "Histogram of e2e request latency in seconds.", LABELS,
                buckets=vllm.REQUEST_LATENCY_BUCKETS)
PROMPT_TOKENS = Counter(vllm.PROMPT_TOKENS, "Number of prefill tokens processed.", LABELS)
GENERATION_TOKENS = Counter(vllm.GENERATION_TOKENS, "Number of generation tokens processed.", LABELS)
REQUEST_SUCCESS = Counter(vllm.REQUEST_SUCCESS, "Count of successfully processed requests.",
                          LABELS + ["finished_reason"])


class RequestMetrics:
    """Observes one request: `deliver` for each chunk of tokens streamed out, `finish` once at the
    end. `model_name`: the served model's name the gateway put in the request."""

    def __init__(self, model_name: str, prompt_tokens: int, started: float, resumed: bool = False):
        self.labels = (model_name, vllm.ENGINE)
        self.prompt_tokens = prompt_tokens
        self.timing = vllm.TokenTiming(started, resumed)

    def deliver(self, num_tokens: int, now: float) -> None:
        if num_tokens <= 0:
            return
        if self.timing.generated == 0:  # the prompt is processed once its first token exists
            PROMPT_TOKENS.labels(*self.labels).inc(self.prompt_tokens)
        GENERATION_TOKENS.labels(*self.labels).inc(num_tokens)
        measured = self.timing.deliver(num_tokens, now)
        if measured is None:
            return
        kind, seconds = measured
        if kind == "ttft":
            TTFT.labels(*self.labels).observe(seconds)
        else:
            ITL.labels(*self.labels).observe(seconds)
            TPOT.labels(*self.labels).observe(seconds)

    def finish(self, outcome: str, now: float) -> None:
        reason = vllm.finished_reason(outcome)
        if reason is None:  # refused before it ran: no request in vLLM's sense
            return
        REQUEST_SUCCESS.labels(*self.labels, reason).inc()
        E2E.labels(*self.labels).observe(now - self.timing.started)
