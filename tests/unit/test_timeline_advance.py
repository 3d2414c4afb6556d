"""WorkerTimeline.advance keeps its cumulative tables consistent with the segments left.

The cut used to move the origin before reading the shifts, so every cumulative table read 0 at
the cut and the remaining entries kept the consumed passes' spare budget: a later probe found
spare prefill budget in full passes (and divided by their zero spare per pass)."""

from __future__ import annotations

import pytest

from services.global_scheduler.timeline import MicroRequest, WorkerTimeline
from splitserve.perf.presets import preset


def _timeline_with_passes_cut(fraction: float = 0.5) -> WorkerTimeline:
    model = preset("A100", "Qwen2.5-14B", 1, link="nvlink")
    t = WorkerTimeline(model, 2048, 0.0)
    t.commit(MicroRequest("a", 100, 0, 200))  # a long decode: passes with spare budget
    t.commit(MicroRequest("b", 8192, 0, 32))  # fills the spare, then decodes
    t.advance(t.drain_time * fraction)  # cut after passes whose spare budget was used
    return t


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.7])
def test_advance_shifts_the_spare_table_to_the_cut(fraction):
    t = _timeline_with_passes_cut(fraction)
    t._index()
    for k, seg in enumerate(t.segments):
        per_pass = max(0, t.token_budget - seg.decodes - seg.prefill)
        assert t._spare[k + 1] - t._spare[k] == seg.passes * per_pass, (k, t._spare, t._spare_per_pass)


def test_probe_after_a_cut_matches_a_fresh_timeline_of_the_same_spare():
    t = _timeline_with_passes_cut(0.5)
    t._index()
    # The spare budget left is what the remaining segments offer, no more.
    left = sum(seg.passes * max(0, t.token_budget - seg.decodes - seg.prefill) for seg in t.segments)
    assert t._spare[-1] == left
    p = t.predict(MicroRequest("c", 8192, 0, 32))
    assert p.drain_time >= t.drain_time
