"""benchmarks/ampd_eval.py's Mixtral-8x7B row (Figure 4's third row of the AMPD paper)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ampd_eval.py"
if "ampd_eval" in sys.modules:
    ae = sys.modules["ampd_eval"]
else:
    _spec = importlib.util.spec_from_file_location("ampd_eval", _PATH)
    ae = importlib.util.module_from_spec(_spec)
    sys.modules["ampd_eval"] = ae
    _spec.loader.exec_module(ae)


def test_mixtral_takes_the_papers_slos_and_budgets():
    slos = {w.preset: (w.gpus, w.ttft_ms, w.itl_ms) for w in ae.WORKLOADS_BY_MODEL["Mixtral-8x7B"]}
    assert slos == {"toolbench": (8, 130, 30), "hotpotqa": (8, 150, 25), "dureader": (16, 300, 50),
                    "gaia": (32, 350, 20)}


def test_mixtrals_paper_gains_are_the_arrows_before_each_panels_title():
    dynamo, vllm, continuum = ae.PAPER_BASELINES
    assert ae.paper_gain("Mixtral-8x7B", "toolbench", dynamo) == pytest.approx((0 + 1.74 + 8.95 + 4.44 + 3.98) / 500)
    assert ae.paper_gain("Mixtral-8x7B", "toolbench", vllm) == pytest.approx((-2.33 + 6.36 + 94.22 + 333 + 400) / 500)
    # The text's "up to 3435.1%" over vLLM.
    assert max(r[1] for rows in ae.PAPER_GAINS.values() for r in rows) == 3435
    assert all(len(ae.PAPER_GAINS[("Mixtral-8x7B", w)]) == 5 for w in ("toolbench", "gaia", "hotpotqa", "dureader"))


@pytest.mark.parametrize("gpu", ["H200", "H100", "H20"])
def test_every_searched_tp_holds_mixtrals_weights(gpu):
    assert ae.Timing(gpu, "Mixtral-8x7B", "datasheet").tps() == (2, 4, 8)
