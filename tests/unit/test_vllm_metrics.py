"""vLLM-named metrics: the figures behind them (pure) and what a scrape of them reads."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve import vllm_metrics as vllm
from splitserve.core.records import WorkerLoad
from workers.vllm_metrics import VllmWorkerCollector, engine_prefix_counts, served_model_name


def _scrape(registry) -> dict[str, dict]:
    """{sample name: {frozenset(labels): value}} of a registry's exposition text."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


def test_kv_cache_usage_is_a_fraction_like_vllm():
    assert vllm.kv_cache_usage(WorkerLoad(free_blocks=25, total_blocks=100)) == 0.75
    assert vllm.kv_cache_usage(WorkerLoad(free_blocks=0, total_blocks=0)) == 0.0


def test_prefix_cache_queries_are_recovered_from_hits_and_rate():
    queries, hits = 1_234_567, 456_789
    assert vllm.prefix_cache_queries(WorkerLoad(prefix_hit_tokens=hits, prefix_hit_rate=hits / queries)) == queries
    assert vllm.prefix_cache_queries(WorkerLoad(prefix_hit_tokens=0, prefix_hit_rate=0.0)) == 0


def test_finished_reason_maps_outcomes_to_vllms_three():
    assert [vllm.finished_reason(o) for o in ("stop", "length", "cancelled", "deadline_exceeded", "internal",
                                              "error", "invalid_argument")] == \
        ["stop", "length", "abort", "abort", "abort", "abort", None]


def test_token_timing_gives_ttft_then_itl_per_delivery():
    timing = vllm.TokenTiming(started=10.0)
    assert timing.deliver(1, 10.5) == ("ttft", 0.5)
    assert timing.deliver(2, 10.75) == ("itl", 0.25)
    assert timing.generated == 3
    resumed = vllm.TokenTiming(started=0.0, resumed=True)
    assert resumed.deliver(1, 4.0) is None  # its first token was measured by the earlier attempt
    assert resumed.deliver(1, 4.5) == ("itl", 0.5)


def test_vllms_buckets():
    assert vllm.TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and vllm.TTFT_BUCKETS[-1] == 2560.0
    assert len(vllm.ITL_BUCKETS) == 19 and vllm.ITL_BUCKETS[-1] == 80.0
    assert vllm.REQUEST_LATENCY_BUCKETS[0] == 0.3 and vllm.REQUEST_LATENCY_BUCKETS[-1] == 7680.0


def test_worker_collector_reads_the_latest_snapshot_at_scrape_time():
    registry = CollectorRegistry()
    collector = VllmWorkerCollector()
    registry.register(collector)
    assert not any(name.startswith("vllm:") for name in _scrape(registry))  # nothing before a worker attaches
    load = {"now": WorkerLoad(running=3, waiting=5, free_blocks=10, total_blocks=40, num_preemptions=2)}
    counts = {"now": (100, 60)}
    collector.attach("SmolLM2", lambda: load["now"], lambda: counts["now"])
    labels = frozenset({("model_name", "SmolLM2"), ("engine", "0")})
    got = _scrape(registry)
    assert got["vllm:num_requests_running"][labels] == 3
    assert got["vllm:num_requests_waiting"][labels] == 5
    assert got["vllm:kv_cache_usage_perc"][labels] == 0.75
    assert got["vllm:gpu_cache_usage_perc"][labels] == 0.75
    assert got["vllm:prefix_cache_queries_total"][labels] == 100
    assert got["vllm:prefix_cache_hits_total"][labels] == 60
    assert got["vllm:num_preemptions_total"][labels] == 2
    load["now"] = WorkerLoad(running=0, waiting=9, free_blocks=40, total_blocks=40)
    assert _scrape(registry)["vllm:num_requests_waiting"][labels] == 9
    collector.detach()
    assert "vllm:num_requests_waiting" not in _scrape(registry)


def test_prefix_counts_come_from_the_engines_block_manager_when_it_has_one():
    class Manager:
        prefix_queries_tokens, prefix_hits_tokens = 48, 16

    class Scheduler:
        block_manager = Manager()

    class Engine:
        scheduler = Scheduler()

    assert engine_prefix_counts(Engine())() == (48, 16)
    assert engine_prefix_counts(object())() is None  # e.g. the diffusion engine: no prefix cache


def test_model_name_is_the_model_directorys_name_as_the_gateway_says():
    assert served_model_name("/models/smollm2-135m-instruct/") == "smollm2-135m-instruct"
    assert served_model_name("", "llama-3-8b") == "llama-3-8b"
    assert served_model_name("/models/model", served="smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_coordinator_request_metrics_under_vllm_names():
    from prometheus_client import REGISTRY

    from services.coordinator.vllm_metrics import RequestMetrics

    model = "test-vllm-metrics-model"
    labels = frozenset({("model_name", model), ("engine", "0")})
    request = RequestMetrics(model, prompt_tokens=7, started=100.0)
    request.deliver(1, 100.02)   # TTFT 0.02 s
    request.deliver(0, 100.05)   # an empty chunk (e.g. the finish) measures nothing
    request.deliver(2, 100.07)   # ITL 0.05 s
    request.finish("stop", 101.0)
    RequestMetrics(model, prompt_tokens=3, started=0.0).finish("invalid_argument", 0.1)  # refused: not counted
    aborted = RequestMetrics(model, prompt_tokens=3, started=0.0)
    aborted.finish("cancelled", 0.4)
    got = _scrape(REGISTRY)
    assert got["vllm:prompt_tokens_total"][labels] == 7
    assert got["vllm:generation_tokens_total"][labels] == 3
    assert got["vllm:time_to_first_token_seconds_count"][labels] == 1
    assert got["vllm:time_to_first_token_seconds_bucket"][labels | {("le", "0.02")}] == 1
    assert got["vllm:time_to_first_token_seconds_bucket"][labels | {("le", "0.01")}] == 0
    assert got["vllm:inter_token_latency_seconds_count"][labels] == 1
    assert got["vllm:inter_token_latency_seconds_bucket"][labels | {("le", "0.05")}] == 1
    assert got["vllm:time_per_output_token_seconds_count"][labels] == 1
    assert got["vllm:e2e_request_latency_seconds_count"][labels] == 2
    assert got["vllm:e2e_request_latency_seconds_sum"][labels] == 1.4
    assert got["vllm:request_success_total"][labels | {("finished_reason", "stop")}] == 1
    assert got["vllm:request_success_total"][labels | {("finished_reason", "abort")}] == 1
