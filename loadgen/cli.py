"""``splitserve bench``: run, sweep or capacity-search a benchmark; compare two runs.

Mounted by ``splitserve.cli`` as ``app.add_typer(bench_app, name="bench")``; also runnable
alone: ``python -c "from loadgen.cli import bench_app; bench_app()" --help``.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path
from typing import Any, Callable, List, Optional

import numpy as np
import typer
from rich.console import Console

from loadgen.arrivals import ArrivalProcess
from loadgen.bench_config import (
    DEFAULT_SHAPE,
    DEFAULT_VOCAB_SIZE,
    BenchOptions,
    Workload,
    arrival_at_rate,
    build_workload,
    describe_arrival,
    resolve_arrival,
)
from loadgen.metrics import RequestResult, Slo, find_capacity, summarize
from loadgen.report import LiveProgress, compare, machine_info, run_record, summary_table, write_csv, write_json
from loadgen.runner import run_benchmark
from loadgen.targets import make_target, vocab_size_of_model

__all__ = ["bench_app", "run_bench"]

bench_app = typer.Typer(help="Benchmark a splitserve gateway (gRPC) or any OpenAI-compatible server (HTTP).",
                        add_completion=False)
console = Console()


# Options `splitserve bench` and `splitserve simulate` share word for word.
SLO_MAX_GAP_OPTION = typer.Option(None, "--slo-max-gap-ms", help="Also miss a request when any one gap between "
                                  "its tokens exceeds this (ms): exposes stalls, e.g. waiting for a decode slot, "
                                  "that the per-request p99 hides. Off by default.")
RATE_MAX_OPTION = typer.Option(None, "--rate-max", help="Capacity search: never probe above this rate; passing "
                               "there ends the search (reported as capped).")


def _slo(opts: BenchOptions) -> Slo:
    """The SLO the options ask for, in seconds; bad values name their flag."""
    for flag, value in (("--slo-ttft-ms", opts.slo_ttft_ms), ("--slo-itl-ms", opts.slo_itl_ms),
                        ("--slo-incremental-ttft-ms", opts.slo_incremental_ttft_ms),
                        ("--slo-max-gap-ms", opts.slo_max_gap_ms)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag}: must be > 0, got {value}")
    incremental = None if opts.slo_incremental_ttft_ms is None else opts.slo_incremental_ttft_ms / 1000
    max_gap = None if opts.slo_max_gap_ms is None else opts.slo_max_gap_ms / 1000
    return Slo(opts.slo_ttft_ms / 1000, opts.slo_itl_ms / 1000, incremental, max_gap)


def _new_target(opts: BenchOptions, model: str | None = None) -> Any:
    send = opts.send_slo
    return make_target(opts.target, api_key=opts.api_key, model=opts.model or model,
                       slo_ttft_ms=round(opts.slo_ttft_ms) if send else None,
                       slo_itl_ms=round(opts.slo_itl_ms) if send else None)


async def _target_info(opts: BenchOptions) -> dict[str, Any]:
    target = _new_target(opts)
    try:
        return await target.info()
    finally:
        await target.aclose()


async def _run_once(opts: BenchOptions, model: str | None, items: list, arrival: ArrivalProcess | None,
                    title: str) -> list[RequestResult]:
    target = _new_target(opts, model)  # the model id is known: no lookup inside the first request's timing
    try:
        with LiveProgress(title=title) as live:
            progress = live if opts.progress else None
            return await run_benchmark(target, items, arrival, opts.max_concurrency, opts.duration_limit_s,
                                       progress, concurrency=opts.concurrency,
                                       rng=np.random.default_rng([opts.seed, 2]))
    finally:
        await target.aclose()


def _measure(opts: BenchOptions, info: dict[str, Any], workload: Workload, vocab_size: int,
             arrival: ArrivalProcess | None, title: str) -> list[RequestResult]:
    # A fresh run tag per run: session ids never collide with an earlier run's on the server.
    items = workload.make_items(uuid.uuid4().hex[:8], vocab_size)
    return asyncio.run(_run_once(opts, info.get("model"), items, arrival, title))


def _write_run(out_dir: Path, stem: str, results: list[RequestResult], record: dict[str, Any], slo: Slo,
               plots: bool) -> list[Path]:
    from loadgen.plots import plot_latency_cdfs, plot_timeline

    paths = [write_json(out_dir / f"{stem}.json", record), write_csv(out_dir / f"{stem}.csv", results, slo)]
    if plots:
        paths.append(plot_latency_cdfs(results, slo, out_dir / f"{stem}_latency_cdf.png"))
        paths.append(plot_timeline(results, slo, out_dir / f"{stem}_timeline.png"))
    return paths


def check_rate_options(opts: BenchOptions) -> None:
    """Sweep / capacity-search options that cannot go together or are out of range; names the flag."""
    if opts.concurrency and (opts.sweep_rates or opts.find_capacity):
        raise ValueError("--concurrency (closed loop) has no rate: it cannot be swept or capacity-searched")
    if opts.sweep_rates and opts.find_capacity:
        raise ValueError("choose one of --sweep-rates and --find-capacity")
    if opts.rate_max is not None:
        if not opts.find_capacity:
            raise ValueError("--rate-max bounds the capacity search: give --find-capacity too")
        if not (math.isfinite(opts.rate_max) and opts.rate_max >= opts.rate_hi):
            raise ValueError(f"--rate-max: must be finite and >= --rate-hi ({opts.rate_hi:g}), got {opts.rate_max:g}")


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run what ``opts`` asks (one run, a rate sweep or a capacity search); returns the JSON record."""
    # Options are checked before the target is contacted.
    check_rate_options(opts)
    slo = _slo(opts)
    workload = build_workload(opts)
    arrival = resolve_arrival(opts, workload)
    info = asyncio.run(_target_info(opts))
    if "error" in info:
        console.print(f"[yellow]warning: cannot describe the target: {info['error']}[/]")
    vocab_size = opts.vocab_size or vocab_size_of_model(opts.model or info.get("model")) or DEFAULT_VOCAB_SIZE
    config = {"options": opts.to_dict(), "target": info, "vocab_size": vocab_size, "workload_kind": workload.kind,
              "workload": workload.description, "arrival": describe_arrival(arrival, opts.concurrency)}
    out_dir = opts.out_dir
    written: list[Path] = []

    if not (opts.sweep_rates or opts.find_capacity):
        results = _measure(opts, info, workload, vocab_size, arrival, "bench")
        summary = summarize(results, slo)
        console.print(summary_table(summary))
        record = run_record(summary, config, results if opts.per_request else None)
        if out_dir:
            written = _write_run(out_dir, "bench", results, record, slo, plots=True)
        print_written(written)
        return record

    def at_rate(rate: float, arrival_now: ArrivalProcess) -> tuple[list[RequestResult], dict[str, Any], str]:
        return _measure(opts, info, workload, vocab_size, arrival_now, f"rate {rate:g}/s"), {}, ""

    return run_rates(opts, config, slo, arrival, at_rate, written)


