"""A benchmark's options and what they resolve to: the workload items and the arrival process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from loadgen import arrivals
from loadgen.arrivals import ArrivalProcess
from loadgen.plan import plan_sessions, requests_from_shapes, requests_from_trace
from loadgen.runner import WorkItem
from loadgen.sessions import generate_sessions, parse_tool_delay, session_stats
from loadgen.traces import limit, read_trace, scale_lengths
from loadgen.workloads import parse_shapes

__all__ = ["BenchOptions", "Workload", "build_workload", "resolve_arrival", "arrival_at_rate", "probe_arrival",
           "describe_arrival", "DEFAULT_SHAPE", "DEFAULT_NUM_REQUESTS", "DEFAULT_NUM_SESSIONS"]

DEFAULT_SHAPE = "P256/D64"
DEFAULT_NUM_REQUESTS = 100  # -n when not given: requests of one run (trace: its first rows)
DEFAULT_NUM_SESSIONS = 10  # --num-sessions when not given
DEFAULT_VOCAB_SIZE = 256  # byte-level demo tokenizers decode ids 0..255


@dataclass
class BenchOptions:
    """Everything the ``bench`` command was asked for (see ``loadgen.cli`` for each option's meaning)."""

    target: str = "127.0.0.1:50051"
    api_key: str | None = None
    # TLS to the target: on for an https:// URL, for gRPC with `tls` or any file below.
    tls: bool = False
    tls_ca_file: str = ""  # the CA that signed the server's certificate (empty: the system roots)
    tls_cert_file: str = ""  # a client certificate, for a gateway run with --tls-client-ca-file
    tls_key_file: str = ""
    tls_server_name: str = ""  # the name the server's certificate is checked against (gRPC)
    model: str | None = None
    api: str = "completions"  # http(s) targets: "completions" or "chat" (the chat template applied by the server)
    trace: Path | None = None
    length_scale: float = 1.0
    num_requests: int | None = None  # None: DEFAULT_NUM_REQUESTS (one run) or --probe-window sizing (rate modes)
    trace_time_scale: float = 1.0
    shapes: list[str] = field(default_factory=list)
    sessions: str | None = None
    num_sessions: int | None = None  # None: DEFAULT_NUM_SESSIONS (one run) or --probe-window sizing (rate modes)
    tool_delay: str = "exponential:mean=1"
    arrival: str | None = None
    concurrency: int | None = None
    max_concurrency: int | None = None
    duration_limit_s: float | None = None
    slo_ttft_ms: float = 1000.0
    slo_itl_ms: float = 100.0
    slo_incremental_ttft_ms: float | None = None
    slo_max_gap_ms: float | None = None
    send_slo: bool = True
    find_capacity: bool = False
    target_attainment: float = 0.9
    rate_lo: float = 0.5
    rate_hi: float = 8.0
    rate_max: float | None = None
    rate_tol: float = 0.25
    max_probes: int = 8
    sweep_rates: list[float] = field(default_factory=list)
    probe_window_s: float = 60.0  # rate modes: seconds of arrivals per probe; 0: a fixed count per probe
    min_requests: int = 100  # rate modes: fewest requests (sessions) per probe
    out_dir: Path | None = None
    per_request: bool = False
    seed: int = 0
    vocab_size: int | None = None
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (the API key is never written out)."""
        data = dataclasses.asdict(self)
        data["api_key"] = "***" if self.api_key else None
        return {k: str(v) if isinstance(v, Path) else v for k, v in data.items()}


@dataclass
class Workload:
    """The items to send, built afresh per run, and what they are.

    ``make_items(run_tag, vocab_size, count=None)`` builds ``count`` items (requests, or
    sessions for a sessions workload; None: ``count`` of the workload, what one run sends).
    A trace holds only so many rows: ``max_count`` (None: no limit), and ``count`` above it
    makes them all. ``trace_timestamps`` are every row's arrival; a run replays its first items'.
    """

    make_items: Callable[..., list[WorkItem]]
    kind: str
    description: dict[str, Any]
    trace_timestamps: list[float] | None = None
    count: int = DEFAULT_NUM_REQUESTS
    max_count: int | None = None


def build_workload(opts: BenchOptions) -> Workload:
    """Turn the workload options (sessions, trace or shapes) into a :class:`Workload`."""
    chosen = [name for name, given in (("--sessions", opts.sessions), ("--trace", opts.trace),
                                       ("--shape", opts.shapes)) if given]
    if len(chosen) > 1:
        raise ValueError(f"workload: choose one of {', '.join(chosen)}")
    for flag, value in (("--num-requests", opts.num_requests), ("--num-sessions", opts.num_sessions)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: must be >= 1, got {value}")
    num_requests = opts.num_requests or DEFAULT_NUM_REQUESTS
    seed = opts.seed

    if opts.sessions:
        tool_delay = parse_tool_delay(opts.tool_delay)
        num_sessions = opts.num_sessions or DEFAULT_NUM_SESSIONS
        sessions = generate_sessions(opts.sessions, num_sessions, np.random.default_rng([seed, 0]),
                                     length_scale=opts.length_scale, tool_delay=tool_delay)
        description = {"sessions": opts.sessions, "num_sessions": num_sessions, "tool_delay": opts.tool_delay,
                       "length_scale": opts.length_scale, "stats": session_stats(sessions).to_dict(),
                       "num_requests": sum(len(s.rounds) for s in sessions)}

        def make_sessions(run_tag: str, vocab_size: int, count: int | None = None) -> list[WorkItem]:
            chosen = sessions if count in (None, num_sessions) else generate_sessions(
                opts.sessions, count, np.random.default_rng([seed, 0]), length_scale=opts.length_scale,
                tool_delay=tool_delay)
            return list(plan_sessions(chosen, np.random.default_rng([seed, 1]), vocab_size, run_tag))

        return Workload(make_sessions, "sessions", description, count=num_sessions)

    if opts.trace:
        all_rows = scale_lengths(read_trace(opts.trace), opts.length_scale)
        rows = limit(all_rows, n=num_requests)
        if not rows:
            raise ValueError(f"trace: {opts.trace} holds no requests")
        description = {"trace": str(opts.trace), "length_scale": opts.length_scale, "num_requests": len(rows),
                       "mean_prompt_len": float(np.mean([r.prompt_len for r in rows])),
                       "mean_output_len": float(np.mean([r.output_len for r in rows]))}

        def make_trace(run_tag: str, vocab_size: int, count: int | None = None) -> list[WorkItem]:
            chosen = rows if count is None else limit(all_rows, n=count)
            return list(requests_from_trace(chosen, np.random.default_rng([seed, 1]), vocab_size, seed))

        return Workload(make_trace, "trace", description, [r.arrival_s for r in all_rows], count=len(rows),
                        max_count=len(all_rows))

    shapes = [s.scaled(opts.length_scale) if opts.length_scale != 1.0 else s
              for spec in (opts.shapes or [DEFAULT_SHAPE]) for s in parse_shapes(spec)]
    description = {"shapes": [str(s) for s in shapes], "length_scale": opts.length_scale,
                   "num_requests": num_requests}

    def make_shapes(run_tag: str, vocab_size: int, count: int | None = None) -> list[WorkItem]:
        n = num_requests if count is None else count
        return list(requests_from_shapes(shapes, n, np.random.default_rng([seed, 1]), vocab_size))

    return Workload(make_shapes, "shapes", description, count=num_requests)


def resolve_arrival(opts: BenchOptions, workload: Workload) -> ArrivalProcess | None:
    """The arrival process asked for: ``trace`` replays the trace, default is the trace or Poisson 1/s."""
    if opts.concurrency:
        return None  # closed loop: workers, not arrivals, decide when to send
    spec = opts.arrival or ("trace" if workload.trace_timestamps is not None else "poisson:rate=1")
    if spec.strip().lower() == "trace":
        if workload.trace_timestamps is None:
            raise ValueError("arrival: 'trace' replays --trace timestamps; give --trace PATH")
        return arrivals.trace(workload.trace_timestamps[:workload.count], opts.trace_time_scale)
    return arrivals.parse_arrival(spec)


def arrival_at_rate(process: ArrivalProcess | None, rate: float) -> ArrivalProcess:
    """The same kind of process at ``rate`` per second (a trace is sped up or slowed to that mean rate)."""
    if isinstance(process, arrivals.GammaArrivals):
        return arrivals.GammaArrivals(rate, process.burstiness)
    if isinstance(process, arrivals.ConstantArrivals):
        return arrivals.ConstantArrivals(rate)
    if isinstance(process, arrivals.TraceArrivals):
        ts = np.asarray(process.timestamps, dtype=np.float64)
        span = float(ts[-1] - ts[0]) if ts.size > 1 else 0.0
        if span <= 0:
            raise ValueError("arrival: the trace has no time span to rescale to a rate")
        natural_rate = (ts.size - 1) / span
        return arrivals.TraceArrivals(process.timestamps, rate / natural_rate)
    return arrivals.PoissonArrivals(rate)


def probe_arrival(process: ArrivalProcess | None, rate: float, count: int, workload: Workload) -> ArrivalProcess:
    """A rate probe's process: ``process`` at ``rate`` for ``count`` arrivals. A trace replay takes
    the first ``count`` of the workload's timestamps (more than one run's) and is rescaled so that
    they arrive at ``rate`` on average."""
    if isinstance(process, arrivals.TraceArrivals) and workload.trace_timestamps is not None:
        process = arrivals.TraceArrivals(tuple(workload.trace_timestamps[:count]), process.time_scale)
    return arrival_at_rate(process, rate)


def describe_arrival(process: ArrivalProcess | None, concurrency: int | None = None) -> str:
    """A short label for reports (a trace process is not spelled out timestamp by timestamp)."""
    if process is None:
        return f"closed loop, concurrency {concurrency}" if concurrency else "all at once"
    if isinstance(process, arrivals.TraceArrivals):
        return f"trace replay of {len(process.timestamps)} arrivals, time_scale={process.time_scale:g}"
    return repr(process)
