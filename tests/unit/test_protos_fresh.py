"""The committed stubs match protos/, and the wire messages round-trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from splitserve.proto import types_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gen_protos.py"), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        "generated stubs are stale; run `make protos`\n" + result.stdout + result.stderr
    )


def _two_stage_plan() -> types_pb2.Plan:
    sampling = types_pb2.SamplingParams(
        max_tokens=8, temperature=0.0, top_k=5, seed=7, stop=["\n\n"], stop_token_ids=[2]
    )
    prompt = [101, 102, 103, 104, 105]
    prefill = types_pb2.Stage(
        request_id="req-1",
        stage_index=0,
        worker_id="w-prefill",
        start=0,
        end=5,
        prompt_token_ids=prompt,
        sampling=sampling,
        kv_sink=types_pb2.KvSink(worker_id="w-decode", chunk_tokens=16, transfer_id="t-1"),
        emit=True,
    )
    decode = types_pb2.Stage(
        request_id="req-1",
        stage_index=1,
        worker_id="w-decode",
        start=5,
        end=13,
        prompt_token_ids=prompt,
        generated_token_ids=[7],
        sampling=sampling,
        kv_sources=[
            types_pb2.KvSource(worker_id="w-prefill", start=0, end=5, transfer_id="t-1")
        ],
        emit=True,
        keep_kv=True,
    )
    return types_pb2.Plan(stages=[prefill, decode], policy="pd_disaggregated", reason="test")


def test_plan_with_two_stages_round_trips() -> None:
    plan = _two_stage_plan()
    decoded = types_pb2.Plan.FromString(plan.SerializeToString())
    assert decoded == plan
    assert [s.worker_id for s in decoded.stages] == ["w-prefill", "w-decode"]
    assert [(s.start, s.end) for s in decoded.stages] == [(0, 5), (5, 13)]
    assert decoded.stages[0].kv_sink.transfer_id == decoded.stages[1].kv_sources[0].transfer_id
    assert decoded.stages[1].generated_token_ids == [7]
    assert decoded.stages[1].keep_kv and not decoded.stages[0].keep_kv
    # Explicit presence: a greedy temperature of 0 is distinguishable from "unset".
    assert decoded.stages[0].sampling.HasField("temperature")
    assert decoded.stages[0].sampling.temperature == 0.0
    assert not decoded.stages[0].sampling.HasField("top_p")
    assert decoded.stages[0].sampling.seed == 7