# One run at (rate, its arrival process): its results, extra fields for its JSON record, a note for its console line.
RateRun = Callable[[float, ArrivalProcess], "tuple[list[RequestResult], dict[str, Any], str]"]


def run_rates(opts: BenchOptions, config: dict[str, Any], slo: Slo, arrival: ArrivalProcess, run_at: RateRun,
              written: list[Path]) -> dict[str, Any]:
    """A rate sweep or a capacity search (DynaServe's serving capacity) over `run_at`; returns the JSON record.

    Shared by `splitserve bench` (real runs) and `splitserve simulate` (simulated ones), so
    both write the same points, files and plots.
    """
    points: list[dict[str, Any]] = []

    def measure(rate: float) -> float:
        results, extra, note = run_at(rate, arrival_at_rate(arrival, rate))
        summary = summarize(results, slo)
        points.append({"rate": rate, "attainment": summary.slo_attainment,
                       "goodput_tokens_per_s": summary.goodput_tokens_per_s, "summary": summary.to_dict(), **extra})
        console.print(f"rate {rate:g}/s: attainment {summary.slo_attainment:.1%}, "
                      f"goodput {summary.goodput_tokens_per_s:,.1f} tok/s, {summary.n_failed} failed{note}")
        if opts.out_dir:
            run_config = {**config, "arrival": describe_arrival(arrival_at_rate(arrival, rate)), "rate": rate}
            record = run_record(summary, run_config, results if opts.per_request else None, **extra)
            written.extend(_write_run(opts.out_dir, f"rate-{rate:g}", results, record, slo, plots=False))
        return summary.slo_attainment

    extra: dict[str, Any] = {}
    if opts.find_capacity:
        capacity = find_capacity(measure, opts.target_attainment, opts.rate_lo, opts.rate_hi, opts.rate_tol,
                                 opts.max_probes, max_rate=opts.rate_max)
        extra["capacity"] = capacity.to_dict()
        if capacity.capped:
            console.print(f"[bold]capacity[/]: at least {capacity.rate:g} req/s: it still meets "
                          f"{opts.target_attainment:.0%} attainment at --rate-max")
        else:
            console.print(f"[bold]capacity[/]: {capacity.rate:g} req/s meets {opts.target_attainment:.0%} attainment "
                          f"(first failing rate {capacity.fail_rate:g}, converged={capacity.converged})")
    else:
        for rate in sorted(opts.sweep_rates):
            measure(rate)
    record = {"config": config, "machine": machine_info(), "points": points, **extra}
    if opts.out_dir:
        from loadgen.plots import plot_attainment_vs_rate

        stem = "capacity" if opts.find_capacity else "sweep"
        written.append(write_json(opts.out_dir / f"{stem}.json", record))
        written.append(plot_attainment_vs_rate(points, opts.out_dir / "attainment_vs_rate.png",
                                               opts.target_attainment if opts.find_capacity else None))
    print_written(written)
    return record


