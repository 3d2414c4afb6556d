"""What `splitserve bench` and `splitserve simulate` share: their options and what both do with them.

Every option the two commands share (workload, arrival, SLO, rate sweep / capacity
search, output) is declared once here, in the groups below. ``with_shared_options`` gives
a command function all of them as typer parameters and hands it their values as one
:class:`~loadgen.bench_config.BenchOptions`. The helpers after it are what both commands
do with those options: the SLO, the rate checks, one run's report, the rate sweep /
capacity search driver and the exit code.

Nothing here, nor anything it imports, reaches a serving target (no gRPC, HTTP client,
Redis or torch): the simulator's CLI builds on this module and runs without them.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from loadgen.arrivals import ArrivalProcess
from loadgen.bench_config import (
    DEFAULT_NUM_REQUESTS,
    DEFAULT_NUM_SESSIONS,
    DEFAULT_SHAPE,
    BenchOptions,
    Workload,
    describe_arrival,
    probe_arrival,
)
from loadgen.metrics import RequestResult, Slo, find_capacity, summarize
from loadgen.probes import probe_count, steady_state
from loadgen.report import machine_info, run_record, summary_table, write_csv, write_json

__all__ = [
    "SharedOption", "WORKLOAD_OPTIONS", "ARRIVAL_OPTIONS", "SLO_OPTIONS", "RATE_OPTIONS", "OUTPUT_OPTIONS",
    "SHARED_OPTIONS", "with_shared_options", "parse_rates", "build_slo", "check_rate_options", "RateRun",
    "report_run", "probe_size", "run_rates", "write_run", "print_written", "run_command",
]

console = Console()


def parse_rates(text: str | None, name: str) -> list[float]:
    """'5,40' -> [5.0, 40.0]; None or '' -> []; a bad list is a usage error naming the option."""
    if not text:
        return []
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=name) from None
    if any(not v > 0 for v in values):
        raise typer.BadParameter("rates must be > 0", param_hint=name)
    return values


@dataclass(frozen=True)
class SharedOption:
    """One option both commands take: the BenchOptions field it fills, its type and its typer declaration.

    ``parse`` turns what typer parsed into the field's value (None: taken as it is).
    """

    field: str
    annotation: Any
    option: Any  # typer.models.OptionInfo: flags, default and help
    parse: Callable[[Any], Any] | None = None


def _shapes(given: list[str] | None) -> list[str]:
    return list(given or [])


def _sweep_rates(text: str | None) -> list[float]:
    return parse_rates(text, "--sweep-rates")


WORKLOAD_OPTIONS = (
    SharedOption("trace", Optional[Path], typer.Option(
        None, "--trace", help="Azure CSV or Mooncake JSONL trace: lengths (and, with --arrival trace, timestamps).")),
    SharedOption("length_scale", float, typer.Option(
        1.0, "--length-scale", help="Multiply prompt/output lengths (reported).")),
    SharedOption("num_requests", Optional[int], typer.Option(
        None, "--num-requests", "-n", help=f"Requests to send (trace: first N rows; default {DEFAULT_NUM_REQUESTS}). "
        "A rate sweep or capacity search sizes each probe by --probe-window instead: there -n needs "
        "--probe-window 0 (exactly N requests per probe).")),
    SharedOption("trace_time_scale", float, typer.Option(
        1.0, "--trace-time-scale", help="Trace replay speed-up (2 = 2x faster).")),
    SharedOption("shapes", Optional[List[str]], typer.Option(
        None, "--shape", help=f"Request shape(s) P<prompt>/D<output>, repeatable or comma list "
        f"(default {DEFAULT_SHAPE})."), parse=_shapes),
    SharedOption("sessions", Optional[str], typer.Option(
        None, "--sessions", help="Multi-round session preset: toolbench | gaia | hotpotqa | dureader.")),
    SharedOption("num_sessions", Optional[int], typer.Option(
        None, "--num-sessions", help=f"Sessions to run with --sessions (default {DEFAULT_NUM_SESSIONS}); in a rate "
        "sweep or capacity search, as -n.")),
    SharedOption("tool_delay", str, typer.Option(
        "exponential:mean=1", "--tool-delay", help="Delay between session rounds: exponential:mean=S | "
        "constant:mean=S | none.")),
    SharedOption("seed", int, typer.Option(
        0, "--seed", help="Seed of every random draw (tokens, lengths, sessions, arrivals).")),
)

ARRIVAL_OPTIONS = (
    SharedOption("arrival", Optional[str], typer.Option(
        None, "--arrival", help="poisson:rate=R | gamma:rate=R,burstiness=B | constant:rate=R | trace "
        "(default: trace with --trace, else poisson:rate=1).")),
    SharedOption("concurrency", Optional[int], typer.Option(
        None, "--concurrency", help="Closed loop: N clients sending back to back (ignores --arrival).")),
    SharedOption("max_concurrency", Optional[int], typer.Option(
        None, "--max-concurrency", help="Cap on requests in flight (open loop).")),
    SharedOption("duration_limit_s", Optional[float], typer.Option(
        None, "--duration-limit", "--duration", help="Stop after S seconds (simulated: virtual seconds); "
        "requests not finished by then are cut off.")),
)

SLO_OPTIONS = (
    SharedOption("slo_ttft_ms", float, typer.Option(1000.0, "--slo-ttft-ms", help="TTFT SLO (ms).")),
    SharedOption("slo_itl_ms", float, typer.Option(
        100.0, "--slo-itl-ms", help="Per-request p99 inter-token latency SLO (ms).")),
    SharedOption("slo_incremental_ttft_ms", Optional[float], typer.Option(
        None, "--slo-incremental-ttft-ms", help="TTFT SLO of session rounds > 0 (ms).")),
    SharedOption("slo_max_gap_ms", Optional[float], typer.Option(
        None, "--slo-max-gap-ms", help="Also miss a request when any one gap between its tokens exceeds this "
        "(ms): exposes stalls, e.g. waiting for a decode slot, that the per-request p99 hides. Off by default.")),
    SharedOption("send_slo", bool, typer.Option(
        True, "--send-slo/--no-send-slo", help="Send the SLO with each request: splitserve's SLO-aware policies "
        "use it (the simulated ones too); other servers ignore it.")),
)

RATE_OPTIONS = (
    SharedOption("find_capacity", bool, typer.Option(
        False, "--find-capacity", help="Search the highest rate meeting --target-attainment (each probe is a "
        "full run).")),
    SharedOption("target_attainment", float, typer.Option(
        0.9, "--target-attainment", help="SLO attainment to meet.")),
    SharedOption("rate_lo", float, typer.Option(0.5, "--rate-lo", help="Capacity search: first (low) rate probed.")),
    SharedOption("rate_hi", float, typer.Option(8.0, "--rate-hi", help="Capacity search: first high rate probed.")),
    SharedOption("rate_max", Optional[float], typer.Option(
        None, "--rate-max", help="Capacity search: never probe above this rate; passing there ends the search "
        "(reported as capped).")),
    SharedOption("rate_tol", float, typer.Option(
        0.25, "--rate-tol", help="Capacity search: stop when the bracket is this narrow.")),
    SharedOption("max_probes", int, typer.Option(8, "--max-probes", help="Capacity search: at most this many runs.")),
    SharedOption("sweep_rates", Optional[str], typer.Option(
        None, "--sweep-rates", help="Comma list of rates, one run each (attainment-vs-rate plot)."),
        parse=_sweep_rates),
    SharedOption("probe_window_s", float, typer.Option(
        60.0, "--probe-window", envvar="SPLITSERVE_PROBE_WINDOW", show_envvar=True, help="Rate sweep / capacity "
        "search: seconds of arrivals each probe offers; a probe at rate R sends max(--min-requests, ceil(R x S)) "
        "requests (sessions with --sessions; a trace: its first rows, at most all of them). 0: every probe sends "
        "-n requests, a window that shrinks as the rate grows.")),
    SharedOption("min_requests", int, typer.Option(
        100, "--min-requests", envvar="SPLITSERVE_MIN_REQUESTS", show_envvar=True, help="Rate sweep / capacity "
        "search: the fewest requests a probe sends, however low its rate.")),
)

OUTPUT_OPTIONS = (
    SharedOption("out_dir", Optional[Path], typer.Option(
        None, "--out-dir", help="Write JSON, CSV and PNG plots here.")),
    SharedOption("per_request", bool, typer.Option(
        False, "--per-request", help="Include per-request records in the JSON.")),
)

SHARED_OPTIONS = WORKLOAD_OPTIONS + ARRIVAL_OPTIONS + SLO_OPTIONS + RATE_OPTIONS + OUTPUT_OPTIONS


def with_shared_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` as a typer command that also takes every option of :data:`SHARED_OPTIONS`.

    `command` declares a parameter ``opts: BenchOptions``; the shared options take its place
    (in that order in ``--help``) and `command` is called with their values as ``opts``, a
    BenchOptions whose other fields keep their defaults. Its own parameters stay as declared.
    """
    own = inspect.signature(command, eval_str=True).parameters
    if "opts" not in own:
        raise TypeError(f"{command.__name__} has no `opts` parameter for the shared options")
    clashes = sorted(own.keys() & {o.field for o in SHARED_OPTIONS})
    if clashes:
        raise TypeError(f"{command.__name__}: parameters {clashes} are shared options already")
    # Keyword-only throughout: typer passes every parameter by name, and the shared ones
    # (all with defaults) may then stand before own parameters without one.
    params: list[inspect.Parameter] = []
    for param in own.values():
        if param.name == "opts":
            params.extend(inspect.Parameter(o.field, inspect.Parameter.KEYWORD_ONLY, default=o.option,
                                            annotation=o.annotation) for o in SHARED_OPTIONS)
        else:
            params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))

    def run(**values: Any) -> None:
        shared = {}
        for o in SHARED_OPTIONS:
            value = values.pop(o.field)
            shared[o.field] = o.parse(value) if o.parse else value
        command(opts=BenchOptions(**shared), **values)

    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    # typer reads type hints from __annotations__: the resolved types, not the strings of `command`'s module.
    run.__annotations__ = {p.name: p.annotation for p in params}
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(run, attr, getattr(command, attr))
    return run


