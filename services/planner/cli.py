"""``splitserve simulate``: `splitserve bench`'s workloads on a simulated cluster, in virtual time.

Takes the workload, arrival, SLO, rate and output options it shares with `splitserve bench`
(:mod:`loadgen.options`) plus the cluster's shape, and writes the same JSON/CSV/PNG reports, so
``splitserve bench compare`` compares simulated and measured runs. Mounted by the lead
as ``app.add_typer(simulate_app, name="simulate")``; runnable alone:
``python -c "from services.planner.cli import simulate_app; simulate_app()" --help``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import typer

from loadgen.bench_config import BenchOptions, describe_arrival
from loadgen.metrics import RequestResult
from loadgen.options import (build_slo, check_rate_options, console, report_run, run_command, run_rates,
                             with_shared_options)
from services.planner.sim_config import NetworkLatency
from services.planner.sim_workload import SimWorkload, build_sim_workload
from services.planner.simulator import SimulationOutcome, Simulator, pd_roles, preset_kv_blocks
from splitserve.core.designs import DesignChoice, resolve_design
from splitserve.perf.backends import PERF_BACKEND_HELP, PERF_DATABASE_VERSION_HELP, PERF_FRAMEWORK_HELP, perf_model_for
from splitserve.perf.store import load_perf_model

__all__ = ["simulate_app", "ClusterOptions", "build_simulator", "run_simulation"]

# --perf-backend / --perf-framework / --perf-database-version, shared by `simulate` and `plan`.
PERF_BACKEND_OPTION = ("auto", "--perf-backend")
PERF_FRAMEWORK_OPTION = ("vllm", "--perf-framework")
PERF_DATABASE_VERSION_OPTION = (None, "--perf-database-version")
PERF_OPTION_KW = {"--perf-backend": dict(help=PERF_BACKEND_HELP, envvar="SPLITSERVE_PERF_BACKEND"),
                  "--perf-framework": dict(help=PERF_FRAMEWORK_HELP, envvar="SPLITSERVE_PERF_FRAMEWORK"),
                  "--perf-database-version": dict(help=PERF_DATABASE_VERSION_HELP,
                                                  envvar="SPLITSERVE_PERF_DATABASE_VERSION")}


def perf_option(default_and_flag: tuple) -> Any:
    """The typer option of one of the three perf-backend flags."""
    return typer.Option(default_and_flag[0], default_and_flag[1], **PERF_OPTION_KW[default_and_flag[1]])


simulate_app = typer.Typer(help="Simulate a splitserve cluster in virtual time: the real policies, "
                                "step times from the performance model.", add_completion=False)


@dataclass
class ClusterOptions:
    """The simulated cluster `splitserve simulate` was asked for."""

    workers: int = 8
    gpu: str = "H100"
    model_preset: str = "Llama-3-8B"
    tp: int = 1
    dtype: str = "bf16"
    link: str = "rdma-400g"
    perf_model: Path | None = None
    perf_backend: str = "auto"
    perf_framework: str = "vllm"
    perf_database_version: str | None = None
    policy: str = "least_loaded"  # placement, or a design's name (dynaserve | laps | ampd): the whole design
    policy_params: dict[str, str] = field(default_factory=dict)
    batch_policy: str | None = None  # None / "": the design's local batch policy, else fcfs
    batch_policy_options: dict[str, str] = field(default_factory=dict)
    prefill_workers: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    kv_blocks: int | None = None
    view_refresh_ms: float = 100.0
    kv_chunk_tokens: int = 64
    kv_reserve_wait_s: float = 30.0
    kv_receive: str = "async"
    prefix_caching: bool = True
    fast_forward: bool = True
    dispatch_ms: float = 1.0
    handoff_ms: float = 0.5
    stream_ms: float = 0.5

    def __post_init__(self) -> None:
        self.batch_policy = self.design.batch_policy  # the resolved name goes to the Simulator and the report

    @property
    def design(self) -> DesignChoice:
        """The placement and local batch policy simulated (a design's, or its ablation)."""
        return resolve_design(self.policy, self.batch_policy)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view."""
        data = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}
        data["design"] = self.design.describe()
        return data


def build_simulator(cluster: ClusterOptions, slo_ttft_ms: int = 0, slo_itl_ms: int = 0) -> Simulator:
    """The Simulator for `cluster`: the preset's KV memory; step times from a fitted model when
    given, else from `--perf-backend` (measured GPU data where covered, else the roofline)."""
    if cluster.perf_model is not None:  # a JSON file, or redis:WORKER_ID: what `splitserve profile` stored
        perf_model = load_perf_model(str(cluster.perf_model))
    else:
        perf_model = perf_model_for(cluster.gpu, cluster.model_preset, cluster.tp, backend=cluster.perf_backend,
                                    framework=cluster.perf_framework, database_version=cluster.perf_database_version,
                                    dtype=cluster.dtype, link=cluster.link)
    blocks = cluster.kv_blocks or preset_kv_blocks(cluster.gpu, cluster.model_preset, cluster.tp, cluster.block_size,
                                                   dtype=cluster.dtype)
    roles = pd_roles(cluster.workers, cluster.prefill_workers) if cluster.prefill_workers else None
    latency = NetworkLatency(cluster.dispatch_ms / 1000, cluster.handoff_ms / 1000, cluster.stream_ms / 1000)
    return Simulator(cluster.workers, perf_model, num_kv_blocks=blocks, placement_policy=cluster.policy,
                     policy_params=cluster.policy_params, batch_policy=cluster.batch_policy,
                     batch_policy_options=cluster.batch_policy_options, block_size=cluster.block_size, max_num_batched_tokens=cluster.max_num_batched_tokens,
                     max_num_seqs=cluster.max_num_seqs, roles=roles, view_refresh_s=cluster.view_refresh_ms / 1000,
                     latency=latency, kv_chunk_tokens=cluster.kv_chunk_tokens,
                     kv_reserve_wait_s=cluster.kv_reserve_wait_s, kv_receive=cluster.kv_receive,
                     enable_prefix_caching=cluster.prefix_caching, fast_forward=cluster.fast_forward,
                     slo_ttft_ms=slo_ttft_ms, slo_itl_ms=slo_itl_ms)


def _simulate(sim: Simulator, opts: BenchOptions, items: list, arrival: Any) -> SimulationOutcome:
    return sim.run(items, arrival, seed=opts.seed, max_concurrency=opts.max_concurrency,
                   concurrency=opts.concurrency, duration_limit_s=opts.duration_limit_s)


def _stats_line(outcome: SimulationOutcome) -> str:
    s = outcome.stats
    rate = len(outcome.results) / s.wall_s if s.wall_s > 0 else math.inf
    return (f"simulated {s.virtual_s:,.1f} s in {s.wall_s:,.2f} s wall ({len(outcome.results):,} requests, "
            f"{rate:,.0f} requests/s; {s.steps:,} engine steps, {s.kv_transfers:,} KV transfers, "
            f"{s.preemptions:,} preemptions, workers {s.worker_busy_fraction:.0%} busy)")


def run_simulation(opts: BenchOptions, cluster: ClusterOptions) -> dict[str, Any]:
    """Simulate what `opts` asks (one run, a rate sweep or a capacity search); returns the JSON record."""
    check_rate_options(opts)
    slo = build_slo(opts)
    workload = build_sim_workload(opts)
    arrival = workload.arrival
    send = opts.send_slo
    sim = build_simulator(cluster, round(opts.slo_ttft_ms) if send else 0, round(opts.slo_itl_ms) if send else 0)
    console.print(sim.config.perf_model.timing_note)
    console.print(f"design: {cluster.design.describe()}")
    target = {"kind": "simulator", "cluster": cluster.to_dict(), "simulator": sim.config.to_dict(),
              "step_times": sim.config.perf_model.timing_note}
    config = {"options": opts.to_dict(), "target": target, "vocab_size": None,
              "workload_kind": workload.workload.kind, "workload": workload.workload.description,
              "arrival": describe_arrival(arrival, opts.concurrency)}

    if not (opts.sweep_rates or opts.find_capacity):
        outcome = _simulate(sim, opts, workload.items, arrival)
        return report_run(opts, config, slo, "simulate", outcome.results, "simulation summary",
                          notes=(_stats_line(outcome),), simulation=asdict(outcome.stats))

    def at_rate(rate: float, arrival_now: Any, count: int) -> tuple[list[RequestResult], dict[str, Any], str]:
        items = workload.items if count == len(workload.items) else workload.make_items(count)
        outcome = _simulate(sim, opts, items, arrival_now)
        return outcome.results, {"simulation": asdict(outcome.stats)}, f" ({outcome.stats.wall_s:.2f} s wall)"

    return run_rates(opts, config, slo, arrival, at_rate, workload.workload)


def _key_values(items: list[str] | None, name: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise typer.BadParameter(f"expected key=value, got {item!r}", param_hint=name)
        params[key.strip()] = value.strip()
    return params


@with_shared_options
def simulate(
    ctx: typer.Context,
    opts: BenchOptions,  # the workload, SLO, rate and output options of `splitserve bench` (loadgen.options)
    # ---- the simulated cluster ----
    workers: int = typer.Option(8, "--workers", help="Simulated workers (instances of --tp GPUs each)."),
    gpu: str = typer.Option("H100", "--gpu", help="GPU preset: A100 | H100 | H200 | L40S | RTX4090."),
    model_preset: str = typer.Option("Llama-3-8B", "--model-preset", help="Model preset: Llama-3-8B | Qwen2.5-14B | "
                                     "Qwen2.5-32B | Llama-3.1-70B."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs per worker."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp8 (linear layers)."),
    link: str = typer.Option("rdma-400g", "--link", help="KV transfer link: rdma-400g | rdma-200g | nvlink | pcie | "
                             "tcp-10g."),
    perf_model: Optional[Path] = typer.Option(None, "--perf-model", help="Fitted perf model (`splitserve "
                                              "profile`): a JSON file, or redis:WORKER_ID (SPLITSERVE_REDIS_URL, "
                                              "SPLITSERVE_REDIS_PREFIX), instead of the preset's times; memory stays "
                                              "the preset's."),
    perf_backend: str = perf_option(PERF_BACKEND_OPTION),
    perf_framework: str = perf_option(PERF_FRAMEWORK_OPTION),
    perf_database_version: Optional[str] = perf_option(PERF_DATABASE_VERSION_OPTION),
    policy: str = typer.Option("least_loaded", "--policy", help="Placement policy (round_robin | least_loaded | "
                               "pd_disaggregated | split | any registered), or a design's name (dynaserve | laps | "
                               "ampd): its placement and its local batch policy."),
    policy_param: Optional[List[str]] = typer.Option(None, "--policy-param", help="Placement policy parameter "
                                                     "key=value (repeatable), e.g. split_ratio=0.4."),
    batch_policy: Optional[str] = typer.Option(None, "--batch-policy", envvar="SPLITSERVE_SIMULATE_BATCH_POLICY",
                                     show_default=False, help="Default: the --policy design's (dynaserve: "
                                     "slo_aware, laps: laps, ampd: prefill_reorder), else fcfs; another one beside a "
                                     "design is an ablation. Workers' local batch policy: fcfs | slo_aware "
                                     "(DynaServe Alg. 2: decodes first, prefill up to what the ITL SLO leaves room "
                                     "for, by a latency table seeded from the simulated perf model) | prefill_reorder (AMPD Alg. 2: the "
                                     "queue head's window reordered to meet the most TTFT SLOs) | laps (LAPS: short/long prefills "
                                     "apart, AWD batching) | any registered."),
    batch_policy_option: Optional[List[str]] = typer.Option(None, "--batch-policy-option", help="Batch policy option "
                                                            "key=value (repeatable), e.g. itl_slo_ms=100 (slo_aware's "
                                                            "ITL target for requests sent without one, see "
                                                            "--send-slo), target_fraction=0.9, min_prefill_tokens=16."),
    prefill_workers: Optional[int] = typer.Option(None, "--prefill-workers", help="The first N workers take role "
                                                  "prefill, the rest decode (for pd_disaggregated)."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="Token budget of one step."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Most requests running at once per worker."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="KV blocks per worker (default: what fits "
                                            "beside the weights in 90% of the GPU memory)."),
    view_refresh_ms: float = typer.Option(100.0, "--view-refresh-ms", help="Staleness of the load view placement "
                                          "sees (the workers' load publishing interval)."),
    kv_chunk_tokens: int = typer.Option(64, "--kv-chunk-tokens", help="Tokens per pushed KV chunk between stages."),
    kv_reserve_wait_s: float = typer.Option(30.0, "--kv-reserve-wait-s", help="How long a stage waits in line for "
                                            "room for its KV on the next stage's worker before it is sent anyway "
                                            "and that range recomputed there (the coordinator's option); 0: at once."),
    kv_receive: str = typer.Option("async", "--kv-receive", help="How a stage's KV reaches the next worker: "
                                   "async (this project's workers: pushes overlap its steps) | blocking (vLLM v0's "
                                   "connector: pulled inside the step that first schedules the stage, its batch "
                                   "waiting)."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching", help="Engine prefix caching."),
    fast_forward: bool = typer.Option(True, "--fast-forward/--no-fast-forward", help="Apply runs of identical "
                                      "decode steps in bulk (same results, faster)."),
    dispatch_ms: float = typer.Option(1.0, "--dispatch-ms", help="Send -> first stage queued on its worker."),
    handoff_ms: float = typer.Option(0.5, "--handoff-ms", help="Stage end -> next stage queued on its worker."),
    stream_ms: float = typer.Option(0.5, "--stream-ms", help="Token sampled -> seen by the client."),
) -> None:
    """Simulate a workload on a cluster (the default command)."""
    if ctx.invoked_subcommand is not None:
        return
    opts = dataclasses.replace(opts, target="simulator", progress=False)
    cluster = ClusterOptions(
        workers=workers, gpu=gpu, model_preset=model_preset, tp=tp, dtype=dtype, link=link, perf_model=perf_model,
        perf_backend=perf_backend, perf_framework=perf_framework, perf_database_version=perf_database_version,
        policy=policy, policy_params=_key_values(policy_param, "--policy-param"), batch_policy=batch_policy,
        batch_policy_options=_key_values(batch_policy_option, "--batch-policy-option"), prefill_workers=prefill_workers, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        block_size=block_size, kv_blocks=kv_blocks, view_refresh_ms=view_refresh_ms,
        kv_chunk_tokens=kv_chunk_tokens, kv_reserve_wait_s=kv_reserve_wait_s, kv_receive=kv_receive,
        prefix_caching=prefix_caching,
        fast_forward=fast_forward, dispatch_ms=dispatch_ms, handoff_ms=handoff_ms, stream_ms=stream_ms)
    run_command(lambda: run_simulation(opts, cluster))


# The simulation is both the group's default (`splitserve simulate ...`) and an explicit `run`.
simulate_app.callback(invoke_without_command=True)(simulate)
simulate_app.command("run")(simulate)
