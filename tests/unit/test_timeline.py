"""DynaServe's execution predictor (services.global_scheduler.timeline) against the perf model
and a pass-by-pass reference simulation."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.global_scheduler.timeline import MicroRequest, WorkerTimeline
from splitserve.perf.model import PerfModel
from splitserve.perf.presets import preset

PERF = preset("A100", "qwen2.5-14b")
BUDGET = 2048


def reference_drain(perf: PerfModel, requests: list[MicroRequest], budget: int = BUDGET) -> float:
    """Pass by pass, the engine's rules: every decoder one token per pass, then prefill tokens
    first come first served in the rest of the budget (all requests present from pass 0)."""
    state = [[r.prefill, max(0, r.decode - 1) if r.prefill else r.decode, r.history, r] for r in requests]
    t = 0.0
    while any(s[0] > 0 or s[1] > 0 for s in state):
        decoders = [s for s in state if s[0] == 0 and s[1] > 0]
        left = budget - len(decoders)
        chunks, finishing = [], []
        for s in state:
            if s[0] > 0 and left > 0:
                take = min(s[0], left)
                chunks.append((s[2], take))
                left -= take
                finishing.append((s, take))
        context = sum(s[3].history + s[3].prefill + (s[3].decode - s[1]) for s in decoders)
        t += perf.step_time(chunks, len(decoders), context / len(decoders) if decoders else 0.0)
        for s in decoders:
            s[1] -= 1
        for s, take in finishing:
            s[0] -= take
            s[2] += take
    return t


def test_a_request_alone_costs_its_prefill_and_decodes():
    timeline = WorkerTimeline(PERF, BUDGET)
    p = timeline.predict(MicroRequest("r", 2048, 0, 512))
    assert p.first_token_time == pytest.approx(PERF.prefill_time(0, 2048), rel=1e-9)
    decodes = sum(PERF.decode_time(1, 2049 + i) for i in range(511))
    assert p.finish_time == pytest.approx(PERF.prefill_time(0, 2048) + decodes, rel=1e-3)
    committed = timeline.commit(MicroRequest("r", 2048, 0, 512))
    assert timeline.drain_time == pytest.approx(committed.finish_time, rel=1e-3)
    assert (committed.decode_from, committed.finish_pass) == (1, 512)


def test_a_stage_that_ends_inside_the_prompt_samples_nothing():
    timeline = WorkerTimeline(PERF, BUDGET)
    p = timeline.commit(MicroRequest("alpha", 3000, 0, 0))
    assert p.first_token_time == math.inf
    assert p.finish_pass == 2  # 3000 tokens in two passes of the 2048-token budget
    assert timeline.drain_time == pytest.approx(PERF.step_time(((0, 2048),)) + PERF.step_time(((2048, 952),)),
                                                rel=0.05)


requests = st.lists(st.builds(MicroRequest, key=st.uuids().map(str), prefill=st.integers(0, 3000),
                              history=st.integers(0, 2000), decode=st.integers(1, 400)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_commits_predict_the_reference_simulation_within_a_few_percent(reqs):
    timeline = WorkerTimeline(PERF, BUDGET)
    for r in reqs:
        timeline.commit(r)
    assert timeline.drain_time == pytest.approx(reference_drain(PERF, reqs), rel=0.06)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(requests, st.builds(MicroRequest, key=st.just("probe"), prefill=st.integers(0, 3000),
                           history=st.integers(0, 2000), decode=st.integers(1, 400)))
def test_a_probe_predicts_what_committing_does(reqs, probe):
    timeline = WorkerTimeline(PERF, BUDGET)
    for r in reqs:
        timeline.commit(r)
    before = timeline.drain_time
    predicted = timeline.predict(probe)
    committed = timeline.commit(probe)
    assert predicted == committed  # commit reports the prediction it acted on
    # The probe prices passes approximately (mean context, linear fill); the commit exactly.
    assert timeline.drain_time == pytest.approx(predicted.drain_time, rel=0.03)
    assert timeline.drain_time >= before - 1e-9
    timeline.remove("probe")
    assert timeline.drain_time == pytest.approx(before, rel=1e-9)  # what it added is taken out exactly


def test_advancing_forgets_finished_work_and_keeps_the_future():
    timeline = WorkerTimeline(PERF, BUDGET)
    short = timeline.commit(MicroRequest("short", 512, 0, 20))
    long = timeline.commit(MicroRequest("long", 512, 0, 400))
    drain = timeline.drain_time
    short_done = timeline.time_of_pass(short.finish_pass)  # later than predicted alone: "long" shares its passes
    assert short_done > short.finish_time
    timeline.advance(short_done + 1e-6)
    assert set(timeline.placed) == {"long"}
    assert timeline.drain_time == pytest.approx(drain, rel=1e-9)
    assert timeline.origin_pass == short.finish_pass and timeline.origin == pytest.approx(short_done)
    timeline.advance(drain + 1.0)
    assert not timeline.placed and not timeline.segments and timeline.drain_time == drain + 1.0
    assert long.finish_pass == 400


def test_a_second_stage_waits_for_its_first():
    timeline = WorkerTimeline(PERF, BUDGET)
    timeline.commit(MicroRequest("busy", 1024, 0, 50))
    late = timeline.drain_time + 2.0
    p = timeline.predict(MicroRequest("beta", 0, 3000, 100), not_before=late)
    assert p.first_token_time == pytest.approx(late + PERF.decode_time(1, 3001 + 49), rel=0.02)
    assert p.finish_time == pytest.approx(late + sum(PERF.decode_time(1, 3001 + i) for i in range(100)), rel=1e-3)


def test_an_earlier_second_stage_shares_passes_with_what_runs():
    timeline = WorkerTimeline(PERF, BUDGET)
    busy = timeline.commit(MicroRequest("busy", 512, 0, 300))
    start = timeline.time_of_pass(100)
    p = timeline.predict(MicroRequest("beta", 0, 600, 50), not_before=start)
    assert p.first_pass == 100 and p.finish_pass == 150
    alone = sum(PERF.decode_time(1, 601 + i) for i in range(50))
    assert p.finish_time - start < alone * 1.2  # batched with "busy": each pass costs far less than alone
    assert p.drain_time == pytest.approx(busy.finish_time, rel=0.05)


def test_bad_micro_requests_are_refused_by_name():
    with pytest.raises(ValueError, match="micro-request 'x'"):
        MicroRequest("x", 0, 0, 0)
    with pytest.raises(ValueError, match="token_budget"):
        WorkerTimeline(PERF, 0)
    timeline = WorkerTimeline(PERF, BUDGET)
    timeline.commit(MicroRequest("x", 10, 0, 1))
    with pytest.raises(ValueError, match="already"):
        timeline.commit(MicroRequest("x", 10, 0, 1))
    assert not timeline.remove("unknown")


def _vectorised_tables(timeline: WorkerTimeline) -> dict[str, list]:
    """The timeline's per-segment tables computed with `PerfModel.step_times` over numpy arrays
    (how `_index` computed them before it moved to plain floats)."""
    import numpy as np

    segs, budget, perf = timeline.segments, timeline.token_budget, timeline.perf_model
    passes = np.array([s.passes for s in segs], dtype=np.float64)
    decodes = np.array([s.decodes for s in segs], dtype=np.float64)
    prefill = np.array([s.prefill for s in segs], dtype=np.float64)
    history = np.array([s.prefill_history for s in segs], dtype=np.float64)
    pairs = np.array([s.prefill_pairs for s in segs], dtype=np.float64)
    context = np.array([s.decode_context for s in segs], dtype=np.float64) + decodes * (passes - 1) / 2
    seconds = perf.step_times(prefill, history, decodes, context, prefill_pairs=pairs)
    spare = np.maximum(0.0, budget - decodes - prefill)
    filled = perf.step_times(prefill + spare, history, decodes, context, prefill_pairs=pairs + spare * spare / 2) \
        - seconds
    mean = np.where(decodes > 0, context / np.maximum(decodes, 1), prefill)
    one_more = perf.step_times(prefill, history, decodes + 1, context + mean, prefill_pairs=pairs) - seconds
    return {
        "_seconds": seconds.tolist(), "_spare_per_pass": spare.astype(np.int64).tolist(),
        "_fill_per_pass": filled.tolist(), "_decode_per_pass": one_more.tolist(),
        "_times": np.concatenate(([timeline.origin], timeline.origin + np.cumsum(passes * seconds))).tolist(),
        "_spare": np.concatenate(([0], np.cumsum(passes * spare))).astype(np.int64).tolist(),
        "_fill_cost": np.concatenate(([0.0], np.cumsum(passes * filled))).tolist(),
        "_decode_cost": np.concatenate(([0.0], np.cumsum(passes * one_more))).tolist(),
    }


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(requests, st.floats(0.0, 5.0))
def test_the_plain_float_tables_equal_the_vectorised_ones_bit_for_bit(reqs, advance_s):
    timeline = WorkerTimeline(PERF, BUDGET, origin=1_795_000_000.0)  # an epoch-sized clock
    for r in reqs:
        timeline.commit(r)
    for now in (timeline.origin, timeline.origin + advance_s):
        timeline.advance(now)
        timeline._dirty = True
        timeline._index()
        expected = _vectorised_tables(timeline)
        assert {name: getattr(timeline, name) for name in expected} == expected


@given(st.floats(0, 1e5), st.floats(0, 1e5), st.integers(0, 512), st.floats(0, 1e7), st.floats(0, 1e9))
def test_one_step_in_plain_floats_equals_step_times(tokens, history, batch, context, pairs):
    import numpy as np

    vectorised = PERF.step_times(np.array([tokens]), np.array([history]), np.array([batch]), np.array([context]),
                                 prefill_pairs=np.array([pairs]))[0]
    assert PERF.step_seconds(tokens, history, float(batch), context, pairs) == vectorised


def test_a_requests_longest_gap_is_between_its_tokens_not_its_prefill():
    """On an idle worker a 2,048-token prompt takes one ~200 ms pass before its first token: that
    is its TTFT; its gaps are its decode passes (counted as a gap, every whole request on an idle
    worker failed a 100 ms ITL check, and DynaServe sent all work to the busy worker)."""
    timeline = WorkerTimeline(PERF, 2048, 0.0)
    prediction = timeline.predict(MicroRequest("r", 2048, 0, 64))
    prefill_pass = PERF.step_time(((0, 2048),), 0, 0.0)
    assert prefill_pass > 0.1
    assert prediction.first_token_time == pytest.approx(prefill_pass, rel=1e-6)
    assert prediction.longest_pass_s < 0.05
