"""LAPS' temporal disaggregation on one instance (§3.1-3.2, Algorithm 1 AWD): short and long
(re-)prefills in separate queues, never in one step; short ones batched to captured shapes
with an adaptive wait, long ones advanced one request at a time by fixed chunks.

Each step:

1. **Decodes first**: every running decode, one token each, oldest first (a colocated
   instance keeps its inter-token latency; on a prefill instance there are none).
2. **Classify** every other queued request by its new tokens L against the boundary
   L_m(H) on its history H (LAPS §2.1: `perf_model.prefill_boundary(H)`, or the fixed
   `boundary_tokens`): short when L < L_m(H). A re-prefill is classified with its history.
   The class is decided when the policy first sees the request and kept (a long prefill's
   last chunk is still long work).
3. **Short mode (AWD)**. With short requests queued, dispatch them now when any of:
   * the queue holds the target depth D (the largest captured batch size the step budget
     allows, adapted below);
   * the smallest slack `deadline - (now + S)` is at most σ (`slack_ms`), S being the
     predicted time of the batch (SLA-first);
   * the head has waited T_max (`head_wait_max_ms`);
   * the round has lasted W = clip(min(W_SLA, W_GR), [W_min, W_max]) where
     W_SLA = min_i(deadline_i - now - S) - δ (`margin_ms`) and
     W_GR = (D - queued) / r̂_s, r̂_s the short arrival rate over the last `rate_window_s`.
   A dispatched batch starts from the most urgent request (earliest deadline, then
   arrival) and takes the requests of its length bucket first, then of the nearest
   buckets, up to D requests and the token budget (bucket-first grouping: least padding).
   Nothing long runs in that step. After it, D follows what the arrivals can fill
   (Alg. 1 lines 10-14): a batch that reached D raises D to the next captured size, one
   dispatched short of it lowers D to the largest captured size it reached. (The paper
   only lowers D; raising it lets D recover when the arrival rate climbs again.)
   **Deadline-free mode** (`deadline_free`): no SLA terms; dispatch when the queued short
   tokens reach M_s (`short_token_target`, default the step budget), D requests are
   queued, or the head waited T_max (token-max).
4. **Long mode**, when no short batch is dispatched: one long request (the one already
   started, else the oldest) advances by C_l (`long_chunk_tokens`; by default the tokens
   the performance model runs in an eighth of the TTFT objective, at least 512: a short
   request arriving mid-chunk loses at most that; the paper fixes C_l) tokens. While short
   requests are being held, the chunk is cut so that its predicted time ends before they
   must go (`perf_model.max_prefill_tokens`), so a long chunk never pushes a short batch
   past its window; when not even one block fits (every step pays the weight read), the
   held shorts go at once instead of the GPU idling. A long head that has not run for
   T_max runs its full chunk before any short batch, held or due, so a stream of short
   requests cannot starve it. With no short request seen for a whole rate window (an instance of the
   long pool in spatial mode), the chunk is the whole step budget instead of C_l: cutting
   it only multiplies the steps (not in the paper, which fixes C_l).
5. **Hold**: while short requests wait on purpose, `hold_until` the earliest instant one of
   the dispatch conditions becomes true, so an idle driver looks again in time.

S: `perf_model.step_time` of the candidate batch; without a model the policy learns it
from executed short steps (`observe`, an EWMA), starting at 0.

Every option may be given as text (CLI flags, environment variables, the simulator's
`batch_policy_options`).
"""

from __future__ import annotations

import math
from collections import deque

from splitserve.core.policies.options import flag_option, number_option, perf_model_option
from splitserve.core.policy import ExecutedBatch, QueuedRequest, StepBuilder
from splitserve.core.sequence import StageKey
from splitserve.core.shapes import ShapeGrid
from splitserve.core.length_class import LengthBoundary
from splitserve.perf.model import PerfModel

__all__ = ["LapsPolicy"]

