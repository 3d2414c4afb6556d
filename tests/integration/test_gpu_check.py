"""The prepared GPU check (scripts/gpu_check.sh) in its CPU quick mode: every sub-check runs (or
says why not), the engine is token-exact against transformers, the grid's JSON is what
benchmarks/gpu_check_compare.py reads, and a sub-check past its time limit is recorded, not fatal."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBCHECKS = ("env", "token_exact", "kv_digest", "grid", "captured_shapes", "profile")
GRID_KEYS = {"chunk_tokens", "chunk_history", "decode_batch", "decode_context", "seconds_median", "repeats"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("GPU_CHECK_CPU_SMOKE", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    return out, proc


def test_the_cpu_smoke_runs_every_sub_check_and_passes(smoke_run):
    out, proc = smoke_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["mode"] == "smoke" and summary["passed"] is True
    assert summary["elapsed_s"] < 100  # ~20 s here; the smoke's own limit is 90 s of sub-checks
    assert set(summary["subchecks"]) == set(SUBCHECKS)
    for name, result in summary["subchecks"].items():
        assert result["status"] in ("ok", "skipped"), (name, result)
        if result["status"] == "skipped":
            assert result.get("reason"), name
        assert (out / f"{name}.json").is_file()
    assert "all sub-checks ok" in proc.stdout


def test_the_engine_is_token_exact_against_transformers(smoke_run):
    out, _ = smoke_run
    result = json.loads((out / "token_exact.json").read_text())
    assert result["status"] == "ok" and result["passed"] is True
    llama = result["archs"]["llama"]
    assert set(llama["runs"]) == {"one_by_one", "batched", "batched_chunked_prefill_16"}
    assert all(run["match"] for run in llama["runs"].values())


def test_the_grid_writes_the_records_the_compare_script_reads(smoke_run, tmp_path):
    out, _ = smoke_run
    grid = json.loads((out / "grid.json").read_text())
    assert grid["status"] == "ok" and not grid["skipped_points"]
    assert "ModelRunner.execute" in grid["code_path"]
    records = grid["records"]
    assert len(records) == 24
    assert all(GRID_KEYS <= set(r) and r["seconds_median"] > 0 for r in records)
    assert {(r["chunk_tokens"] > 0, r["decode_batch"] > 0) for r in records} == {(True, False), (False, True),
                                                                                 (True, True)}
    compare = [sys.executable, str(REPO / "benchmarks" / "gpu_check_compare.py"), str(out),
               "--out", str(tmp_path / "compare.json")]
    have_aic = importlib.util.find_spec("aiconfigurator_core") is not None
    if not have_aic:
        compare.append("--no-aiconfigurator")
    proc = subprocess.run(compare, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "compare.json").read_text())["rows"]
    assert len(rows) == len(records)
    assert all(r["perf_model_ms"] > 0 for r in rows)
    if have_aic:
        assert all(r["aic_total_ms"] > 0 and r["aic_over_measured"] > 0 for r in rows)
    assert (tmp_path / "compare.md").read_text().count("\n|") >= len(rows) + 1


def test_kv_digests_and_captured_shapes_in_the_smoke(smoke_run):
    out, _ = smoke_run
    kv = json.loads((out / "kv_digest.json").read_text())
    assert kv["digest"]["equal"] and kv["digest"]["corruption_detected"] and kv["kv_memory"]["status"] == "ok"
    captured = json.loads((out / "captured_shapes.json").read_text())
    assert all(v["same_tokens"] and v["padded_steps"] >= 1 for v in captured["tokens"]["variants"].values())
    assert all(case["status"] == "ok" for case in captured["timing"]["cases"])
    decode = captured["timing"]["decode_step"]
    assert decode["status"] == "ok" and decode["decode_graph_on_bucketed"] and not decode["decode_graph_off_bucketed"]


def test_the_profile_splits_each_step_and_runs_decode_steps_as_decode_graphs(smoke_run):
    out, _ = smoke_run
    profile = json.loads((out / "profile.json").read_text())
    assert profile["status"] == "ok"
    by_shape = {(p["chunk_tokens"], p["decode_batch"]): p for p in profile["points"]}
    assert by_shape[(0, 1)]["decode_graph"] and not by_shape[(32, 4)]["decode_graph"]  # a mixed step has none
    for point in profile["points"]:
        assert min(point["step_ms"], point["step_eager_ms"], point["forward_ms"]) > 0
        assert point["top_host_ops"] and point["prepare_ms"] + point["sample_ms"] < point["step_eager_ms"]
    attention = profile["decode_attention"]
    if importlib.util.find_spec("triton") is None:
        assert attention["status"] == "skipped" and "triton" in attention["reason"]


def test_a_sub_check_past_its_time_limit_is_recorded_and_the_run_goes_on(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    (tmp_path / "logs").mkdir()
    result = gpu_check._launch("grid", "smoke", tmp_path, 1.0)  # imports alone take longer
    assert result["status"] == "timeout" and "time limit" in result["reason"]
    assert json.loads((tmp_path / "grid.json").read_text())["status"] == "timeout"
