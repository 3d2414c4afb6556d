"""Discrete-event simulator of a splitserve cluster (architecture: "three ways to run", (c)).

    sim = Simulator.from_preset(64, "H100", "Llama-3-8B", placement_policy="least_loaded")
    outcome = sim.run(items, arrival=poisson(4.0))      # items: SimRequestSpec / Session
    summary = summarize(outcome.results, Slo(1.0, 0.1))  # the same metrics as `splitserve bench`

The decisions are the real code, unchanged: placement policies from
`services.global_scheduler.make_policy` over a stale `ClusterView` built by the
scheduler's own `build_cluster_view` and `InflightCounters`; on every worker the engine's
serving core (`splitserve.core`: `Scheduler`, `BlockManager`, a `BatchPolicy` from `make_batch_policy`).
Only time is modelled:

* an engine step lasts `PerfModel.step_time` of the entries its scheduler chose (prefill
  chunks `(l_hist=start, l_incr=n)`, decodes as one batch of mean context);
* sampled tokens are the fake id 1, EOS is ignored: sequences end at max_tokens or at
  their stage's end, where `Engine.step` ends them;
* a stage's KV goes to the next stage's worker in chunks pushed while it computes, over
  the sender's one link (`PerfModel.kv_transfer_time` per chunk), so only the last chunk
  is on the critical path; the next stage's blocks are reserved before the stage is sent,
  waiting in line for room up to `kv_reserve_wait_s`, and the next stage recomputes from
  tokens when none came in time (as the coordinator and workers do); with
  `kv_receive="blocking"` the receiver instead pulls the whole KV inside the step that first
  schedules the stage, its batch waiting for it (vLLM v0's connector, `KV_RECEIVE_MODES`);
* fixed control-plane delays (`NetworkLatency`) around dispatch, stage handoff and
  token streaming; no failures, retries or migrations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from loadgen.arrivals import ArrivalProcess
from loadgen.metrics import RequestResult
from loadgen.runner import arrival_offsets
from services.global_scheduler.policy import make_policy
from services.planner.sim_config import NetworkLatency, SimulatorConfig
from services.planner.sim_run import SimRun, SimStats, gc_paused
from services.planner.sim_config import MAX_NUM_SEQS
from services.planner.sim_workload import SimItem
from splitserve.core import build_batch_policy
from splitserve.perf.model import PerfModel
from splitserve.perf.backends import perf_model_for
from splitserve.perf.presets import max_kv_tokens

__all__ = ["Simulator", "SimulationOutcome", "NetworkLatency", "SimStats", "pd_roles", "preset_kv_blocks"]


@dataclass
class SimulationOutcome:
    """Per-request results (as `bench` records them) and what the run cost."""

    results: list[RequestResult]
    stats: SimStats


def pd_roles(num_workers: int, prefill_workers: int) -> tuple[str, ...]:
    """`prefill_workers` prefill workers, then decode workers (the pd_disaggregated pools)."""
    if not 0 < prefill_workers < num_workers:
        raise ValueError(f"prefill_workers must be in [1, {num_workers - 1}] for {num_workers} workers, "
                         f"got {prefill_workers}")
    return ("prefill",) * prefill_workers + ("decode",) * (num_workers - prefill_workers)


def preset_kv_blocks(gpu: str, model: str, tp: int = 1, block_size: int = 16, **memory: Any) -> int:
    """KV blocks per instance from the preset's memory (`perf_presets.max_kv_tokens`)."""
    blocks = max_kv_tokens(gpu, model, tp, **memory) // block_size
    if blocks <= 0:
        raise ValueError(f"{model} leaves no room for KV cache on {tp} x {gpu}")
    return blocks


