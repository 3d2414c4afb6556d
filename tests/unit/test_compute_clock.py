"""DynaServe's per-worker execution clock (`compute_clock.py`) against a brute-force sum."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.global_scheduler.compute_clock import ComputeClock
from splitserve.perf.presets import preset

EPOCH = 1.79e9  # an epoch-sized scheduler clock: the sums must not lose its digits


def reference(items: dict[str, tuple[float, float, float]], now: float) -> float:
    total = 0.0
    for seconds, start, finish in items.values():
        if now < start:
            total += seconds
        elif now < finish:
            total += seconds * (finish - now) / (finish - start)
    return total


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 7), st.floats(0, 5), st.floats(0, 20), st.floats(0, 20)),
    st.tuples(st.just("remove"), st.integers(0, 7)),
    st.tuples(st.just("tick"), st.floats(0, 3)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=40))
def test_backlog_equals_the_sum_of_what_remains_of_each(ops):
    clock, items, now = ComputeClock(), {}, EPOCH
    for op in ops:
        if op[0] == "add":
            _, k, seconds, start_in, span = op
            start = now + start_in - 10  # may have started already
            clock.add(f"k{k}", seconds, start, start + span)
            items[f"k{k}"] = (seconds, start, start + span)
        elif op[0] == "remove":
            clock.remove(f"k{op[1]}")
            items.pop(f"k{op[1]}", None)
        else:
            now += op[1]
        assert clock.backlog(now) == pytest.approx(reference(items, now), abs=1e-6)


def test_reset_and_unknown_keys():
    clock = ComputeClock()
    assert clock.backlog(EPOCH) == 0.0
    clock.add("a", 2.0, EPOCH, EPOCH + 4)
    clock.remove("nothing")
    assert clock.backlog(EPOCH + 1) == pytest.approx(1.5)
    clock.reset()
    assert clock.backlog(EPOCH + 2) == 0.0 and len(clock) == 0


def test_compute_seconds_follow_the_compute_line():
    perf = preset("A100", "qwen2.5-14b")
    p, d = perf.prefill, perf.decode
    assert perf.work_seconds(100, 50, 0) == pytest.approx(p.c_tok * 100 + p.c_attn * 100 * (50 + 50))
    # two decode tokens read 151 then 152 positions
    assert perf.work_seconds(100, 50, 2) - perf.work_seconds(100, 50, 0) == pytest.approx(
        2 * d.c_seq + d.c_ctx * (151 + 152))
    # a prompt costs far more compute than a decode token of the same request
    assert perf.work_seconds(2048, 0, 0) > 50 * perf.work_seconds(0, 2048, 1)