def print_written(paths: list[Path]) -> None:
    for path in paths:
        console.print(f"wrote {path}")


def _nothing_succeeded(record: dict[str, Any]) -> bool:
    summaries = [record["summary"]] if "summary" in record else [p["summary"] for p in record.get("points", [])]
    return bool(summaries) and all(s["n_ok"] == 0 for s in summaries)


def _floats(text: str | None, name: str) -> list[float]:
    if not text:
        return []
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=name) from None
    if any(not v > 0 for v in values):
        raise typer.BadParameter("rates must be > 0", param_hint=name)
    return values


def bench(
    ctx: typer.Context,
    target: str = typer.Option("127.0.0.1:50051", "--target", help="gRPC gateway host:port, or an http(s) URL "
                               "ending in /v1 for any OpenAI-compatible server."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPLITSERVE_API_KEY", help="Bearer API key."),
    model: Optional[str] = typer.Option(None, "--model", help="Model id (default: the first the server lists)."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Azure CSV or Mooncake JSONL trace: lengths "
                                         "(and, with --arrival trace, timestamps)."),
    length_scale: float = typer.Option(1.0, "--length-scale", help="Multiply prompt/output lengths (reported)."),
    num_requests: int = typer.Option(100, "--num-requests", "-n", help="Requests to send (trace: first N rows)."),
    trace_time_scale: float = typer.Option(1.0, "--trace-time-scale", help="Trace replay speed-up (2 = 2x faster)."),
    shape: Optional[List[str]] = typer.Option(None, "--shape", help=f"Request shape(s) P<prompt>/D<output>, "
                                              f"repeatable or comma list (default {DEFAULT_SHAPE})."),
    sessions: Optional[str] = typer.Option(None, "--sessions", help="Multi-round session preset: toolbench | gaia | "
                                           "hotpotqa | dureader."),
    num_sessions: int = typer.Option(10, "--num-sessions", help="Sessions to run with --sessions."),
    tool_delay: str = typer.Option("exponential:mean=1", "--tool-delay", help="Delay between session rounds: "
                                   "exponential:mean=S | constant:mean=S | none."),
    arrival: Optional[str] = typer.Option(None, "--arrival", help="poisson:rate=R | gamma:rate=R,burstiness=B | "
                                          "constant:rate=R | trace (default: trace with --trace, else poisson:rate=1)."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help="Closed loop: N clients sending back "
                                              "to back (ignores --arrival)."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="Cap on requests in flight "
                                                  "(open loop)."),
    duration_limit: Optional[float] = typer.Option(None, "--duration-limit", "--duration", help="Stop after S "
                                                   "seconds; requests still streaming are cut off."),
    slo_ttft_ms: float = typer.Option(1000.0, "--slo-ttft-ms", help="TTFT SLO (ms)."),
    slo_itl_ms: float = typer.Option(100.0, "--slo-itl-ms", help="Per-request p99 inter-token latency SLO (ms)."),
    slo_incremental_ttft_ms: Optional[float] = typer.Option(None, "--slo-incremental-ttft-ms",
                                                            help="TTFT SLO of session rounds > 0 (ms)."),
    slo_max_gap_ms: Optional[float] = SLO_MAX_GAP_OPTION,
    send_slo: bool = typer.Option(True, "--send-slo/--no-send-slo", help="Send the SLO with each request "
                                  "(splitserve's SLO-aware policies use it; other servers ignore it)."),
    find_capacity_: bool = typer.Option(False, "--find-capacity", help="Search the highest rate meeting "
                                        "--target-attainment (each probe is a full run)."),
    target_attainment: float = typer.Option(0.9, "--target-attainment", help="SLO attainment to meet."),
    rate_lo: float = typer.Option(0.5, "--rate-lo", help="Capacity search: first (low) rate probed."),
    rate_hi: float = typer.Option(8.0, "--rate-hi", help="Capacity search: first high rate probed."),
    rate_max: Optional[float] = RATE_MAX_OPTION,
    rate_tol: float = typer.Option(0.25, "--rate-tol", help="Capacity search: stop when the bracket is this narrow."),
    max_probes: int = typer.Option(8, "--max-probes", help="Capacity search: at most this many runs."),
    sweep_rates: Optional[str] = typer.Option(None, "--sweep-rates", help="Comma list of rates, one run each "
                                              "(attainment-vs-rate plot)."),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Write JSON, CSV and PNG plots here."),
    per_request: bool = typer.Option(False, "--per-request", help="Include per-request records in the JSON."),
    seed: int = typer.Option(0, "--seed", help="Seed of every random draw (tokens, lengths, arrivals)."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Synthetic token ids in [0, V) (default: "
                                             "the model's when it is a local directory, else 256)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Live progress on a terminal."),
) -> None:
    """Run a benchmark (the default command)."""
    if ctx.invoked_subcommand is not None:
        return
    opts = BenchOptions(
        target=target, api_key=api_key, model=model, trace=trace, length_scale=length_scale,
        num_requests=num_requests, trace_time_scale=trace_time_scale, shapes=list(shape or []), sessions=sessions,
        num_sessions=num_sessions, tool_delay=tool_delay, arrival=arrival, concurrency=concurrency,
        max_concurrency=max_concurrency, duration_limit_s=duration_limit, slo_ttft_ms=slo_ttft_ms,
        slo_itl_ms=slo_itl_ms, slo_incremental_ttft_ms=slo_incremental_ttft_ms, slo_max_gap_ms=slo_max_gap_ms,
        send_slo=send_slo, find_capacity=find_capacity_, target_attainment=target_attainment, rate_lo=rate_lo,
        rate_hi=rate_hi, rate_max=rate_max,
        rate_tol=rate_tol, max_probes=max_probes, sweep_rates=_floats(sweep_rates, "--sweep-rates"),
        out_dir=out_dir, per_request=per_request, seed=seed, vocab_size=vocab_size, progress=progress)
    try:
        record = run_bench(opts)
    except (ValueError, OSError) as err:
        console.print(f"[red]error:[/] {err}")
        raise typer.Exit(2) from None
    if _nothing_succeeded(record):
        raise typer.Exit(1)  # scripts notice a run where every request failed


# The run is both the group's default (`splitserve bench ...`) and an explicit `run` command.
bench_app.callback(invoke_without_command=True)(bench)
bench_app.command("run")(bench)


@bench_app.command("compare")
def compare_command(
    a_json: Path = typer.Argument(..., exists=True, dir_okay=False, help="Baseline run JSON (A)."),
    b_json: Path = typer.Argument(..., exists=True, dir_okay=False, help="Run JSON to compare (B)."),
    json_out: Optional[Path] = typer.Option(None, "--json-out", help="Also write the ratios as JSON."),
) -> None:
    """Print every headline metric of A and B and the ratio B/A."""
    try:
        table, rows = compare(a_json, b_json)
    except ValueError as err:
        console.print(f"[red]error:[/] {err}")
        raise typer.Exit(2) from None
    console.print(table)
    if json_out:
        write_json(json_out, {"a": str(a_json), "b": str(b_json), "metrics": rows})
        console.print(f"wrote {json_out}")
