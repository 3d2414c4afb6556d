"""The measured-timing and prefill-first parts of benchmarks/ampd_eval.py and plan_check.py
(issue 34): what timed a run is recorded, TP degrees that do not fit are not searched, the
prefill-first colocated baselines run, both attainments reach the table, the paper's gains."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ae = _load("ampd_eval")


def test_timing_searches_only_tp_degrees_that_fit():
    assert ae.Timing("H100", "Llama-3.1-70B").tps() == (4, 8)  # 140 GB of weights: not on 2 x 80 GB
    assert ae.Timing("H200", "Llama-3.1-70B").tps() == (2, 4, 8)
    assert ae.Timing("H200", "Qwen3-32B").tps() == (2, 4, 8)
    assert ae.WORKLOADS_BY_MODEL["Qwen3-32B"] == ae.WORKLOADS
    assert [(w.preset, w.ttft_ms, w.itl_ms) for w in ae.LLAMA_WORKLOADS][0] == ("toolbench", 1000, 50)


def test_rates_follow_the_timed_gpu():
    toolbench = ae.WORKLOADS[0]
    datasheet = ae.prefill_capacity(toolbench, ae.Timing("H20", "Qwen3-32B", "datasheet"))
    assert datasheet == pytest.approx(ae.prefill_capacity(toolbench, ae.Timing("H20", "Qwen3-32B", "datasheet")))
    assert ae.prefill_capacity(toolbench, ae.Timing("H200", "Qwen3-32B", "roofline")) > 3 * datasheet


def test_paper_gains_are_means_over_the_papers_rates():
    assert ae.paper_gain("Qwen3-32B", "toolbench", "Dynamo-like (pd_disaggregated)") == pytest.approx(
        (0 + 0 + 3.02 + 8.46 + 12.17) / 5 / 100)
    # DuReader's last vLLM-Continuum arrow is missing from the paper's text: the mean of the other four.
    assert ae.paper_gain("Qwen3-32B", "dureader", "vLLM-Continuum-like (session_affinity)") == pytest.approx(
        (543 + 738 + 1199 + 1033) / 4 / 100)
    assert ae.paper_gain("Qwen3-32B", "toolbench", "vLLM-like, prefill-first (least_loaded)") is None


def test_prefill_first_baselines_and_the_recorded_timing():
    names = [s.name for s in ae.systems("prefill_reorder", prefill_first=True)]
    assert names[:4] == [s.name for s in ae.systems("prefill_reorder")] and len(names) == 6
    first = ae.systems("prefill_reorder", prefill_first=True)[4]
    assert (first.policy, first.batch_policy, first.disaggregated) == ("least_loaded", "prefill_first", False)
    workload = ae.Workload("toolbench", 8, 350, 40)
    timing = ae.Timing("H200", "Qwen3-32B", "roofline")
    row = ae.run_case((workload, first, ae.Deployment(8, 1, 0), 1.0, 6.0, 0, timing))
    assert row["failed"] == 0 and 0 <= row["attainment_strict"] <= row["attainment"] <= 1
    assert row["perf_label"].startswith("roofline:H200") and row["timing_note"] and row["tbt_p99_median_ms"] > 0
    default = ae.run_case((workload, ae.systems("fcfs")[2], ae.Deployment(8, 1, 0), 1.0, 6.0, 0))
    assert "H20" in default["perf_label"]  # the six-field case: the paper's GPU, as before


def test_the_table_shows_both_attainments_and_the_papers_gain():
    rows = [dict(system=s, rate=r, attainment=a, attainment_strict=b, ttft_initial_mean_ms=1.0,
                 ttft_incremental_mean_ms=1.0, itl_mean_ms=1.0, tbt_p99_median_ms=2.0, local_share=None)
            for s, r, a, b in (("AMPD", 1.0, 0.9, 0.5), ("Dynamo-like (pd_disaggregated)", 1.0, 0.6, 0.25))]
    panel = {"workload": {"preset": "toolbench", "gpus": 8, "ttft_ms": 350, "itl_ms": 40}, "model": "Qwen3-32B",
             "gpu": "H200", "best": {}, "rows": rows, "capacity_sessions_s": 19.0}
    text = ae.markdown({"machine": "m", "command": "c", "panels": [panel], "average_gain": {},
                        "timing_notes": ["step times: x"]})
    assert "| AMPD | 90% / 50% |" in text and "step times: x" in text
    assert "+50% / +100% / +5%" in text  # mean-ITL gain / strict gain / the paper's


def test_plan_check_scores_and_ranks_like_the_planners_check():
    pc = _load("plan_check")
    rows = [{"ok": True, "ttft_s": 0.1, "tpot_s": 0.02, "tbt_p99_s": 0.05},
            {"ok": True, "ttft_s": 0.5, "tpot_s": 0.02, "tbt_p99_s": 0.02},
            {"ok": False, "ttft_s": None, "tpot_s": None, "tbt_p99_s": None}]
    s = pc.score(rows, 0.35, 0.04)
    assert s["attainment"] == pytest.approx(1 / 3) and s["attainment_strict"] == 0.0 and s["failed"] == 1
    assert s["z"] == pytest.approx(max(s["ttft_p95_ms"] / 350, s["itl_p95_ms"] / 40))
    ranked = pc.rank([{"label": "a", "attainment": 0.5, "z": 2.0, "planner_rank": 1},
                      {"label": "b", "attainment": 0.5, "z": 1.0, "planner_rank": 2},
                      {"label": "c", "attainment": 0.9, "z": 3.0, "planner_rank": 3}])
    assert ranked == ["c", "b", "a"]
