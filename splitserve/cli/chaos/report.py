"""What a chaos run did and what the clients saw: the report, as rich tables and JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.cli.chaos.faults import FaultRecord


@dataclass
class ChaosReport:
    """What a chaos run did and what the clients saw."""

    options: dict[str, Any]
    started_unix: float
    wall_s: float
    cases: int
    requests: int
    completed: int
    completed_first_try: int
    retried: int  # requests that needed more than one attempt (completed or not)
    completed_after_retry: int
    failed: int
    mismatches: int
    broken_streams: int  # attempts that failed after tokens had reached the client
    attempt_errors: dict[str, int]
    faults: list[FaultRecord]
    restarts_before: dict[str, int] | None  # None: not readable
    restarts_after: dict[str, int] | None
    failures: list[dict[str, Any]]  # failed or mismatched requests, with their attempts
    redis_started_by_chaos: list[int]  # redis-server pids this run started (they outlive it)
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out




# ---- output -----------------------------------------------------------------------------------


def render_report(report: ChaosReport):
    """The report as rich tables (requests, then faults)."""
    from rich.console import Group
    from rich.table import Table

    requests = Table(title=f"chaos: {report.requests} requests over {len(report.faults)} faults "
                           f"({'OK' if report.ok else 'PROBLEMS'})")
    for column in ("requests", "completed", "1st try", "after retries", "retried", "failed", "mismatches",
                   "broken streams", "attempt errors"):
        requests.add_column(column, justify="right")
    requests.add_row(str(report.requests), str(report.completed), str(report.completed_first_try),
                     str(report.completed_after_retry), str(report.retried), str(report.failed),
                     str(report.mismatches), str(report.broken_streams),
                     ", ".join(f"{k} {v}" for k, v in report.attempt_errors.items()) or "-")
    faults = Table(title="faults")
    for column in ("kind", "planned s", "at s", "victim", "pid", "running on it", "in flight", "back after s",
                   "new pid", "error"):
        faults.add_column(column)
    for f in report.faults:
        faults.add_row(f.kind, f"{f.planned_at_s:.1f}", "-" if f.at_s is None else f"{f.at_s:.1f}", f.victim or "-",
                       str(f.pid or "-"), "-" if f.running_on_victim is None else str(f.running_on_victim),
                       str(f.requests_in_flight), "-" if f.recovered_after_s is None else f"{f.recovered_after_s:.1f}",
                       str(f.new_pid or "-"), f.error or "")
    parts: list[Any] = [requests, faults]
    if report.problems:
        problems = Table(title="problems")
        problems.add_column("problem")
        for problem in report.problems:
            problems.add_row(problem)
        parts.append(problems)
    return Group(*parts)


def write_json(report: ChaosReport, out: Path | None) -> None:
    text = json.dumps(report.to_json(), indent=2) + "\n"
    if out is None or str(out) == "-":
        print(text, end="")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
