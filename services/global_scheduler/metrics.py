"""Prometheus metrics of the global scheduler (registered once per process)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

PLACEMENTS = Counter(
    "splitserve_scheduler_placements_total",
    "Requests placed, by placement policy and worker of each stage.",
    ["policy", "worker_id"],
)
PLACE_SECONDS = Histogram(
    "splitserve_scheduler_place_seconds",
    "Time the policy took to place one request (the view is already in memory).",
    ["policy"],
    buckets=(0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
)
NO_WORKER = Counter(
    "splitserve_scheduler_no_worker_total",
    "Place calls answered UNAVAILABLE because no eligible worker existed.",
    ["policy"],
)
COMPLETIONS = Counter(
    "splitserve_scheduler_completions_total",
    "Completion reports received, by finish reason.",
    ["finish_reason"],
)
POLICY_SWITCHES = Counter(
    "splitserve_scheduler_policy_switches_total",
    "SetPolicy calls that installed a policy, by the policy installed.",
    ["policy"],
)

# Finish reasons come from callers; anything else is counted as "other" so a buggy or
# hostile caller cannot create unbounded label values.
KNOWN_FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "stage_end"})


def finish_reason_label(finish_reason: str) -> str:
    """The metric label for a reported finish reason."""
    if not finish_reason:
        return "unknown"
    return finish_reason if finish_reason in KNOWN_FINISH_REASONS else "other"
