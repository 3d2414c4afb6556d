"""vLLM-named metrics on a real cluster's /metrics: the engine gauges and prefix-cache counters on
each worker's (what the Gateway API Inference Extension's endpoint picker and KEDA read from a
model-server pod), the request histograms and token counters on the coordinator's, every series
labelled with the served model's name as the gateway names it."""

from __future__ import annotations

import os
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cli.launcher import ClusterSpec, start_cluster
from splitserve.redis_server import free_port

WORKER_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory):
    spec = ClusterSpec(
        model=str(tiny_model_dirs["llama"]),  # the gateway's tokenizer; the emulated worker reads its config.json
        workers=1, policy="least_loaded", http_port=free_port(), grpc_port=free_port(),
        redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"], redis_prefix=f"ss:vllm-{uuid.uuid4().hex[:8]}:",
        log_dir=tmp_path_factory.mktemp("vllm-metrics-logs"),
        worker_args={"backend": "emulated", "gpu": "H100", "model_preset": "llama-3-8b"},
    )
    running = start_cluster(spec, ready_timeout_s=90)
    yield running
    running.stop()


def _scrape(port: int) -> dict[str, list]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_worker_and_coordinator_export_vllms_metrics(cluster, tiny_model_dirs):
    model = tiny_model_dirs["llama"].name
    prompt = "the same long prompt shares its prefix blocks with the next request " * 3
    completion_tokens = 0
    with httpx.Client(base_url=cluster.gateway_http, timeout=60) as http:
        for _ in range(3):
            reply = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            completion_tokens += reply.json()["usage"]["completion_tokens"]
            prompt_tokens = reply.json()["usage"]["prompt_tokens"]

    worker = _scrape(cluster.child("worker-0").metrics_port)
    for name in WORKER_METRICS:
        assert [s.labels for s in worker.get(name, [])] == [{"model_name": model, "engine": "0"}], name
    assert _value(worker, "vllm:num_requests_running") == _value(worker, "vllm:num_requests_waiting") == 0
    assert 0.0 <= _value(worker, "vllm:kv_cache_usage_perc") <= 1.0
    hits, queries = _value(worker, "vllm:prefix_cache_hits_total"), _value(worker, "vllm:prefix_cache_queries_total")
    assert 0 < hits <= queries, "the repeated prompt should be found in the prefix cache"

    coordinator = _scrape(cluster.child("coordinator").metrics_port)
    labels = {"model_name": model, "engine": "0"}
    assert _value(coordinator, "vllm:time_to_first_token_seconds_count", **labels) == 3
    assert _value(coordinator, "vllm:e2e_request_latency_seconds_count", **labels) == 3
    assert _value(coordinator, "vllm:inter_token_latency_seconds_count", **labels) >= 3
    assert _value(coordinator, "vllm:time_per_output_token_seconds_count", **labels) >= 3
    assert _value(coordinator, "vllm:generation_tokens_total", **labels) == completion_tokens == 18
    assert _value(coordinator, "vllm:prompt_tokens_total", **labels) == 3 * prompt_tokens
    assert _value(coordinator, "vllm:request_success_total", finished_reason="length", **labels) == 3
    # vLLM's buckets, so a stock dashboard's histogram_quantile reads the same ranges.
    ttft_bounds = [s.labels["le"] for s in coordinator["vllm:time_to_first_token_seconds_bucket"]
                   if s.labels["model_name"] == model]
    assert ttft_bounds[:3] == ["0.001", "0.005", "0.01"] and ttft_bounds[-2:] == ["2560.0", "+Inf"]
