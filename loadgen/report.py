"""Run reports: live progress, summary table, JSON/CSV records and the A/B comparison table.

Plots live in :mod:`loadgen.plots`. A run's JSON holds ``config`` (what was asked),
``machine`` (where it ran), ``summary`` (:meth:`loadgen.metrics.Summary.to_dict`),
optionally ``sweep`` / ``capacity``, and, with ``--per-request``, ``requests``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from loadgen.metrics import RequestResult, Slo, Summary, meets_slo
from loadgen.runner import RunProgress

__all__ = [
    "LiveProgress",
    "summary_table",
    "request_record",
    "machine_info",
    "run_record",
    "write_json",
    "write_csv",
    "read_summary",
    "COMPARED_METRICS",
    "compare",
]

CSV_FIELDS = ("request_id", "session_id", "round_index", "arrival_s", "first_token_s", "end_s", "ttft_s",
              "tpot_s", "tbt_p99_s", "max_gap_s", "e2e_s", "prompt_len", "output_len", "ok", "meets_slo", "error")


class LiveProgress:
    """A rich live line: done/total bar, in flight, errors, running output throughput."""

    def __init__(self, console: Console | None = None, title: str = "bench"):
        self.console = console or Console(stderr=True)
        self.title = title
        self.state: RunProgress | None = None
        self._live: Live | None = None

    def __call__(self, state: RunProgress) -> None:
        """The runner's progress callback; rendering happens on the live display's own refresh."""
        self.state = state

    def __rich__(self) -> Table | Text:
        s = self.state
        if s is None:
            return Text(f"{self.title}: starting")
        line = Text.assemble(
            (f"{self.title} ", "bold"),
            f"{s.done}/{s.total} | ",
            (f"{s.in_flight} in flight", "cyan"), " | ",
            (f"{s.errors} err", "red" if s.errors else "green"), " | ",
            f"{s.output_throughput:,.0f} tok/s | {s.elapsed_s:,.1f} s",
        )
        grid = Table.grid(padding=(0, 1))
        grid.add_row(ProgressBar(total=max(1, s.total), completed=s.done, width=20), line)
        return grid

    def __enter__(self) -> LiveProgress:
        # Only animate on a terminal; logs and CI get the summary alone.
        if self.console.is_terminal:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value * 1000:,.1f}"


def summary_table(summary: Summary, title: str = "benchmark summary") -> Group:
    """The run's latency percentiles (ms), headline numbers and most frequent errors, for rich."""
    latency = Table(title=title, header_style="bold")
    latency.add_column("latency ms")
    for col in ("mean", "p50", "p90", "p99", "max"):
        latency.add_column(col, justify="right")
    for name, dist in (("TTFT", summary.ttft), ("TTFT initial", summary.ttft_initial),
                       ("TTFT incremental", summary.ttft_incremental), ("ITL", summary.itl),
                       ("TPOT", summary.tpot), ("TBT p99", summary.tbt_p99), ("E2E", summary.e2e)):
        if dist.count:
            latency.add_row(name, *(_ms(getattr(dist, c)) for c in ("mean", "p50", "p90", "p99", "max")))

    totals = Table(header_style="bold")
    totals.add_column("run")
    totals.add_column("value", justify="right")
    attainment = summary.slo_attainment
    for name, value in (
        ("requests ok / total", f"{summary.n_ok} / {summary.n_requests}"),
        ("span s", f"{summary.span_s:,.2f}"),
        ("requests /s", f"{summary.request_throughput:,.2f}"),
        ("input tokens /s", f"{summary.input_token_throughput:,.1f}"),
        ("output tokens /s", f"{summary.output_token_throughput:,.1f}"),
        ("goodput tokens /s", f"{summary.goodput_tokens_per_s:,.1f}"),
        ("SLO TTFT / TBT p99 ms", f"{_ms(summary.slo.ttft_s)} / {_ms(summary.slo.itl_s)}"),
        *((("SLO max gap ms", _ms(summary.slo.max_gap_s)),) if summary.slo.max_gap_s is not None else ()),
        ("SLO attainment", f"{attainment:.1%}" if math.isfinite(attainment) else "-"),
    ):
        totals.add_row(name, value)
    parts: list[Any] = [latency, totals]
    for error, count in sorted(summary.errors.items(), key=lambda kv: -kv[1])[:5]:
        parts.append(Text(f"error x{count}: {error}", style="red"))
    return Group(*parts)


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def request_record(result: RequestResult, slo: Slo, token_times: bool = True) -> dict[str, Any]:
    """One request's observations and derived latencies, JSON-able."""
    record: dict[str, Any] = {
        "request_id": result.request_id, "session_id": result.session_id, "round_index": result.round_index,
        "arrival_s": result.arrival_s, "first_token_s": result.first_token_s, "end_s": result.end_s,
        "ttft_s": result.ttft_s, "tpot_s": result.tpot_s, "tbt_p99_s": _finite(result.tbt_p99_s),
        "max_gap_s": _finite(result.max_gap_s),
        "e2e_s": result.e2e_s, "prompt_len": result.prompt_len, "output_len": result.output_len,
        "ok": result.ok, "meets_slo": meets_slo(result, slo), "error": result.error,
    }
    if token_times:
        record["token_times_s"] = list(result.token_times_s)
    return record


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict[str, Any]:
    """Where the load generator ran: host, OS, CPU, memory, Python, package versions, commit."""
    versions = {}
    for package in ("numpy", "httpx", "grpcio", "rich", "typer"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "hostname": socket.gethostname(), "platform": platform.platform(), "python": sys.version.split()[0],
        "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(), "memory_bytes": _memory_bytes(),
        "packages": versions, "git_commit": _git_commit(),
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def run_record(summary: Summary, config: dict[str, Any], results: Sequence[RequestResult] | None = None,
               **extra: Any) -> dict[str, Any]:
    """The JSON document of a run; ``results`` adds per-request records, ``extra`` e.g. sweep/capacity."""
    record: dict[str, Any] = {"config": config, "machine": machine_info(), "summary": summary.to_dict(), **extra}
    if results is not None:
        record["requests"] = [request_record(r, summary.slo) for r in results]
    return record


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def _strict(value: Any) -> Any:
    # JSON has no NaN/inf; undefined numbers become null, as Summary.to_dict does.
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` as indented strict JSON (NaN/inf become null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_strict(record), indent=2, default=_json_default, allow_nan=False) + "\n")
    return path


def write_csv(path: str | Path, results: Iterable[RequestResult], slo: Slo) -> Path:
    """One CSV row per request (no per-token times; those are in the JSON with --per-request)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for result in results:
            record = request_record(result, slo, token_times=False)
            writer.writerow({k: "" if record[k] is None else record[k] for k in CSV_FIELDS})
    return path


def read_summary(path: str | Path) -> dict[str, Any]:
    """The ``summary`` of a run JSON written by :func:`write_json`."""
    record = json.loads(Path(path).read_text())
    if "summary" not in record:
        raise ValueError(f"{path}: no 'summary' (not a loadgen run JSON)")
    return record["summary"]


# (label, path into the summary dict, higher is better)
COMPARED_METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("request throughput /s", ("request_throughput",), True),
    ("output tokens /s", ("output_token_throughput",), True),
    ("goodput tokens /s", ("goodput_tokens_per_s",), True),
    ("SLO attainment", ("slo_attainment",), True),
    ("TTFT p50 s", ("ttft", "p50"), False),
    ("TTFT p99 s", ("ttft", "p99"), False),
    ("TTFT incremental p99 s", ("ttft_incremental", "p99"), False),
    ("ITL p50 s", ("itl", "p50"), False),
    ("ITL p99 s", ("itl", "p99"), False),
    ("TPOT p50 s", ("tpot", "p50"), False),
    ("TPOT p99 s", ("tpot", "p99"), False),
    ("E2E p50 s", ("e2e", "p50"), False),
    ("E2E p99 s", ("e2e", "p99"), False),
    ("failed requests", ("n_failed",), False),
)


def _lookup(summary: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def compare(a_json: str | Path, b_json: str | Path) -> tuple[Table, list[dict[str, Any]]]:
    """Table (and rows) of each headline metric in A and B and the ratio B/A."""
    a, b = read_summary(a_json), read_summary(b_json)
    table = Table(title=f"B/A  (A = {_short(a_json)}, B = {_short(b_json)})", header_style="bold")
    for col, justify in (("metric", "left"), ("A", "right"), ("B", "right"), ("B/A", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    rows = []
    for label, keys, higher_is_better in COMPARED_METRICS:
        va, vb = _lookup(a, keys), _lookup(b, keys)
        if va is None and vb is None:
            continue
        ratio = vb / va if va not in (None, 0) and vb is not None else None
        rows.append({"metric": label, "a": va, "b": vb, "ratio": ratio})
        style = ""
        if ratio is not None and ratio != 1:
            style = "green" if (ratio > 1) == higher_is_better else "red"
        table.add_row(label, _fmt(va), _fmt(vb), Text("-" if ratio is None else f"{ratio:.3f}x", style=style))
    return table, rows


def _short(path: str | Path) -> str:
    path = Path(path)
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.4g}"