class Simulator:
    """A cluster of simulated workers behind a real placement policy, run in virtual time.

    num_kv_blocks: KV blocks per worker (`preset_kv_blocks` for a preset's memory);
    placement_policy / policy_params: a `make_policy` name and its parameters;
    batch_policy / batch_policy_options: a `make_batch_policy` name and options (JSON-able; a
    policy that takes a `perf_model` and is given none gets `perf_model`, as the emulated
    worker's gets its preset: slo_aware's latency table starts from it);
    roles: each worker's role ("both", "prefill", "decode"); view_refresh_s: how stale
    the placement view is (the workers' load publishing interval); slo_ttft_ms /
    slo_itl_ms: the SLO sent with every request, as `bench --send-slo` does;
    fast_forward: apply runs of identical decode steps in bulk (same results, see `sim_worker`).
    Defaults: 16-token blocks and a 2,048-token step budget (the worker's defaults), 256
    running sequences (vLLM's; the worker's 64 suits a CPU), KV pushed in 64-token chunks
    (the coordinator's default), KV reservations waiting up to 30 s for room (the coordinator's
    default; 0: recompute at once), KV received asynchronously (the workers' NIXL pushes), loads
    100 ms stale (the workers' publishing interval).
    """

    def __init__(self, num_workers: int, perf_model: PerfModel, *, num_kv_blocks: int,
                 placement_policy: str = "least_loaded", policy_params: dict[str, Any] | None = None,
                 batch_policy: str = "fcfs", batch_policy_options: dict[str, Any] | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 2048, max_num_seqs: int = MAX_NUM_SEQS,
                 roles: Sequence[str] | None = None, view_refresh_s: float = 0.1,
                 latency: NetworkLatency = NetworkLatency(), kv_chunk_tokens: int = 64,
                 kv_reserve_wait_s: float = 30.0, kv_receive: str = "async", enable_prefix_caching: bool = True,
                 fast_forward: bool = True,
                 slo_ttft_ms: int = 0, slo_itl_ms: int = 0, worker_perf_models: Sequence[PerfModel] | None = None,
                 worker_kv_blocks: Sequence[int] | None = None):
        self.config = SimulatorConfig(
            num_workers=num_workers, perf_model=perf_model, num_kv_blocks=num_kv_blocks,
            placement_policy=placement_policy, policy_params=dict(policy_params or {}), batch_policy=batch_policy,
            batch_policy_options=dict(batch_policy_options or {}), block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            roles=tuple(roles) if roles is not None else None, view_refresh_s=view_refresh_s, latency=latency,
            kv_chunk_tokens=kv_chunk_tokens, kv_reserve_wait_s=kv_reserve_wait_s, kv_receive=kv_receive,
            enable_prefix_caching=enable_prefix_caching,
            fast_forward=fast_forward, slo_ttft_ms=slo_ttft_ms, slo_itl_ms=slo_itl_ms,
            worker_perf_models=tuple(worker_perf_models) if worker_perf_models is not None else None,
            worker_kv_blocks=tuple(worker_kv_blocks) if worker_kv_blocks is not None else None)
        # Build the policies once now, so bad names and parameters fail before any run.
        make_policy(placement_policy, deployment_perf_model=perf_model, **self.config.policy_params)
        build_batch_policy(batch_policy, self.config.batch_policy_options, perf_model=perf_model)

    @classmethod
    def from_preset(cls, num_workers: int, gpu: str = "H100", model: str = "Llama-3-8B", tp: int = 1, *,
                    dtype: str = "bf16", link: str = "rdma-400g", mem_util: float = 0.9, block_size: int = 16,
                    perf_backend: str = "auto", perf_framework: str = "vllm",
                    perf_database_version: str | None = None, **options: Any) -> Simulator:
        """Workers of `tp` x `gpu` serving `model`: step times from `perf_backend`
        (`splitserve.perf.backends.perf_model_for`: measured GPU data where covered, else
        the roofline), the preset's KV memory."""
        perf_model = perf_model_for(gpu, model, tp, backend=perf_backend, framework=perf_framework,
                                    database_version=perf_database_version, dtype=dtype, link=link)
        blocks = preset_kv_blocks(gpu, model, tp, block_size, dtype=dtype, mem_util=mem_util)
        return cls(num_workers, perf_model, num_kv_blocks=blocks, block_size=block_size, **options)

    @classmethod
    def from_pools(cls, pools: Sequence[tuple[str, int, int]], gpu: str = "H100", model: str = "Llama-3-8B", *,
                   dtype: str = "bf16", link: str = "rdma-400g", mem_util: float = 0.9, block_size: int = 16,
                   perf_backend: str = "auto", perf_framework: str = "vllm",
                   perf_database_version: str | None = None, **options: Any) -> Simulator:
        """A heterogeneous deployment: `pools` of (role, tp, count), e.g. prefill workers at TP 4
        and decode workers at TP 8, each worker with its own TP's preset times and KV memory.
        The placement policy's deployment model is the first pool's (AMPD's prefill costs)."""
        models, blocks, roles = [], [], []
        for role, tp, count in pools:
            if count <= 0:
                raise ValueError(f"pools: {role} at TP {tp} has {count} workers; give counts > 0")
            models += [perf_model_for(gpu, model, tp, backend=perf_backend, framework=perf_framework,
                                      database_version=perf_database_version, dtype=dtype, link=link)] * count
            blocks += [preset_kv_blocks(gpu, model, tp, block_size, dtype=dtype, mem_util=mem_util)] * count
            roles += [role] * count
        if not models:
            raise ValueError("pools: no workers")
        return cls(len(models), models[0], num_kv_blocks=blocks[0], block_size=block_size, roles=roles,
                   worker_perf_models=models, worker_kv_blocks=blocks, **options)

    def run(self, items: Sequence[SimItem], arrival: ArrivalProcess | Sequence[float] | None = None, *,
            seed: int = 0, max_concurrency: int | None = None, concurrency: int | None = None,
            duration_limit_s: float | None = None) -> SimulationOutcome:
        """Simulate `items` on a fresh cluster; arrivals and closed-loop options as `bench` takes them.

        Arrival offsets come from `arrival` with `np.random.default_rng([seed, 2])`, the
        generator `bench` uses, so both send the same items at the same offsets.
        """
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
        if duration_limit_s is not None and not duration_limit_s > 0:
            raise ValueError(f"duration_limit_s: must be > 0, got {duration_limit_s}")
        items = list(items)
        offsets = None if concurrency else arrival_offsets(arrival, len(items), np.random.default_rng([seed, 2]))
        with gc_paused():
            run = SimRun(self.config, items, offsets, max_concurrency=max_concurrency, concurrency=concurrency,
                         duration_limit_s=duration_limit_s)
            outcome = SimulationOutcome(run.execute(), run.stats)
            # Freed by reference counting now (the run holds no cycles), before the collector
            # is back and would walk every KV block of the cluster once more.
            del run
        return outcome
