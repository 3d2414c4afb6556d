"""Benchmark options -> workload items and arrival processes (pure; real trace files)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TRACES_DIR

from loadgen import arrivals
from loadgen.bench_config import BenchOptions, arrival_at_rate, build_workload, describe_arrival, resolve_arrival
from loadgen.plan import BenchRequest, SessionPlan

AZURE = TRACES_DIR / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES_DIR / "mooncake_conversation_trace.jsonl"

needs_traces = pytest.mark.skipif(not AZURE.exists() or not MOONCAKE.exists(), reason="shared traces not present")


def test_shapes_cycle_and_are_reproducible():
    opts = BenchOptions(shapes=["P8/D2,P16/D4"], num_requests=5, seed=3)
    workload = build_workload(opts)
    items = workload.make_items("t", 256)
    assert [(i.prompt_len, i.output_len) for i in items] == [(8, 2), (16, 4), (8, 2), (16, 4), (8, 2)]
    assert all(0 <= t < 256 for i in items for t in i.prompt_token_ids)
    assert [i.prompt_token_ids for i in items] == [i.prompt_token_ids for i in workload.make_items("u", 256)]
    assert isinstance(resolve_arrival(opts, workload), arrivals.PoissonArrivals)


def test_default_shape_and_length_scale():
    items = build_workload(BenchOptions(num_requests=2, length_scale=0.5)).make_items("t", 100)
    assert [(i.prompt_len, i.output_len) for i in items] == [(128, 32)] * 2


@needs_traces
def test_trace_workload_replays_scaled_lengths_and_timestamps():
    opts = BenchOptions(trace=AZURE, length_scale=0.1, num_requests=20, trace_time_scale=4.0)
    workload = build_workload(opts)
    items = workload.make_items("t", 256)
    assert len(items) == 20 and workload.description["num_requests"] == 20
    assert all(isinstance(i, BenchRequest) and i.prompt_len >= 1 and i.output_len >= 1 for i in items)
    process = resolve_arrival(opts, workload)
    assert isinstance(process, arrivals.TraceArrivals) and process.time_scale == 4.0
    offsets = process.offsets(20, np.random.default_rng(0))
    assert offsets[-1] == pytest.approx(workload.trace_timestamps[19] / 4.0)
    # A sweep rate rescales the replay to that mean rate.
    at_rate = arrival_at_rate(process, 10.0).offsets(20, np.random.default_rng(0))
    assert 19 / at_rate[-1] == pytest.approx(10.0)
    assert "trace replay of 20" in describe_arrival(process)


@needs_traces
def test_mooncake_prefix_blocks_become_shared_prompt_prefixes():
    items = build_workload(BenchOptions(trace=MOONCAKE, length_scale=0.01, num_requests=3)).make_items("t", 256)
    # The first rows share hash id 0: their first block (512 * 0.01 -> 5 tokens) is identical.
    assert items[0].prompt_token_ids[:5] == items[1].prompt_token_ids[:5] == items[2].prompt_token_ids[:5]
    assert items[0].prompt_token_ids[5:10] != items[1].prompt_token_ids[5:10]


def test_sessions_workload():
    opts = BenchOptions(sessions="hotpotqa", num_sessions=4, length_scale=0.02, tool_delay="none")
    workload = build_workload(opts)
    plans = workload.make_items("run1", 256)
    assert len(plans) == 4 and all(isinstance(p, SessionPlan) and len(p.rounds) == 3 for p in plans)
    assert all(p.session_id.endswith("-run1") for p in plans)
    assert all(r.delay_before_s == 0 for p in plans for r in p.rounds)
    assert workload.description["num_requests"] == 12


@pytest.mark.parametrize("opts, message", [
    (BenchOptions(shapes=["P8/D2"], sessions="gaia"), "choose one"),
    (BenchOptions(arrival="trace"), "give --trace"),
    (BenchOptions(sessions="nope"), "unknown session preset"),
    (BenchOptions(shapes=["P8"]), "shape"),
    (BenchOptions(arrival="poisson:rate=0"), "rate"),
])
def test_bad_options_are_refused(opts, message):
    with pytest.raises(ValueError, match=message):
        resolve_arrival(opts, build_workload(opts))


def test_closed_loop_has_no_arrival_process_and_rates_keep_the_kind():
    opts = BenchOptions(concurrency=3)
    assert resolve_arrival(opts, build_workload(opts)) is None
    assert arrival_at_rate(arrivals.gamma(1.0, 0.5), 4.0) == arrivals.GammaArrivals(4.0, 0.5)
    assert arrival_at_rate(arrivals.constant(1.0), 4.0) == arrivals.ConstantArrivals(4.0)
    assert arrival_at_rate(None, 4.0) == arrivals.PoissonArrivals(4.0)
    assert BenchOptions(api_key="secret").to_dict()["api_key"] == "***"
