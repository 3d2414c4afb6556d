"""Issue 12: a capacity search must offer a window of arrivals, not a fixed request count.

Two A100 x Qwen2.5-14B workers, round_robin, P219/D1467. By the preset, no steady state can
exceed ``HARD_BOUND`` req/s: a worker runs at most 256 requests (--max-num-seqs), each needs
1,467 decode steps, and no decode step is shorter than a batch of one's, 17.7 ms at a
219-token context; so 2 x 256 / (1467 x 0.0177 s) = 19.7 req/s. (The KV cache is tighter
still: 205,792 tokens per worker hold ~216 requests at their mean 952-token context, whose
decode step takes ~44 ms: ~6.6 req/s; a 180 s window measures 5.5 passing, 6.25 failing.)

A fixed 200 requests at 24 req/s arrive within 8 s and all fit in the KV cache at once, so the
probe "passes" above that bound: the bug. Sized by a window, the probe at 24 req/s sends 480
requests over 20 s, more than the cache holds, and fails. (About 10 s of wall time: a probe
only fails when it overloads the cluster, ~500 requests of 1,467 tokens here.)
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.planner.cli import simulate_app
from services.planner.simulator import preset_kv_blocks
from splitserve.perf.presets import preset

WORKERS, MAX_NUM_SEQS, PROMPT, OUTPUT = 2, 256, 219, 1467
CLUSTER = ["--workers", str(WORKERS), "--gpu", "A100", "--model-preset", "qwen2.5-14b", "--policy", "round_robin",
           "--shape", f"P{PROMPT}/D{OUTPUT}", "--max-num-seqs", str(MAX_NUM_SEQS)]
RATE = 24.0


def hard_bound() -> float:
    model = preset("A100", "qwen2.5-14b", 1)
    return WORKERS * MAX_NUM_SEQS / (OUTPUT * model.decode_time(1, PROMPT))


def test_the_preset_numbers_of_the_docstring():
    assert hard_bound() == pytest.approx(19.7, abs=0.1) and RATE > hard_bound()
    kv_tokens = preset_kv_blocks("A100", "qwen2.5-14b", 1, 16) * 16
    assert kv_tokens == pytest.approx(205_792, rel=0.01)
    # 200 requests at their full length fit in the two workers' caches: nothing ever queues.
    assert 200 * (PROMPT + OUTPUT) < WORKERS * kv_tokens


def _probe(tmp_path, name: str, *sizing: str) -> dict:
    result = CliRunner().invoke(simulate_app, [*CLUSTER, "--sweep-rates", str(RATE), *sizing,
                                               "--out-dir", str(tmp_path / name)])
    assert result.exit_code == 0, result.output
    point = json.loads((tmp_path / name / "sweep.json").read_text())["points"][0]
    point["output"] = result.output
    return point


@pytest.mark.slow
def test_a_window_of_arrivals_fails_a_rate_a_fixed_count_passes(tmp_path):
    fixed = _probe(tmp_path, "fixed", "--probe-window", "0", "-n", "200")
    assert fixed["probe"]["count"] == 200 and fixed["attainment"] >= 0.9  # the bug: above the hard bound
    # ... and the probe says it never reached a steady state.
    assert fixed["steady_state"]["steady"] is False
    assert fixed["steady_state"]["reasons"][0].startswith("short window")
    assert "did not reach a steady state" in " ".join(fixed["output"].split())

    windowed = _probe(tmp_path, "windowed", "--probe-window", "20", "--min-requests", "20")
    assert windowed["probe"]["count"] == 480 and windowed["probe"]["window_s"] == 20
    assert windowed["attainment"] < 0.9
