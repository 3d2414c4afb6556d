"""TransferTracker: token ranges arriving in any order, checksums, waiting that never hangs."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.kv_transfer.tracker import TransferTracker, add_range


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@st.composite
def chunkings(draw, max_tokens: int = 300):
    """(token_start, num_tokens, chunks): a cover of the range, shuffled, with extra overlapping chunks."""
    token_start = draw(st.integers(0, 64))
    num_tokens = draw(st.integers(1, max_tokens))
    cuts = sorted(draw(st.sets(st.integers(1, num_tokens - 1), max_size=20))) if num_tokens > 1 else []
    edges = [0, *cuts, num_tokens]
    chunks = [(token_start + a, token_start + b) for a, b in zip(edges, edges[1:])]
    extra = draw(st.lists(st.tuples(st.integers(0, num_tokens - 1), st.integers(1, num_tokens)), max_size=6))
    chunks += [(token_start + a, token_start + max(a + 1, b)) for a, b in extra]  # duplicates and overlaps
    return token_start, num_tokens, draw(st.permutations(chunks))


@settings(max_examples=300, deadline=None)
@given(chunkings())
def test_complete_exactly_when_every_token_arrived(case):
    token_start, num_tokens, chunks = case
    tracker = TransferTracker(clock=FakeClock())
    tracker.expect("t", "r", num_tokens, [0], token_start=token_start)
    covered: set[int] = set()
    for start, end in chunks:
        assert tracker.is_complete("t") == (len(covered) == num_tokens)
        tracker.on_chunk("t", start, end, True)
        covered |= set(range(start, end)) & set(range(token_start, token_start + num_tokens))
    assert tracker.is_complete("t") and not tracker.failed("t")
    assert tracker.get("t").received == [(token_start, token_start + num_tokens)]


@settings(max_examples=200, deadline=None)
@given(chunkings(), st.data())
def test_one_bad_checksum_fails_the_transfer_whatever_the_order(case, data):
    token_start, num_tokens, chunks = case
    bad = data.draw(st.integers(0, len(chunks) - 1))
    tracker = TransferTracker(clock=FakeClock())
    tracker.expect("t", "r", num_tokens, [0], token_start=token_start)
    for i, (start, end) in enumerate(chunks):
        tracker.on_chunk("t", start, end, i != bad)
        if tracker.is_complete("t"):
            # Completion before the bad chunk arrived is final: the stage may already run.
            assert i < bad
            return
    assert tracker.failed("t") and not tracker.is_complete("t")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=30))
def test_add_range_keeps_sorted_disjoint_merged_ranges(pairs):
    ranges: list[tuple[int, int]] = []
    tokens: set[int] = set()
    for a, b in pairs:
        add_range(ranges, a, b)
        tokens |= set(range(a, b))
    assert {t for start, end in ranges for t in range(start, end)} == tokens
    assert all(start < end for start, end in ranges)
    assert all(prev_end < start for (_, prev_end), (start, _) in zip(ranges, ranges[1:]))


def test_chunks_outside_the_expected_range_do_not_count():
    tracker = TransferTracker()
    tracker.expect("t", "r", 32, [1, 2], token_start=16)
    tracker.on_chunk("t", 0, 20, True)  # an edge block shared with the previous transfer
    tracker.on_chunk("t", 40, 64, True)
    assert not tracker.is_complete("t")
    tracker.on_chunk("t", 20, 40, True)
    assert tracker.is_complete("t")


def test_chunks_before_expect_are_replayed_and_stale_ones_expire():
    clock = FakeClock()
    tracker = TransferTracker(clock=clock, early_chunk_ttl_s=5.0)
    tracker.on_chunk("stale", 0, 16, True)
    clock.now += 10
    tracker.on_chunk("early", 0, 16, True)  # any later arrival prunes expired early chunks
    tracker.expect("early", "r", 16, [0])
    tracker.expect("stale", "r", 16, [0])
    assert tracker.is_complete("early") and not tracker.is_complete("stale")
    assert tracker.elapsed_s("early") == 0.0


def test_elapsed_uses_the_injected_clock():
    clock = FakeClock()
    tracker = TransferTracker(clock=clock)
    tracker.expect("t", "r", 32, [0, 1])
    clock.now += 0.25
    tracker.on_chunk("t", 0, 16, True)
    assert tracker.elapsed_s("t") is None
    clock.now += 0.5
    tracker.on_chunk("t", 16, 32, True)
    assert tracker.elapsed_s("t") == pytest.approx(0.75)


def test_wait_returns_true_on_completion_from_another_task():
    async def scenario() -> bool:
        tracker = TransferTracker()
        tracker.expect("t", "r", 32, [0, 1])

        async def arrive() -> None:
            await asyncio.sleep(0)
            tracker.on_chunk("t", 16, 32, True)
            await asyncio.sleep(0)
            tracker.on_chunk("t", 0, 16, True)

        arrival = asyncio.create_task(arrive())
        done = await tracker.wait("t", timeout_s=5.0)
        await arrival
        return done

    assert asyncio.run(scenario()) is True


def test_wait_returns_false_on_timeout_failure_cancel_and_forget():
    async def scenario() -> list[bool]:
        tracker = TransferTracker()
        for tid in ("slow", "bad", "cancelled", "forgotten"):
            tracker.expect(tid, "r", 32, [0, 1])
        tracker.on_chunk("bad", 0, 16, False)
        waits = [asyncio.create_task(tracker.wait(tid, timeout_s=t))
                 for tid, t in (("slow", 0.01), ("bad", 5.0), ("cancelled", 5.0), ("forgotten", 5.0))]
        await asyncio.sleep(0)
        tracker.cancel("cancelled")
        tracker.forget("forgotten")
        tracker.on_chunk("cancelled", 0, 32, True)  # too late to matter
        return await asyncio.wait_for(asyncio.gather(*waits), 2.0)

    assert asyncio.run(scenario()) == [False, False, False, False]


def test_wait_on_unknown_transfer_raises_and_queries_are_false():
    tracker = TransferTracker()
    assert not tracker.is_complete("nope") and not tracker.failed("nope")
    with pytest.raises(KeyError):
        asyncio.run(tracker.wait("nope", 1.0))


def test_empty_transfer_is_complete_at_once_and_duplicates_are_rejected():
    tracker = TransferTracker()
    tracker.expect("t", "r", 0, [])
    assert tracker.is_complete("t")
    assert asyncio.run(tracker.wait("t", 0.0)) is True
    with pytest.raises(ValueError):
        tracker.expect("t", "r", 16, [0])
    assert tracker.pending() == []
