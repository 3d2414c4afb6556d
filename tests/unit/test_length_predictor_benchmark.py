"""benchmarks/length_predictor_accuracy.py: online replay (no peeking), --trace, JSON and PNG output."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from loadgen.traces import TraceRequest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "length_predictor_accuracy.py"
spec = importlib.util.spec_from_file_location("length_predictor_accuracy", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_each_request_is_predicted_before_it_is_learned():
    rows = [TraceRequest(float(i), 300, out) for i, out in enumerate((7, 500, 9))]
    variant = bench.Variant("v", {"prior": 50, "margin": 0, "min_samples": 1, "quantile": 1.0})
    assert bench.replay(rows, variant, 0.0, 0.0) == [50, 7, 500]
    # Learned only once finished: request 0 ends at 0 + 7 * 0.5 s, after request 1 arrived at 1 s.
    assert bench.replay(rows, variant, 0.0, 0.5) == [50, 50, 50]
    assert bench.replay(rows, bench.Variant("p", {"prior": 50}, prior_only=True), 0.0, 0.0) == [50, 50, 50]
    score = bench.score([50, 7, 500], rows)
    # errors +43, -493, +491
    assert (score.within_100, score.underestimated, score.under_by_more_than_100) == (1 / 3, 1 / 3, 1 / 3)
    assert score.mae == (43 + 493 + 491) / 3


def test_any_trace_path_gives_json_and_a_plot(tmp_path):
    trace = tmp_path / "tiny.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:17:{i:02d}.0000000,{100 + 37 * i},{20 + (i * 13) % 90}" for i in range(40)]
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "result.json"
    assert bench.main(["--trace", str(trace), "--quantiles", "0.5,0.75", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["traces"]["tiny"]
    assert [r["variant"]["name"] for r in rows][:3] == ["prior only (128)", "global window, q0.75 +20",
                                                          "buckets, q0.5 +0"]
    assert all(r["requests"] == 40 and 0 <= r["within_100"] <= 1 for r in rows)
    assert out.with_suffix(".png").stat().st_size > 0
