"""Prometheus metrics of the global scheduler (registered once per process)."""

from __future__ import annotations

from typing import Mapping

from prometheus_client import Counter, Gauge, Histogram

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

# DynaServe's decisions (Alg. 1, `services.global_scheduler.dynaserve`), from the numbers a
# policy attaches to its placement (`Placement.decision`): where requests are cut, how many
# probes the bounded binary search took, and the drain times it predicted for the pair.
DECISION_PHI = Histogram(
    "splitserve_scheduler_decision_phi",
    "phi chosen per request: the first stage's share of prompt + predicted output (0 or 1: not split).",
    ["policy"],
    buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.999, 1.0),
)
DECISION_PROBES = Histogram(
    "splitserve_scheduler_decision_probes",
    "Timeline probes one placement took (all candidate pairs together).",
    ["policy"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
)
DECISION_PREDICTED_SECONDS = Histogram(
    "splitserve_scheduler_decision_predicted_seconds",
    "Predicted time from the decision until the pair drains (t1: the first stage's worker, t2: the second's) "
    "and until the request's first token (ttft).",
    ["policy", "prediction"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
_PREDICTIONS = {"t1_s": "t1", "t2_s": "t2", "predicted_ttft_s": "ttft"}


def observe_decision(policy: str, decision: Mapping[str, float]) -> None:
    """Record what a placement's `decision` carries (policies without one record nothing)."""
    if "phi" in decision:
        DECISION_PHI.labels(policy).observe(decision["phi"])
    if "probes" in decision:
        DECISION_PROBES.labels(policy).observe(decision["probes"])
    for key, label in _PREDICTIONS.items():
        if key in decision:
            DECISION_PREDICTED_SECONDS.labels(policy, label).observe(max(0.0, decision[key]))


# Finish reasons come from callers; anything else is counted as "other" so a buggy or
# hostile caller cannot create unbounded label values.
KNOWN_FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "stage_end"})


def finish_reason_label(finish_reason: str) -> str:
    """The metric label for a reported finish reason."""
    if not finish_reason:
        return "unknown"
    return finish_reason if finish_reason in KNOWN_FINISH_REASONS else "other"

# LAPS' pool controller (Alg. 2), on the scheduler replica that holds its leader lock.
POOL_PRESSURE = Gauge(
    "splitserve_scheduler_pool_pressure", "Robust (P90) pressure of a LAPS prefill pool at the last control period",
    ["pool"],
)
POOL_SIZE = Gauge("splitserve_scheduler_pool_instances", "Prefill instances in a LAPS pool", ["pool"])
POOL_MOVES = Counter("splitserve_scheduler_pool_moves_total", "Prefill instances moved between LAPS pools",
                     ["to_pool"])
POOL_CONTROL_LEADER = Gauge("splitserve_scheduler_pool_controller_leader",
                            "1 while this scheduler holds the pool controller's leader lock")
LENGTH_BOUNDARY = Gauge("splitserve_scheduler_length_boundary_tokens",
                        "LAPS' L_m(H): new tokens from which a (re-)prefill on H cached tokens is long",
                        ["history"])
