"""The pure pieces of benchmarks/dynaserve_eval.py: FLOPs, hint injection, the hybrid mix, sweep rates."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from loadgen.metrics import RequestResult
from services.planner.sim_run import SimRun
from services.planner.sim_workload import SimRequestSpec
from services.planner.simulator import Simulator
from splitserve.perf.presets import gpu_spec, model_spec

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "dynaserve_eval.py"
_spec = importlib.util.spec_from_file_location("dynaserve_eval", _PATH)
de = importlib.util.module_from_spec(_spec)
sys.modules["dynaserve_eval"] = de
_spec.loader.exec_module(de)


def test_request_flops_is_two_params_per_token_plus_logits_and_attention():
    m = model_spec("Qwen2.5-14B")
    # One prompt token, one output token: one processed token, one set of logits, one attention pair.
    assert de.request_flops(m, 1, 1) == 2 * m.linear_params + 2 * m.vocab_params + m.attn_flops_per_pair
    # P2048/D512 on Qwen2.5-14B: about 2 x 13.2e9 x 2559 linear FLOPs, a few % attention and logits.
    f = de.request_flops(m, 2048, 512)
    linear = 2 * m.linear_params * 2559
    assert linear < f < 1.2 * linear


def test_flops_fraction_of_peak():
    peak = gpu_spec("A100").bf16_tflops
    assert de.flops_fraction(1.0, 2 * peak * 1e12, 2, peak) == pytest.approx(1.0)
    assert de.flops_fraction(5.0, 1e13, 2, 312.0) == pytest.approx(5e13 / 624e12)


def _specs(n=1000, out=500):
    return [SimRequestSpec(f"r{i}", 100, out) for i in range(n)]


def test_hints_none_oracle_fixed():
    specs = _specs()
    assert all(s.predicted_output_len is None for s in de.with_hints(specs, "none"))
    assert all(s.predicted_output_len == 500 for s in de.with_hints(specs, "oracle"))
    assert all(s.predicted_output_len == 400 for s in de.with_hints(specs, "fixed", -0.2))
    assert all(s.predicted_output_len == 1 for s in de.with_hints(_specs(out=1), "fixed", -0.9))
    with pytest.raises(ValueError):
        de.with_hints(specs, "gaussian", 0.1)


def test_hints_uniform_stay_within_the_error_and_are_seeded():
    hinted = de.with_hints(_specs(), "uniform", 0.5, seed=3)
    values = [s.predicted_output_len for s in hinted]
    assert min(values) >= 250 and max(values) <= 750
    assert min(values) < 300 and max(values) > 700  # the whole range is used
    assert values == [s.predicted_output_len for s in de.with_hints(_specs(), "uniform", 0.5, seed=3)]
    assert all(s.output_len == 500 for s in hinted)  # the true length is unchanged


def test_hint_reaches_the_placement_request():
    sim = Simulator.from_preset(2, "A100", "Qwen2.5-14B", placement_policy="round_robin")
    specs = de.with_hints([SimRequestSpec("a", 32, 8), SimRequestSpec("b", 32, 8)], "fixed", -0.5)
    run = SimRun(sim.config, specs, [0.0, 0.01])
    seen = {}
    place = run.policy.place

    def recording(request, view, now):
        seen[request.request_id] = request.predicted_output_len
        return place(request, view, now)

    run.policy.place = recording
    assert all(r.ok for r in run.execute())
    assert seen == {"a": 4, "b": 4}


def test_hybrid_mix_alternates_half_and_half():
    a, b = [(1, 1)] * 5, [(2, 2)] * 3
    mixed = de.mix_rows(a, b)
    assert mixed == [(1, 1), (2, 2)] * 3


def test_rates_around_capacities():
    assert de.rates_around([2.0, 5.0], points=4, low=0.5, high=1.2) == [1.0, 2.67, 4.33, 6.0]
    assert de.rates_around([0.0]) == []


def test_ttft_growth_detects_a_growing_queue():
    def result(i, ttft):
        return RequestResult(f"r{i}", None, 0, float(i), float(i) + ttft, [float(i) + ttft], float(i) + ttft, 1, 1,
                             True)
    steady = [result(i, 1.0) for i in range(40)]
    growing = [result(i, 0.5 * i) for i in range(40)]
    assert de.ttft_growth_s(steady) == 0.0
    assert de.ttft_growth_s(growing) == pytest.approx(0.5 * 20)


def test_slo_aware_options_reach_only_the_systems_that_batch_with_slo_aware():
    extra = {"kv_pressure_below": "0.4"}
    for system in ("DynaServe", "least_loaded+slo_aware", "coloc+slo_aware", "DynaServe+prompt_cuts"):
        options = de.system_options(system, extra)
        assert options["batch_policy_options"] == {"itl_slo_ms": de.ITL_SLO_MS, **extra}
        assert de.system_options(system)["batch_policy_options"] == {"itl_slo_ms": de.ITL_SLO_MS}
    for system in ("coloc-256", "1P1D", "DynaServe+fcfs"):
        assert de.system_options(system, extra) == de.system_options(system)
        assert "batch_policy_options" not in de.system_options(system, extra)
    with pytest.raises(ValueError):
        de.system_options("no-such-system")


def test_verify_offers_the_capacity_over_a_longer_window_and_says_whether_it_holds():
    args = argparse.Namespace(perf_backend="datasheet", window_s=4.0, min_requests=4, seed=0, ttft_growth_s=2.0,
                              verify_multiple=3.0)
    bench = de.Bench(args, de.SETUPS["14B"])
    workload = de.Workload("P256/D4", rows=[(256, 4)])
    check = bench.verify("coloc-256", workload, 2.0)
    assert check["window_multiple"] == 3.0 and check["rate"] == 2.0
    assert check["requests"] == 24  # 2 req/s over 3 x 4 s
    assert check["steady"] and check["attainment"] == 1.0 and check["holds"]  # light load on two A100s
    # Far past what two A100s prefill (8k-token prompts): the queue grows, the capacity does not hold.
    heavy = bench.verify("coloc-256", de.Workload("P8192/D4", rows=[(8192, 4)]), 60.0)
    assert not heavy["holds"] and (not heavy["steady"] or heavy["attainment"] < de.TARGET_ATTAINMENT)


def test_step_down_lowers_a_capacity_until_it_holds_within_its_budget():
    def check(rate):
        return {"rate": rate, "holds": rate <= 2.05}

    assert [c["rate"] for c in de.step_down(2.0, 0.5, 4, check)] == [2.0]  # holds at once
    assert [c["rate"] for c in de.step_down(3.0, 0.5, 4, check)] == [3.0, 2.5, 2.0]
    assert [c["rate"] for c in de.step_down(5.0, 0.5, 2, check)] == [5.0, 4.5, 4.0]  # budget spent: last fails
    assert not de.step_down(5.0, 0.5, 2, check)[-1]["holds"]
    assert [c["rate"] for c in de.step_down(0.8, 0.5, 4, lambda r: {"rate": r, "holds": False})] == pytest.approx([0.8, 0.3])


def test_capacity_reports_the_verified_rate_beside_the_searchs():
    args = argparse.Namespace(perf_backend="datasheet", window_s=4.0, min_requests=4, seed=0, ttft_growth_s=2.0,
                              rate_tol=0.1, max_probes=3, verify_multiple=2.0, verify_steps=1)
    cap = de.Bench(args, de.SETUPS["14B"]).capacity("coloc-256", de.Workload("P256/D4", rows=[(256, 4)]))
    assert cap["search_capacity_rps"] > 0 and cap["verify_steps"][0]["rate"] == cap["search_capacity_rps"]
    assert cap["capacity_rps"] == cap["verify"]["rate"] == cap["verify_steps"][-1]["rate"]
    assert cap["verified"] == cap["verify"]["holds"] and len(cap["verify_steps"]) <= 2
    args.verify_multiple = 0.0  # off: the search's figure, as before
    plain = de.Bench(args, de.SETUPS["14B"]).capacity("coloc-256", de.Workload("P256/D4", rows=[(256, 4)]))
    assert "verify" not in plain and plain["capacity_rps"] == cap["search_capacity_rps"]
