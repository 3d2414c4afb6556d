"""The pure parts of benchmarks/ampd_eval.py: deployments searched, rates, gains, one case."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ampd_eval.py"
_spec = importlib.util.spec_from_file_location("ampd_eval", _PATH)
ae = importlib.util.module_from_spec(_spec)
sys.modules["ampd_eval"] = ae
_spec.loader.exec_module(ae)


def test_deployments_fill_the_budget_and_keep_both_pools():
    disaggregated = ae.deployments(8, True)
    assert {d.label for d in disaggregated} == {"P:TP2x1 D:TP2x3", "P:TP2x2 D:TP2x2", "P:TP2x3 D:TP2x1",
                                                "P:TP4x1 D:TP4x1"}  # TP8 leaves no room for two pools
    assert all(d.tp * d.workers == 8 and 1 <= d.prefill < d.workers for d in disaggregated)
    assert [d.label for d in ae.deployments(8, False)] == ["TP2x4", "TP4x2", "TP8x1"]
    assert ae.deployments(16, True)[0].roles() == ("prefill", "prefill", "decode", "decode", "decode", "decode",
                                                    "decode", "decode")


def test_rates_scale_with_the_budget_and_the_session_size():
    toolbench, hotpotqa, dureader, gaia = (ae.prefill_capacity(w) for w in ae.WORKLOADS)
    assert toolbench > hotpotqa > gaia > 0
    assert dureader == pytest.approx(2 * ae.prefill_capacity(ae.Workload("dureader", 8, 1200, 40)))


def test_gains_compare_ampd_with_a_baseline_rate_by_rate():
    rows = [{"system": "AMPD", "rate": 1.0, "attainment": 0.9}, {"system": "B", "rate": 1.0, "attainment": 0.6},
            {"system": "AMPD", "rate": 2.0, "attainment": 0.5}, {"system": "B", "rate": 2.0, "attainment": 0.0}]
    assert ae.gains(rows, "B") == pytest.approx([0.5])  # a baseline at 0% gives no finite ratio


def test_one_case_runs_and_reports_the_breakdown():
    workload = ae.Workload("toolbench", 8, 350, 40)
    row = ae.run_case((workload, ae.systems("fcfs")[0], ae.Deployment(4, 2, 1), 0.5, 8.0, 0))
    assert row["requests"] >= 8 and row["failed"] == 0
    assert 0 <= row["attainment_strict"] <= row["attainment"] <= 1
    assert row["ttft_initial_mean_ms"] > 0 and row["ttft_incremental_mean_ms"] > 0
    # AMPD's adaptive routing prefills some rounds where their history is and pulls it for the others.
    assert 0 < row["local_share"] < 1 and row["kv_pulled_tokens"] > 0


def test_rates_are_sized_on_the_backend_that_times_the_runs():
    """The session rates (a share of prefill capacity) come from the same step-time backend as
    the simulations (on the H200, the measured kernels alone prefill ~10% faster than the
    datasheet roofline; with vLLM's framework cost on top, ~5% slower)."""
    from splitserve.perf.backends import perf_model_for

    workload = ae.WORKLOADS[0]
    measured = ae.Timing("H200", "Qwen3-32B", "aiconfigurator", ae.LINK)
    kernels = ae.Timing("H200", "Qwen3-32B", "aiconfigurator-kernels", ae.LINK)
    datasheet = ae.Timing("H200", "Qwen3-32B", "datasheet", ae.LINK)
    assert ae.prefill_capacity(workload, kernels) > 1.05 * ae.prefill_capacity(workload, datasheet)
    assert ae.prefill_capacity(workload, measured) < 0.97 * ae.prefill_capacity(workload, kernels)
    model = perf_model_for("H200", "Qwen3-32B", 4, backend="aiconfigurator", link=ae.LINK)
    assert measured.perf_model(4) is model  # the tables the simulator gets, not a re-derived model
    row = ae.run_case((workload, ae.systems("fcfs")[2], ae.Deployment(4, 2, 0), 2.0, 4.0, 0, measured))
    assert row["perf_backend"] == "aiconfigurator" and row["perf_label"] == model.label


def test_the_summary_averages_ampds_gain_over_each_baseline_per_rate():
    """`summarize_run` (written after every workload, so a stopped run keeps what it finished)."""
    def row(system, rate, attainment, strict):
        return {"system": system, "rate": rate, "attainment": attainment, "attainment_strict": strict,
                "timing_note": "note"}
    dynamo = "Dynamo-like (pd_disaggregated)"
    panels = [{"rows": [row("AMPD", 1.0, 0.9, 0.6), row(dynamo, 1.0, 0.6, 0.6),
                        row("AMPD", 2.0, 0.5, 0.3), row(dynamo, 2.0, 0.0, 0.2)]},
              {"rows": [row("AMPD", 1.0, 1.0, 0.5), row(dynamo, 1.0, 0.8, 1.0)]}]
    out = ae.summarize_run(panels, ae.Timing(), "fcfs", False, started=0.0)
    # (0.9/0.6 - 1) and (1.0/0.8 - 1); the rate where the baseline attains nothing is left out.
    assert out["average_gain"] == {dynamo: pytest.approx((0.5 + 0.25) / 2)}
    assert out["average_gain_strict"] == {dynamo: pytest.approx((0.0 + 0.5 - 0.5) / 3)}
    assert out["rows"] == 6 and out["timing_notes"] == ["note"] and "finished_at" not in out
