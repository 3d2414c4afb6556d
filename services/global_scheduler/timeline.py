"""A worker's predicted future, in engine passes: DynaServe's execution predictor (§4.1).

The global scheduler cannot run a candidate plan to see how it does, so it predicts it.
A worker's timeline holds the micro-requests (stages) placed there and not finished yet,
run under the engine's rules: one pass at a time, every decoding request advancing one
token per pass, prefill filling the rest of the token budget first come first served; a
pass lasts what the performance model says for its shape.

The timeline lives in *pass space*: segments of identical passes (same decodes, same
prefill tokens). A micro-request's passes are indices, which do not move when other work
makes passes longer; times are prefix sums of pass durations. So:

* a probe — "when would this worker finish everything if it also ran this?" — needs no
  copy: the request's prefill tokens take the spare budget of the passes after the queued
  prefills, its decodes add one to each pass after that; the extra seconds are
  differences of prefix sums kept per segment (found by bisection), plus its passes past
  the end. Microseconds however long the timeline: the paper's "reuse the
  already-simulated prefix of the timing arrays and simulate only the delta";
* committing a placement splices the request into the segments exactly (cost linear in
  the segments it spans); removing it (it ended early) takes out exactly what it added;
* time passing cuts the prefix.

Approximations, each small where the engine runs well. Prefill is fluid: a pass gives
its whole spare budget to the prefill queue, one request after another. A probe prices
one more decode in a pass as if the new decoder had the pass's mean context, and a chunk
of prefill by the cost per token of filling the pass; the commit then computes each
pass exactly. A request that cannot start before the timeline's end (a second stage
waiting for its first) starts right after it: an idle gap between is not represented in
pass space (the prediction's times include it; the timeline forgets it, which errs
towards an earlier drain and is corrected as time passes).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from splitserve.perf.model import PerfModel


@dataclass(frozen=True, slots=True)
class MicroRequest:
    """A stage's work on one worker: `prefill` tokens on `history` whose KV is in place, then
    `decode` sampled tokens (the first in its last prefill pass when it prefills; a stage
    that ends inside the prompt samples none)."""

    key: str
    prefill: int
    history: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0 or self.history < 0 or self.prefill + self.decode == 0:
            raise ValueError(f"micro-request {self.key!r}: prefill and decode must be >= 0 and not both 0, "
                             f"got prefill {self.prefill}, decode {self.decode}, history {self.history}")

    @property
    def kv_tokens(self) -> int:
        """KV tokens the stage holds at its end (its history, prefill and samples)."""
        return self.history + self.prefill + self.decode

    @property
    def context_at_first_decode(self) -> int:
        """KV length the request reads in its first decode-only pass."""
        return self.history + self.prefill + (1 if self.prefill else 0)


@dataclass(frozen=True, slots=True)
class Prediction:
    """Where and when a micro-request runs (pass indices; times on the scheduler's clock)."""

    first_pass: int
    decode_from: int  # its first decode-only pass
    finish_pass: int  # exclusive: it holds nothing from here on
    first_token_time: float  # end of the pass that samples its first token (inf if it samples none)
    finish_time: float
    drain_time: float  # when the worker would finish everything, this request included
    longest_pass_s: float  # its worst gap between tokens


@dataclass(slots=True)
class Segment:
    """`passes` identical passes from pass index `start`."""

    start: int
    passes: int
    decodes: int = 0  # decoding requests per pass
    # The prefill chunks of a pass, as the performance model's sums (so that adding and taking
    # out a request's chunks are exact inverses): tokens T, histories R, and A = sum n (h + n/2).
    prefill: int = 0
    prefill_history: float = 0.0
    prefill_pairs: float = 0.0
    decode_context: int = 0  # summed KV length the decodes read in the segment's first pass

    @property
    def end(self) -> int:
        return self.start + self.passes


@dataclass
class _Placed:
    request: MicroRequest
    prediction: Prediction
    prefill_ranges: list[tuple[int, int, int, float]]  # its prefill: (from pass, to pass, tokens, history) per pass


class WorkerTimeline:
    """One worker's predicted passes from `origin` (a time) on; see the module docstring."""

    def __init__(self, perf_model: PerfModel, token_budget: int = 2048, origin: float = 0.0):
        if token_budget <= 0:
            raise ValueError(f"token_budget must be > 0, got {token_budget}")
        self.perf_model = perf_model
        self.token_budget = token_budget
        self.origin = origin  # when pass `origin_pass` starts
        self.origin_pass = 0
        self.segments: list[Segment] = []
        self.placed: dict[str, _Placed] = {}
        self._dirty = True
        # Per segment i: one pass's seconds, spare budget, and the seconds one more decode or a
        # filled spare budget add to it; and cumulative tables (item i: before segment i, the
        # last item: after the last segment). Rebuilt in one vectorised pass after a change.
        self._starts: list[int] = []
        self._seconds: list[float] = []
        self._spare_per_pass: list[int] = []
        self._fill_per_pass: list[float] = []
        self._decode_per_pass: list[float] = []
        self._times: list[float] = []
        self._spare: list[int] = []
        self._fill_cost: list[float] = []
        self._decode_cost: list[float] = []

    # ---- queries ------------------------------------------------------------------------
    @property
    def end_pass(self) -> int:
        return self.segments[-1].end if self.segments else self.origin_pass

    @property
    def drain_time(self) -> float:
        """When everything placed here is done (`origin` when nothing is)."""
        self._index()
        return self._times[-1]

    def time_of_pass(self, pass_index: int) -> float:
        """When pass `pass_index` starts; past the end, when the end is."""
        self._index()
        if pass_index <= self.origin_pass or not self.segments:
            return self.origin
        i = bisect.bisect_right(self._starts, pass_index) - 1
        seg = self.segments[i]
        return self._times[i] + (min(pass_index, seg.end) - seg.start) * self._seconds[i]

    def pass_at(self, t: float) -> int:
        """The first pass that starts at or after time `t` (the end pass when past the end)."""
        self._index()
        if t <= self.origin or not self.segments:
            return self.origin_pass
        if t >= self._times[-1]:
            return self.end_pass
        i = bisect.bisect_right(self._times, t) - 1
        seg, seconds = self.segments[i], self._seconds[i]
        into = t - self._times[i]
        # A pass starting at `t` up to rounding is that pass, not the next one.
        return seg.start + (min(seg.passes, math.ceil(into / seconds - 1e-9)) if seconds > 0 else 0)

    # ---- probes ---------------------------------------------------------------------------
    def predict(self, request: MicroRequest, not_before: float | None = None) -> Prediction:
        """Where `request` would run if added now, starting no earlier than `not_before`."""
        self._index()
        first = self.origin_pass if not_before is None else self.pass_at(not_before)
        decode_from, finish = self._passes_of(request, first)
        end = self.end_pass
        wait = max(0.0, (not_before or self.origin) - self._times[-1]) if first >= end else 0.0
        # Seconds it adds inside the existing passes, up to pass x (x <= end).
        last_prefill = decode_from - 1  # the pass with its last prefill tokens (when it prefills)
        partial = self._partial_fill_seconds(request, first, last_prefill) if request.prefill else 0.0

        def extra_until(x: int) -> float:
            seconds = 0.0
            if request.prefill:
                # Passes whose whole spare budget it takes, then the rest in its last prefill pass.
                full_to = min(last_prefill, x)
                if first < full_to:
                    seconds += self._cumulative(self._fill_cost, self._fill_per_pass, full_to) - \
                        self._cumulative(self._fill_cost, self._fill_per_pass, first)
                if last_prefill < x:
                    seconds += partial
            if decode_from < x:
                seconds += self._cumulative(self._decode_cost, self._decode_per_pass, x) - \
                    self._cumulative(self._decode_cost, self._decode_per_pass, decode_from)
            return seconds

        inside = extra_until(end)
        tail_s, tail_first_token_s, tail_longest = self._alone(request, first, decode_from, finish, end)
        drain_base = self._times[-1] + inside
        if finish > end:
            finish_time = drain_base + wait + tail_s
        else:
            finish_time = self.time_of_pass(finish) + extra_until(finish)
        sample_pass = (decode_from - 1) if request.prefill else decode_from
        if request.decode == 0:
            first_token_time = float("inf")
        elif sample_pass < end:
            first_token_time = self.time_of_pass(sample_pass + 1) + extra_until(sample_pass + 1)
        else:
            first_token_time = drain_base + wait + tail_first_token_s
        longest = max(tail_longest, self._longest_inside(decode_from, min(finish, end)))
        return Prediction(first, decode_from, finish, first_token_time, finish_time,
                          max(drain_base, finish_time), longest)

    # ---- changes --------------------------------------------------------------------------
    def commit(self, request: MicroRequest, not_before: float | None = None) -> Prediction:
        """Add `request` for good (it was placed here); its prediction."""
        if request.key in self.placed:
            raise ValueError(f"micro-request {request.key!r} is already on this timeline")
        prediction = self.predict(request, not_before)
        first, decode_from, finish = prediction.first_pass, prediction.decode_from, prediction.finish_pass
        self._extend_to(finish)
        ranges = self._place_prefill(request, first) if request.prefill else []
        self._add_decodes(request, decode_from, finish, sign=+1, from_pass=decode_from)
        self.placed[request.key] = _Placed(request, prediction, ranges)
        self._dirty = True
        return prediction

    def remove(self, key: str) -> bool:
        """Take out what a micro-request still had to do (it ended, early or on time)."""
        placed = self.placed.pop(key, None)
        if placed is None:
            return False
        for lo, hi, per_pass, history in placed.prefill_ranges:
            lo = max(lo, self.origin_pass)
            if lo < hi:
                self._split_at(lo)
                self._split_at(hi)
                for seg in self._segments_in(lo, hi):
                    self._add_chunk(seg, per_pass, history, -1)
        p = placed.prediction
        self._add_decodes(placed.request, p.decode_from, p.finish_pass, sign=-1,
                          from_pass=max(p.decode_from, self.origin_pass))
        while self.segments and self.segments[-1].decodes == 0 and self.segments[-1].prefill == 0:
            self.segments.pop()  # nothing runs there any more
        self._dirty = True
        return True

    def advance(self, now: float) -> None:
        """Forget the passes that ended by `now`, and the requests done in them."""
        if now <= self.origin:
            return
        self._index()
        if not self.segments or now >= self._times[-1]:
            self.reset(now)
            return
        i = bisect.bisect_right(self._times, now) - 1
        seg, seconds = self.segments[i], self._seconds[i]
        done = int((now - self._times[i]) // seconds) if seconds > 0 else 0
        cut = seg.start + min(done, seg.passes)
        if cut <= self.origin_pass:
            return
        # The passes before the cut go; what follows keeps its pass times (the cut segment's
        # decodes read a little more context from here on: ignored until the next change).
        # The shifts are read before the origin moves: at the origin every cumulative is 0.
        shift_spare = self._spare_at(cut)
        shift_fill = self._fill_seconds_at_spare(shift_spare)
        shift_dec = self._cumulative(self._decode_cost, self._decode_per_pass, cut)
        self.origin = self._times[i] + (cut - seg.start) * seconds
        self.origin_pass = cut
        head = cut - seg.start
        seg.decode_context += seg.decodes * head
        seg.start, seg.passes = cut, seg.passes - head
        keep = i if seg.passes > 0 else i + 1
        self.segments = self.segments[keep:]
        self._starts = [seg.start] + self._starts[i + 1:] if keep == i else self._starts[keep:]
        for name in ("_seconds", "_spare_per_pass", "_fill_per_pass", "_decode_per_pass"):
            setattr(self, name, getattr(self, name)[keep:])
        self._times = [self.origin] + self._times[i + 1:]  # absolute times
        self._spare = [0] + [x - shift_spare for x in self._spare[i + 1:]]
        self._fill_cost = [0.0] + [x - shift_fill for x in self._fill_cost[i + 1:]]
        self._decode_cost = [0.0] + [x - shift_dec for x in self._decode_cost[i + 1:]]
        if keep != i:  # the cut segment is gone: the first table entries stand for it no more
            self._times, self._spare = self._times[1:], self._spare[1:]
            self._fill_cost, self._decode_cost = self._fill_cost[1:], self._decode_cost[1:]
            self._times[0], self._spare[0], self._fill_cost[0], self._decode_cost[0] = self.origin, 0, 0.0, 0.0
        self.placed = {k: p for k, p in self.placed.items() if p.prediction.finish_pass > cut}

    def reset(self, now: float) -> None:
        """Forget everything: the worker is idle at `now` (as its load report says)."""
        self.origin = max(self.origin, now)
        self.origin_pass = self.end_pass
        self.segments.clear()
        self.placed.clear()
        self._dirty = True

    # ---- internals: passes of a request -----------------------------------------------------
    def _passes_of(self, request: MicroRequest, first: int) -> tuple[int, int]:
        """(first decode-only pass, finish pass) of `request` started at pass `first`."""
        if request.prefill == 0:
            return first, first + request.decode
        need = self._spare_at(first) + request.prefill  # cumulative spare its last prefill token uses
        last = self._pass_where_spare_reaches(need)  # the pass computing its last prefill token
        return last + 1, last + max(1, request.decode)

    def _spare_at(self, pass_index: int) -> int:
        """Spare prefill budget of the passes before `pass_index` (past the end: a whole budget each)."""
        end = self.end_pass
        if pass_index >= end:
            return self._spare[-1] + (pass_index - end) * self.token_budget
        return int(self._cumulative(self._spare, self._spare_per_pass, pass_index))

    def _pass_where_spare_reaches(self, need: int) -> int:
        """The pass in which the cumulative spare budget first reaches `need` tokens."""
        total = self._spare[-1]
        if need > total:
            return self.end_pass + -(-(need - total) // self.token_budget) - 1
        i = bisect.bisect_left(self._spare, need) - 1
        seg = self.segments[i]
        per_pass = self.token_budget - seg.decodes - seg.prefill
        return seg.start + -(-(need - self._spare[i]) // per_pass) - 1

    def _partial_fill_seconds(self, request: MicroRequest, first: int, last_prefill: int) -> float:
        """Seconds its prefill tokens add to its last prefill pass (inside the existing passes)."""
        if last_prefill >= self.end_pass:
            return 0.0
        tokens = self._spare_at(first) + request.prefill - self._spare_at(last_prefill)
        i = bisect.bisect_right(self._starts, last_prefill) - 1
        seg = self.segments[i]
        history = request.history + request.prefill - tokens  # its last chunk's history
        context = seg.decode_context + seg.decodes * (last_prefill - seg.start)
        step = self.perf_model.step_seconds
        before = step(float(seg.prefill), float(seg.prefill_history), float(seg.decodes), float(context),
                      float(seg.prefill_pairs))
        after = step(float(seg.prefill + tokens), float(seg.prefill_history + history), float(seg.decodes),
                     float(context), float(seg.prefill_pairs + tokens * (history + tokens / 2)))
        return after - before

    def _fill_seconds_at_spare(self, spare_tokens: int) -> float:
        """Seconds of filling the spare budget up to cumulative `spare_tokens` (within the passes)."""
        total = self._spare[-1]
        spare_tokens = min(spare_tokens, total)
        if spare_tokens <= 0:
            return 0.0
        i = bisect.bisect_left(self._spare, spare_tokens) - 1
        seg_spare = self._spare[i + 1] - self._spare[i]
        part = (spare_tokens - self._spare[i]) / seg_spare if seg_spare else 0.0
        return self._fill_cost[i] + part * (self._fill_cost[i + 1] - self._fill_cost[i])

    def _cumulative(self, table: list, per_pass: list, pass_index: int) -> float:
        """A cumulative table at `pass_index`, inside a segment by its per-pass share."""
        if pass_index <= self.origin_pass or not self.segments:
            return table[0]
        if pass_index >= self.end_pass:
            return table[-1]
        i = bisect.bisect_right(self._starts, pass_index) - 1
        return table[i] + (pass_index - self.segments[i].start) * per_pass[i]

    def _longest_inside(self, lo: int, hi: int) -> float:
        """The longest of passes [lo, hi) with one more decode (a decoding request's worst gap)."""
        longest = 0.0
        for i, seg in enumerate(self.segments):
            if seg.start < hi and seg.end > lo:
                longest = max(longest, self._seconds[i] + self._decode_per_pass[i])
        return longest

    def _alone(self, request: MicroRequest, first: int, decode_from: int, finish: int,
               end: int) -> tuple[float, float, float]:
        """Its passes past the end, run alone: (seconds, seconds to its first token, longest gap
        between its tokens — decode passes only: its prefill passes come before its first token,
        in its TTFT; counted as a gap, a whole request on an idle worker failed the ITL check for
        any prompt whose prefill pass takes > 100 ms, and DynaServe sent every request of
        P2048/D512 on 32B to the busy worker of the pair, the other 0% busy)."""
        start = max(first, end)
        if finish <= start:
            return 0.0, 0.0, 0.0
        perf = self.perf_model
        seconds = first_token = longest = 0.0
        prefill_passes = max(0, min(decode_from, finish) - start) if request.prefill else 0
        if prefill_passes:
            done_inside = max(0, self._spare[-1] - self._spare_at(first)) if first < end else 0
            left = max(1, request.prefill - done_inside)
            history = request.history + request.prefill - left
            chunk = -(-left // prefill_passes)
            # The middle pass stands for all: each one's history is a chunk longer than the last.
            one = perf.step_time(((history + (prefill_passes - 1) * chunk // 2, chunk),), 0, 0.0)
            seconds = first_token = prefill_passes * one
        decode_passes = finish - max(start, decode_from)
        if decode_passes > 0:
            context = request.context_at_first_decode + max(0, max(start, decode_from) - decode_from)
            one = perf.step_time((), 1, context + decode_passes / 2)
            seconds += decode_passes * one
            if not request.prefill:
                first_token = one
            longest = max(longest, one)
        return seconds, first_token, longest

    # ---- internals: the segments -------------------------------------------------------------
    def _index(self) -> None:
        if not self._dirty:
            return
        # Plain floats, segment by segment: a timeline holds a handful of segments, where
        # numpy's per-call cost was most of a decision (the same arithmetic, bit for bit, as
        # the vectorised form `test_timeline` checks it against).
        budget, step = self.token_budget, self.perf_model.step_seconds
        starts, seconds, spare_per_pass, fill_per_pass, decode_per_pass = [], [], [], [], []
        origin = self.origin
        times, spare_cum, fill_cum, decode_cum = [origin], [0], [0.0], [0.0]
        run_time = run_spare = run_fill = run_decode = 0.0
        for seg in self.segments:
            passes, decodes, prefill = float(seg.passes), float(seg.decodes), float(seg.prefill)
            history, pairs = float(seg.prefill_history), float(seg.prefill_pairs)
            # Summed decode context over the segment's mean pass (each pass reads one token more each).
            context = float(seg.decode_context) + decodes * (passes - 1) / 2
            one = step(prefill, history, decodes, context, pairs)
            spare = max(0.0, budget - decodes - prefill)
            # A probe's chunk filling the spare budget, priced as if it had no history of its own.
            filled = step(prefill + spare, history, decodes, context, pairs + spare * spare / 2) - one
            # One more decode of the pass's mean context (its prefill's length when nothing decodes).
            mean = context / max(decodes, 1.0) if decodes > 0 else prefill
            more = step(prefill, history, decodes + 1, context + mean, pairs) - one
            starts.append(seg.start)
            seconds.append(one)
            spare_per_pass.append(int(spare))
            fill_per_pass.append(filled)
            decode_per_pass.append(more)
            run_time += passes * one
            run_spare += passes * spare
            run_fill += passes * filled
            run_decode += passes * more
            times.append(origin + run_time)
            spare_cum.append(int(run_spare))
            fill_cum.append(run_fill)
            decode_cum.append(run_decode)
        self._starts, self._seconds, self._spare_per_pass = starts, seconds, spare_per_pass
        self._fill_per_pass, self._decode_per_pass = fill_per_pass, decode_per_pass
        self._times, self._spare, self._fill_cost, self._decode_cost = times, spare_cum, fill_cum, decode_cum
        self._dirty = False

    def _extend_to(self, pass_index: int) -> None:
        end = self.end_pass
        if pass_index > end:
            self.segments.append(Segment(end, pass_index - end))
            self._dirty = True

    def _split_at(self, pass_index: int) -> None:
        """Make `pass_index` the start of a segment (if it falls inside one)."""
        i = bisect.bisect_right([s.start for s in self.segments], pass_index) - 1
        if i < 0:
            return
        seg = self.segments[i]
        if seg.start == pass_index or seg.end <= pass_index:
            return
        head = pass_index - seg.start
        self.segments.insert(i + 1, Segment(pass_index, seg.passes - head, seg.decodes, seg.prefill,
                                            seg.prefill_history, seg.prefill_pairs,
                                            seg.decode_context + seg.decodes * head))
        seg.passes = head
        self._dirty = True

    def _segments_in(self, lo: int, hi: int) -> list[Segment]:
        """Segments wholly inside [lo, hi) (after splitting there)."""
        return [s for s in self.segments if s.start >= lo and s.end <= hi]

    def _place_prefill(self, request: MicroRequest, first: int) -> list[tuple[int, int, int, float]]:
        """Put its prefill tokens into the spare budget from pass `first` on, first come first
        served (whole spare of each pass until the last, which takes the rest); the ranges."""
        left = request.prefill
        ranges = []
        self._split_at(first)
        while left > 0:
            seg = next((s for s in self.segments
                        if s.start >= first and self.token_budget - s.decodes - s.prefill > 0), None)
            if seg is None:  # the spare budget ran out: prefill alone past the end
                self._extend_to(self.end_pass + -(-left // self.token_budget))
                continue
            free = self.token_budget - seg.decodes - seg.prefill
            whole_passes = left // free
            if whole_passes >= seg.passes:
                take_passes, per_pass = seg.passes, free
            elif whole_passes > 0:
                self._split_at(seg.start + whole_passes)
                take_passes, per_pass = whole_passes, free
            else:  # the last, partial pass
                self._split_at(seg.start + 1)
                take_passes, per_pass = 1, left
            # Its chunks in these passes sit on histories h0, h0 + n, ...: their mean stands for all.
            history = request.history + request.prefill - left + (take_passes - 1) * per_pass / 2
            self._add_chunk(seg, per_pass, history, +1)
            ranges.append((seg.start, seg.start + take_passes, per_pass, history))
            left -= per_pass * take_passes
            first = seg.start + take_passes
        self._dirty = True
        return ranges

    @staticmethod
    def _add_chunk(seg: Segment, tokens: int, history: float, sign: int) -> None:
        seg.prefill += sign * tokens
        seg.prefill_history += sign * history
        seg.prefill_pairs += sign * tokens * (history + tokens / 2)
        if seg.prefill == 0:  # exactly empty again: no rounding left behind
            seg.prefill_history = seg.prefill_pairs = 0.0

    def _add_decodes(self, request: MicroRequest, decode_from: int, finish: int, sign: int, from_pass: int) -> None:
        """One decode per pass in [from_pass, finish), reading the request's context as it grows."""
        if from_pass >= finish:
            return
        self._split_at(from_pass)
        self._split_at(finish)
        base = request.context_at_first_decode
        for seg in self._segments_in(from_pass, finish):
            seg.decodes += sign
            seg.decode_context += sign * (base + seg.start - decode_from)
        self._dirty = True
