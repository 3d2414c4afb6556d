"""PollSchedule: fast while a transfer is expected or notifications arrive, exponential backoff when idle."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.kv_transfer.poll_schedule import PollSchedule


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def idle_delays(schedule: PollSchedule, clock: FakeClock, polls: int) -> list[float]:
    delays = []
    for _ in range(polls):
        clock.now += schedule.seconds_until_poll()
        delays.append(schedule.polled(found_notifications=False))
    return delays


def test_idle_polling_backs_off_exponentially_to_the_idle_delay():
    clock = FakeClock()
    schedule = PollSchedule(fast_s=0.001, idle_s=0.05, clock=clock)
    assert idle_delays(schedule, clock, 8) == [0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]


def test_an_expected_transfer_snaps_back_to_fast_polling_at_once():
    clock = FakeClock()
    schedule = PollSchedule(fast_s=0.001, idle_s=0.05, clock=clock)
    idle_delays(schedule, clock, 10)
    assert schedule.seconds_until_poll() == pytest.approx(0.05)
    schedule.expect("t1", timeout_s=5.0)
    assert schedule.seconds_until_poll() == 0  # poll now, not after the idle delay
    assert idle_delays(schedule, clock, 3) == [0.001] * 3
    schedule.done("t1")
    assert idle_delays(schedule, clock, 2) == [0.002, 0.004]


def test_notifications_keep_polling_fast_without_an_expectation():
    clock = FakeClock()
    schedule = PollSchedule(fast_s=0.001, idle_s=0.05, clock=clock)
    idle_delays(schedule, clock, 10)
    assert schedule.polled(found_notifications=True) == 0.001
    assert schedule.polled(found_notifications=False) == 0.002


def test_an_expectation_that_never_arrives_expires():
    clock = FakeClock()
    schedule = PollSchedule(fast_s=0.001, idle_s=0.05, clock=clock)
    schedule.expect("lost", timeout_s=1.0)
    assert schedule.expecting == 1
    clock.now += 0.5
    assert schedule.polled(False) == 0.001
    clock.now += 0.6
    assert schedule.expecting == 0
    assert schedule.polled(False) == 0.002


def test_bad_delays_are_refused():
    with pytest.raises(ValueError):
        PollSchedule(fast_s=0.1, idle_s=0.01)
    with pytest.raises(ValueError):
        PollSchedule(fast_s=0.0)


@given(st.lists(st.one_of(st.tuples(st.just("expect"), st.sampled_from("abc"), st.floats(0, 2)),
                          st.tuples(st.just("done"), st.sampled_from("abc")),
                          st.tuples(st.just("poll"), st.booleans()),
                          st.tuples(st.just("wait"), st.floats(0, 1)))))
def test_delays_stay_within_bounds_and_are_fast_while_expecting(ops):
    clock = FakeClock()
    schedule = PollSchedule(fast_s=0.001, idle_s=0.05, clock=clock)
    for op in ops:
        if op[0] == "expect":
            schedule.expect(op[1], op[2])
        elif op[0] == "done":
            schedule.done(op[1])
        elif op[0] == "wait":
            clock.now += op[1]
        else:
            expecting = schedule.expecting
            delay = schedule.polled(op[1])
            assert 0.001 <= delay <= 0.05
            if expecting or op[1]:
                assert delay == 0.001
        assert 0 <= schedule.seconds_until_poll() <= 0.05
