"""A worker's engine figures under vLLM's metric names, on the worker's /metrics.

The Gateway API Inference Extension's endpoint picker and KEDA read `vllm:num_requests_waiting`
and `vllm:kv_cache_usage_perc` from each model-server pod: a worker is that pod here. The
figures are read off the engine's latest snapshot when Prometheus scrapes (not at the publish
interval), so a picker scraping every 50 ms sees each step's queue. Names, labels and the
reasons behind them: splitserve/vllm_metrics.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from splitserve import vllm_metrics as vllm
from splitserve.core.records import WorkerLoad


def served_model_name(model: str, model_preset: str = "", served: str = "") -> str:
    """The model_name label: `served` (the name clients send) when given, else the model
    directory's (or file's) name, as the gateway names the model it serves by default; an
    emulated worker without a model directory, its preset's name."""
    if served:
        return served
    return Path(model).name if model else model_preset


def engine_prefix_counts(engine) -> Callable[[], tuple[int, int] | None]:
    """(prompt tokens looked up, tokens found) in `engine`'s prefix cache since start, read from
    its block manager's counters (ints written by the engine thread: a read sees a whole value);
    None for an engine without one (the diffusion engine caches no prefixes)."""
    def counts() -> tuple[int, int] | None:
        manager = getattr(getattr(engine, "scheduler", None), "block_manager", None)
        queries = getattr(manager, "prefix_queries_tokens", None)
        hits = getattr(manager, "prefix_hits_tokens", None)
        if queries is None or hits is None:
            return None
        return int(queries), int(hits)
    return counts


class VllmWorkerCollector(Collector):
    """Yields vLLM's engine gauges and counters for the worker attached to it (none while no
    worker is: a process that imports the worker module without running one exports nothing)."""

    def __init__(self) -> None:
        self._model_name = ""
        self._load: Callable[[], WorkerLoad] | None = None
        self._prefix: Callable[[], tuple[int, int] | None] = lambda: None

    def attach(self, model_name: str, load: Callable[[], WorkerLoad],
               prefix_counts: Callable[[], tuple[int, int] | None] | None = None) -> None:
        """Export the figures of `load()` (the engine's latest snapshot) under `model_name`;
        `prefix_counts()`: exact prefix-cache counters when the engine has them."""
        self._model_name, self._load = model_name, load
        self._prefix = prefix_counts or (lambda: None)

    def detach(self) -> None:
        self._load = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        read = self._load
        if read is None:
            return
        load = read()
        labels = [self._model_name, vllm.ENGINE]
        prefix = self._prefix()
        queries, hits = prefix if prefix is not None else (vllm.prefix_cache_queries(load), load.prefix_hit_tokens)
        for family, name, doc, value in (
            (GaugeMetricFamily, vllm.NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.",
             load.running),
            (GaugeMetricFamily, vllm.NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.",
             load.waiting),
            (GaugeMetricFamily, vllm.KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.",
             vllm.kv_cache_usage(load)),
            (GaugeMetricFamily, vllm.GPU_CACHE_USAGE_PERC,
             "KV-cache usage. 1 means 100 percent usage. vLLM's name before 0.10: use vllm:kv_cache_usage_perc.",
             vllm.kv_cache_usage(load)),
            (CounterMetricFamily, vllm.PREFIX_CACHE_QUERIES,
             "Prefix cache queries, in terms of number of queried tokens.", queries),
            (CounterMetricFamily, vllm.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.",
             hits),
            (CounterMetricFamily, vllm.NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.",
             load.num_preemptions),
        ):
            metric = family(name, doc, labels=list(vllm.LABELS))
            metric.add_metric(labels, value)
            yield metric


# One per process (a process runs one worker); registered once, attached when the worker starts.
WORKER_METRICS = VllmWorkerCollector()
REGISTRY.register(WORKER_METRICS)