def build_slo(opts: BenchOptions) -> Slo:
    """The SLO the options ask for, in seconds; bad values name their flag."""
    for flag, value in (("--slo-ttft-ms", opts.slo_ttft_ms), ("--slo-itl-ms", opts.slo_itl_ms),
                        ("--slo-incremental-ttft-ms", opts.slo_incremental_ttft_ms),
                        ("--slo-max-gap-ms", opts.slo_max_gap_ms)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag}: must be > 0, got {value}")
    incremental = None if opts.slo_incremental_ttft_ms is None else opts.slo_incremental_ttft_ms / 1000
    max_gap = None if opts.slo_max_gap_ms is None else opts.slo_max_gap_ms / 1000
    return Slo(opts.slo_ttft_ms / 1000, opts.slo_itl_ms / 1000, incremental, max_gap)


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
    if not (opts.probe_window_s >= 0 and math.isfinite(opts.probe_window_s)):
        raise ValueError(f"--probe-window: must be a finite number of seconds >= 0, got {opts.probe_window_s:g}")
    if opts.min_requests < 1:
        raise ValueError(f"--min-requests: must be >= 1, got {opts.min_requests}")
    if (opts.sweep_rates or opts.find_capacity) and opts.probe_window_s > 0:
        # Each probe's count follows its rate; a fixed count asked for too is a contradiction, not a hint.
        for flag, given in (("-n/--num-requests", opts.num_requests), ("--num-sessions", opts.num_sessions)):
            if given is not None:
                raise ValueError(
                    f"{flag} {given}: a rate sweep or capacity search sends max(--min-requests, ceil(rate x "
                    f"--probe-window)) per probe (now max({opts.min_requests}, ceil(rate x "
                    f"{opts.probe_window_s:g} s))); for exactly {given} per probe give --probe-window 0, for at "
                    f"least {given} give --min-requests {given} instead of {flag}")