_MIN_RATE = 1e-3  # ε of W_GR: arrivals per second below which the graph window is "forever"
_DEFAULT_LONG_CHUNK = 512  # C_l without a model or an objective
_MIN_LONG_CHUNK = 16  # one KV block: a shorter long chunk pays a whole step's fixed cost for nothing


class LapsPolicy:
    """Short and long (re-)prefills apart in time on one instance (LAPS AWD + long chunks)."""

    name = "laps"
    observes_steps = True  # learns the short-batch time when it has no perf model
    steady_decodes = True  # decodes only, nothing queued: every running request, one token

    def __init__(self, perf_model: PerfModel | dict | str | None = None,
                 boundary_tokens: int | str | None = None, long_chunk_tokens: int | str | None = None,
                 wait_min_ms: float | str = 0.0, wait_max_ms: float | str = 20.0,
                 slack_ms: float | str = 5.0, margin_ms: float | str = 2.0,
                 head_wait_max_ms: float | str = 50.0, ttft_slo_ms: float | str | None = None,
                 deadline_free: bool | str = False, short_token_target: int | str | None = None,
                 shape_tokens: str | tuple[int, ...] = (8, 16, 32, 64, 128, 256),
                 shape_batches: str | tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                 rate_window_s: float | str = 10.0, learning_rate: float | str = 0.2):
        self.perf_model: PerfModel | None = perf_model_option(perf_model)
        self.length_boundary = LengthBoundary(self.perf_model, number_option(
            "boundary_tokens", boundary_tokens, minimum=1, integer=True, allow_none=True))
        self.boundary_tokens: int | None = self.length_boundary.fixed_tokens
        # None: C_l from the TTFT objective (see `_chunk_limit`), else 512.
        self.long_chunk_tokens: int | None = number_option("long_chunk_tokens", long_chunk_tokens, minimum=1,
                                                           integer=True, allow_none=True)
        self.wait_min_s = number_option("wait_min_ms", wait_min_ms, minimum=0.0) / 1000
        self.wait_max_s = number_option("wait_max_ms", wait_max_ms, minimum=0.0) / 1000
        if self.wait_max_s < self.wait_min_s:
            raise ValueError(f"wait_max_ms must be >= wait_min_ms, got {wait_max_ms} < {wait_min_ms}")
        self.slack_s = number_option("slack_ms", slack_ms, minimum=0.0) / 1000
        self.margin_s = number_option("margin_ms", margin_ms, minimum=0.0) / 1000
        self.head_wait_max_s = number_option("head_wait_max_ms", head_wait_max_ms, minimum=0.0) / 1000
        ttft = number_option("ttft_slo_ms", ttft_slo_ms, minimum=0.0, allow_none=True)
        self.default_ttft_slo_s: float | None = ttft / 1000 if ttft else None
        self.deadline_free = flag_option("deadline_free", deadline_free)
        self.short_token_target: int | None = number_option("short_token_target", short_token_target, minimum=1,
                                                            integer=True, allow_none=True)
        self.shapes = ShapeGrid(shape_tokens, shape_batches)  # type: ignore[arg-type]  (parsed there)
        self.rate_window_s = number_option("rate_window_s", rate_window_s, minimum=1e-3)
        self.learning_rate = number_option("learning_rate", learning_rate, minimum=1e-6, maximum=1.0)
        # Adaptive state (Alg. 1): the target depth, the current batching round, the arrivals.
        self.target_depth = self.shapes.batches[-1]
        self.round_start: float | None = None
        self.short_arrivals: deque[float] = deque()
        self._seen_short: set[StageKey] = set()
        self.short_step_s = 0.0  # learned S when there is no perf model
        self._last_kind = ""  # what the last step ran: "short", "long" or "" (for observe)
        self._short_class: dict[StageKey, bool] = {}  # each queued request's class, decided once
        self._long_served: tuple[StageKey, float] | None = None  # the long head last run, and when
        self.num_short_batches = self.num_long_chunks = 0
        self._chunk_cache: dict[tuple[float, int], int] = {}  # (TTFT/8, history in 1 Ki) -> C_l

    # ---- classification -------------------------------------------------------------
    def boundary(self, history: int) -> float:
        """L_m(H): new tokens from which a (re-)prefill on `history` cached tokens is compute-bound."""
        return self.length_boundary.tokens(history)

    def is_short(self, req: QueuedRequest) -> bool:
        """Short when its new tokens L are below L_m(H), decided when the policy first sees it
        and kept: a long prefill does not turn short as its chunks run."""
        short = self._short_class.get(req.key)
        if short is None:
            short = self._short_class[req.key] = req.num_remaining_tokens < self.boundary(req.num_computed_tokens)
        return short

    # ---- the step ---------------------------------------------------------------------
    def next_batch(self, step: StepBuilder, now: float) -> None:
        if self._last_kind == "long" and self._long_served is not None:
            # T_max bounds how long the long head *waits*: it was served until its chunk
            # ended, i.e. until now. Counted from the chunk's start instead, a chunk as long as
            # T_max (C_l is sized to TTFT/8 = T_max at a 400 ms SLO) left the head "starved"
            # at every step and the shorts ran only when it could not (measured: 32B temporal,
            # short p90 39 s).
            self._long_served = (self._long_served[0], now)
        self._last_kind = ""
        long_running: list[QueuedRequest] = []
        for req in step.running:  # decodes first; started short prefills finish
            if req.is_decode:
                if step.tokens_left:
                    step.add(req.key, 1)
            elif self.is_short(req):
                if step.tokens_left:
                    step.add(req.key, min(req.num_remaining_tokens, step.tokens_left))
            else:
                long_running.append(req)
        started = bool(long_running)  # a long request already has KV here: it goes first
        shorts: list[QueuedRequest] = []
        longs = long_running
        for req in step.waiting:
            (shorts if self.is_short(req) else longs).append(req)
        queued = {r.key for r in step.running} | {r.key for r in step.waiting}
        if len(self._short_class) > len(queued):  # requests that left the queues drop out
            self._short_class = {k: v for k, v in self._short_class.items() if k in queued}
        self._note_arrivals(shorts, now)
        go_by: float | None = None  # when the held short requests must go (None: none held)
        if not shorts:
            self.round_start = None
        elif self._long_starved(longs, now):
            # T_max before any short batch: with a batch due every step the shorts would
            # otherwise take every step and the long head would never run again.
            if self._run_long(step, longs[0], self._long_chunk(step, longs, None, now) or 0,
                              started=started, now=now):
                return
            self._dispatch_shorts(step, shorts, now, force=True)  # the long one cannot run now
            return
        else:
            go_by = self._dispatch_shorts(step, shorts, now)
            if go_by is None:
                return
        chunk = self._long_chunk(step, longs, go_by, now)
        if chunk is None:  # no long chunk worth running before the held shorts must go: they go now
            self._dispatch_shorts(step, shorts, now, force=True)
        elif chunk:
            self._run_long(step, longs[0], chunk, started=started, now=now)

    def _dispatch_shorts(self, step: StepBuilder, shorts: list[QueuedRequest], now: float,
                         force: bool = False) -> float | None:
        """Alg. 1: dispatch a short batch now (None), or hold it: the instant it must go by."""
        if self.round_start is None:
            self.round_start = now
        depth = self._feasible_depth(step, shorts)
        go_by = self._dispatch_time(shorts, depth, now)
        if step.preempted_any or step.seqs_left == 0 or step.tokens_left == 0:
            return go_by
        if go_by > now and not force:
            step.hold_until(go_by)
            return go_by
        batch = self._pick_batch(shorts, depth)
        added = 0
        for req in batch:
            if step.tokens_left < req.num_remaining_tokens or step.seqs_left == 0:
                continue
            if not step.add(req.key, req.num_remaining_tokens):
                break  # no KV memory: the rest wait for the next round
            added += 1
        if not added:
            return go_by
        self.num_short_batches += 1
        self._last_kind = "short"
        # Alg. 1 lines 10-14: D follows what the arrivals fill (raised again when they do).
        self.target_depth = self.shapes.next_depth(added) if added >= self.target_depth \
            else self.shapes.depth_at_most(added)
        self.round_start = None
        return None

    def _dispatch_time(self, shorts: list[QueuedRequest], depth: int, now: float) -> float:
        """The instant the queued short requests must go (<= now: at once)."""
        head_arrival = min(r.arrival_time for r in shorts)
        go_by = head_arrival + self.head_wait_max_s  # T_max
        if self.deadline_free:
            target = self.short_token_target or math.inf
            if len(shorts) >= depth or sum(r.num_remaining_tokens for r in shorts) >= target:
                return now
            rate = max(self._short_rate(now), _MIN_RATE)
            return min(go_by, now + max(0, depth - len(shorts)) / rate)
        if len(shorts) >= depth:
            return now
        service = self._short_batch_s(shorts[:depth])
        deadlines = [d for d in map(self._deadline, shorts) if d is not None]
        slack = min(deadlines) - now - service if deadlines else math.inf
        if slack <= self.slack_s:
            return now
        w_sla = max(0.0, slack - self.margin_s)
        w_gr = max(0, depth - len(shorts)) / max(self._short_rate(now), _MIN_RATE)
        window = min(max(min(w_sla, w_gr), self.wait_min_s), self.wait_max_s)
        assert self.round_start is not None
        go_by = min(go_by, self.round_start + window)
        if deadlines:  # ... and before the slack falls to σ
            go_by = min(go_by, min(deadlines) - service - self.slack_s)
        return go_by

    def _feasible_depth(self, step: StepBuilder, shorts: list[QueuedRequest]) -> int:
        """D bounded by the step: at most the requests it may admit, at most the budget's
        worth of the shortest bucket among them."""
        smallest = min(r.num_remaining_tokens for r in shorts)
        bucket = self.shapes.token_bucket(smallest) or smallest
        fits = max(1, step.tokens_left // max(1, bucket))
        return self.shapes.depth_at_most(min(self.target_depth, step.seqs_left, fits))

    def _pick_batch(self, shorts: list[QueuedRequest], depth: int) -> list[QueuedRequest]:
        """Bucket-first: the most urgent request's length bucket, then the nearest buckets."""
        def urgency(r: QueuedRequest) -> tuple[float, float]:
            deadline = self._deadline(r)
            return (deadline if deadline is not None else math.inf, r.arrival_time)

        head = min(shorts, key=urgency)
        longest = self.shapes.tokens[-1]

        def bucket(r: QueuedRequest) -> int:
            return self.shapes.token_bucket(r.num_remaining_tokens) or longest + r.num_remaining_tokens

        home = bucket(head)
        ranked = sorted(shorts, key=lambda r: (r is not head, abs(bucket(r) - home), urgency(r)))
        return ranked[:depth]

    def _long_chunk(self, step: StepBuilder, longs: list[QueuedRequest], go_by: float | None,
                    now: float) -> int | None:
        """Tokens for the long head this step: C_l, cut so that it ends before held short
        requests must go; None when not even one block would (the shorts should go first);
        the full C_l when the long head has waited T_max since it last ran (no starvation)."""
        if not longs or step.tokens_left == 0:
            return 0
        req = longs[0]
        # No short request seen for a whole rate window (an instance of the long pool): C_l
        # would only cut the long prefill into more steps, each paying the weight read again.
        limit = self._chunk_limit(req) if self.short_arrivals else step.tokens_left
        chunk = min(req.num_remaining_tokens, limit, step.tokens_left)
        if go_by is None or self.perf_model is None or self.deadline_free or self._long_starved(longs, now):
            return chunk
        fits = self.perf_model.max_prefill_tokens(go_by - now, prefill_ctx=req.num_computed_tokens, limit=chunk)
        if fits < min(chunk, _MIN_LONG_CHUNK):
            return None
        return min(chunk, fits)

    def _long_starved(self, longs: list[QueuedRequest], now: float) -> bool:
        """The long head has not run for T_max (`head_wait_max_ms`) since it last ran or arrived."""
        if not longs:
            return False
        req = longs[0]
        served = self._long_served[1] if self._long_served and self._long_served[0] == req.key else req.arrival_time
        return now - served >= self.head_wait_max_s

    def _chunk_limit(self, req: QueuedRequest) -> int:
        """C_l: `long_chunk_tokens` when given; else the tokens whose predicted time is an
        eighth of the TTFT objective (a short request arriving mid-chunk loses at most
        that), at least 512; 512 without a model or an objective."""
        if self.long_chunk_tokens is not None:
            return self.long_chunk_tokens
        deadline = req.deadline(self.default_ttft_slo_s)
        if self.perf_model is None or deadline is None:
            return _DEFAULT_LONG_CHUNK
        budget = (deadline - req.arrival_time) / 8
        key = (round(budget, 4), req.num_computed_tokens >> 10)
        cached = self._chunk_cache.get(key)
        if cached is None:
            if len(self._chunk_cache) > 1024:
                self._chunk_cache.clear()
            fits = self.perf_model.max_prefill_tokens(budget, prefill_ctx=req.num_computed_tokens, limit=1 << 16)
            cached = self._chunk_cache[key] = max(_DEFAULT_LONG_CHUNK, fits)
        return cached

    def _run_long(self, step: StepBuilder, req: QueuedRequest, chunk: int, started: bool, now: float) -> bool:
        """One long request by one chunk (the started one first, else the oldest waiting);
        False when it could not be added this step."""
        if chunk <= 0 or (not started and (step.preempted_any or step.seqs_left == 0)):
            return False
        if not step.add(req.key, chunk):
            return False
        self.num_long_chunks += 1
        self._last_kind = "long"
        self._long_served = (req.key, now)
        return True

    # ---- estimates --------------------------------------------------------------------
    def _note_arrivals(self, shorts: list[QueuedRequest], now: float) -> None:
        """r̂_s: short requests first seen queued within the last `rate_window_s`."""
        queued = {r.key for r in shorts}
        for r in shorts:
            if r.key not in self._seen_short:
                self.short_arrivals.append(r.arrival_time)
        self._seen_short = queued  # keys leave with the queue: the set stays small
        horizon = now - self.rate_window_s
        while self.short_arrivals and self.short_arrivals[0] < horizon:
            self.short_arrivals.popleft()

    def _short_rate(self, now: float) -> float:
        if not self.short_arrivals:
            return 0.0
        span = max(now - self.short_arrivals[0], self.rate_window_s / 10)
        return len(self.short_arrivals) / span

    def _short_batch_s(self, batch: list[QueuedRequest]) -> float:
        if self.perf_model is not None:
            return self.perf_model.step_time([(r.num_computed_tokens, r.num_remaining_tokens) for r in batch])
        return self.short_step_s

    def _deadline(self, req: QueuedRequest) -> float | None:
        return req.deadline(self.default_ttft_slo_s)

    def observe(self, executed: ExecutedBatch) -> None:
        shape = executed.shape
        self.length_boundary.observe_step(shape.prefill_chunks, shape.num_decodes, executed.latency_s)
        if self.perf_model is not None or self._last_kind != "short" or executed.latency_s <= 0:
            return
        if self.short_step_s == 0.0:
            self.short_step_s = executed.latency_s
        else:
            self.short_step_s += self.learning_rate * (executed.latency_s - self.short_step_s)