def write_run(out_dir: Path, stem: str, results: list[RequestResult], record: dict[str, Any], slo: Slo,
              plots: bool) -> list[Path]:
    """One run's `{stem}.json` and `{stem}.csv` (and with `plots` its latency CDF and timeline); the paths."""
    from loadgen.plots import plot_latency_cdfs, plot_timeline  # matplotlib: only when writing

    paths = [write_json(out_dir / f"{stem}.json", record), write_csv(out_dir / f"{stem}.csv", results, slo)]
    if plots:
        paths.append(plot_latency_cdfs(results, slo, out_dir / f"{stem}_latency_cdf.png"))
        paths.append(plot_timeline(results, slo, out_dir / f"{stem}_timeline.png"))
    return paths


def print_written(paths: list[Path]) -> None:
    for path in paths:
        console.print(f"wrote {path}")


def report_run(opts: BenchOptions, config: dict[str, Any], slo: Slo, stem: str, results: list[RequestResult],
               title: str, notes: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    """One run (not a sweep): its summary and `notes` on the console, its JSON record (with `extra`
    fields) returned and, with --out-dir, written with its CSV and plots."""
    summary = summarize(results, slo)
    console.print(summary_table(summary, title))
    for note in notes:
        console.print(note)
    record = run_record(summary, config, results if opts.per_request else None, **extra)
    if opts.out_dir:
        print_written(write_run(opts.out_dir, stem, results, record, slo, plots=True))
    return record


# One run at (rate, its arrival process, how many requests -- or sessions -- to send): its results, extra fields
# for its JSON record, a note for its console line.
RateRun = Callable[[float, ArrivalProcess, int], "tuple[list[RequestResult], dict[str, Any], str]"]


def probe_size(opts: BenchOptions, rate: float, default_count: int, max_count: int | None) -> tuple[int, bool]:
    """Requests (sessions) a probe at `rate` sends, and whether the trace's length cut them short.

    --probe-window 0: `default_count` (what -n asks for) at every rate; else
    :func:`~loadgen.probes.probe_count`. At most `max_count` (a trace's rows; None: no limit).
    """
    wanted = default_count if opts.probe_window_s == 0 else probe_count(rate, opts.probe_window_s, opts.min_requests)
    if max_count is not None and wanted > max_count:
        return max_count, True
    return wanted, False


def run_rates(opts: BenchOptions, config: dict[str, Any], slo: Slo, arrival: ArrivalProcess | None,
              run_at: RateRun, workload: Workload) -> dict[str, Any]:
    """A rate sweep or a capacity search (DynaServe's serving capacity) over `run_at`; returns the JSON record.

    Each probe sends :func:`probe_size` requests (sessions) and records how many
    (``probe``) and whether it reached a steady state (``steady_state``,
    :func:`loadgen.probes.steady_state`); a probe meeting the target attainment without
    one is warned about. `splitserve bench` runs for real and `splitserve simulate` in
    virtual time; both write the same points, files and plots through here.
    """
    points: list[dict[str, Any]] = []
    written: list[Path] = []
    unsteady_passes: list[float] = []

    def measure(rate: float) -> float:
        count, cut_short = probe_size(opts, rate, workload.count, workload.max_count)
        process = probe_arrival(arrival, rate, count, workload)
        results, extra, note = run_at(rate, process, count)
        summary = summarize(results, slo)
        steady = steady_state(results, slo)
        probe = {"count": count, "window_s": opts.probe_window_s or None, "min_requests": opts.min_requests,
                 "cut_short_by_trace": cut_short}
        points.append({"rate": rate, "attainment": summary.slo_attainment,
                       "goodput_tokens_per_s": summary.goodput_tokens_per_s, "probe": probe,
                       "steady_state": steady.to_dict(), "summary": summary.to_dict(), **extra})
        console.print(f"rate {rate:g}/s: attainment {summary.slo_attainment:.1%}, "
                      f"goodput {summary.goodput_tokens_per_s:,.1f} tok/s, {summary.n_failed} failed, "
                      f"{count} sent{note}")
        if cut_short:
            console.print(f"[yellow]warning: rate {rate:g}/s: the trace holds only {workload.max_count} requests, fewer than "
                          f"--probe-window {opts.probe_window_s:g} s asks for[/]")
        if not steady.steady and summary.slo_attainment >= opts.target_attainment:
            unsteady_passes.append(rate)
            console.print(f"[yellow]warning: rate {rate:g}/s meets {opts.target_attainment:.0%} attainment but did "
                          f"not reach a steady state ({steady.describe()}): a longer --probe-window may fail it[/]")
        if opts.out_dir:
            run_config = {**config, "arrival": describe_arrival(process), "rate": rate, "probe": probe}
            record = run_record(summary, run_config, results if opts.per_request else None,
                                steady_state=steady.to_dict(), **extra)
            written.extend(write_run(opts.out_dir, f"rate-{rate:g}", results, record, slo, plots=False))
        return summary.slo_attainment

    extra: dict[str, Any] = {}
    if opts.find_capacity:
        capacity = find_capacity(measure, opts.target_attainment, opts.rate_lo, opts.rate_hi, opts.rate_tol,
                                 opts.max_probes, max_rate=opts.rate_max)
        extra["capacity"] = capacity.to_dict()
        # The capacity is only as good as the probe that passed there.
        extra["capacity"]["steady_state"] = capacity.rate not in unsteady_passes if capacity.rate > 0 else None
        if capacity.rate in unsteady_passes:
            console.print(f"[yellow]warning: the capacity probe ({capacity.rate:g} req/s) did not reach a steady "
                          "state: treat the capacity as an upper bound[/]")
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


def run_command(run: Callable[[], dict[str, Any]]) -> None:
    """Run a command's work (`run` returns its JSON record) and exit as scripts expect.

    A bad option value or an unreadable file exits 2 with the error; a run where every
    request failed exits 1, so a script notices it although a report was written.
    """
    try:
        record = run()
    except (ValueError, OSError) as err:
        console.print(f"[red]error:[/] {escape(str(err))}")  # error texts hold brackets: [::1], [/v1]
        raise typer.Exit(2) from None
    summaries = [record["summary"]] if "summary" in record else [p["summary"] for p in record.get("points", [])]
    if summaries and all(s["n_ok"] == 0 for s in summaries):
        raise typer.Exit(1)
