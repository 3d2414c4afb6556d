"""DynaServe's global scheduler: split each request where its worker pair is balanced.

Paper: DynaServe §4.1, Algorithm 1 (`../shared/papers/dynaserve.txt`). A request of
prompt P and predicted output D (L = P + D) is cut at s = ⌈φL⌉ into α = [0, s) on one
worker and β = [s, L) on another; φ = P / (P + D) is plain prefill/decode disaggregation,
φ = 1 runs it all on α's worker, φ = 0 all on β's. Neither worker should idle while the
other is saturated, so φ is chosen by a bounded binary search (at most `max_probes`
probes) for predicted drain times T1 ≈ T2 (|T1 − T2| within `tolerance`), each probe
asking the pair's timelines (`services.global_scheduler.timeline`: the execution
predictor) what the worker would do with its queued micro-requests plus this one.

Differences from the paper, and why:

* the pair: the `candidate_workers` workers that drain soonest, every pair of them,
  oriented so that α runs on the lower-ranked worker (KV may only be pushed up the
  worker order, which keeps reservations deadlock-free; see `orient_kv_transfers`);
  among pairs, the one whose best probe meets the request's TTFT/ITL objectives, then the
  smallest makespan max(T1, T2) (the paper picks by "balance and SLO");
* the probes keep the best split seen (by makespan), not only the last, and φ = 0 or 1
  (no split) is a legal answer: both are evaluated beside the search for every pair
  (with `always_split=true`, only where the split would overflow a worker's KV: the paper's
  search alone, for ablations of the whole options and to exercise splits whatever the load);
* the search never cuts before P − 1 (see `_evaluate`): beta's worker cannot start the rest
  of a prompt before alpha's KV is in, and alpha's and beta's work add up to the whole
  request's, so such a cut finishes no earlier than the request whole on alpha (one
  hand-off later, beta idle until alpha is done) and holds no less KV on beta than the
  request whole on beta. The paper's search over all of [0, 1] balanced T1 = T2 without the
  wait: alpha got the backlog gap plus half of every request and beta's worker idled before
  each suffix (P8192/D32 on 14B: 98% of requests cut inside the prompt, busy ~100% / ~90%
  while requests arrived, 0.87× colocation; searched from P − 1 on, 1.00×);
* cold start (both workers idle) starts from the disaggregated split, as the paper's
  ColdStart does, without a search (the whole options below may still win);
* where the cut lands: a cut inside the output puts the hand-off (the second worker ending
  its current step, then running one with this request) between two output tokens, and a
  request with fewer than ~100 output gaps has that gap as its p99 TBT. Requests predicted
  to produce fewer than `min_output_split_tokens` (128) are cut just inside the prompt
  instead (s = P − 1: the wait counts in the TTFT, which has room). In the simulator (A100 ×
  Qwen2.5-14B, Azure code, 4 req/s) 11 of 27 cuts in the output gave gaps of 101–179 ms,
  every DynaServe miss there; with the rule, none;
* KV memory: the timelines and compute clocks see compute only, so the pair's second worker
  (which holds the whole sequence by the end) could be given more decodes than its KV holds
  — recomputes and preemptions there, the first worker idling (P2048/D512 at 5.3 req/s: 161
  recomputes, 267 preemptions, alpha 56% busy). `KvFootprints` keeps each worker's committed
  tokens (a last stage until its completion is reported, a first stage until its predicted
  end); a split that overflows a worker falls back to no split on either worker, and an
  option that fits wins over one that does not;
* whole requests favoured by their decode share: the whole options' makespans are divided by
  1 + s, s = `whole_bias` (1.0) × D / (P + D), so a split wins only when its makespan is lower
  by more than s / (1 + s) (P219/D1467: 47%; P2048/D512: 17%; a long prompt with a short
  output: ~0; both whole options are evaluated for every pair, two more probes, so a
  decision makes at most `max_probes` + 2 per pair). The paper's objective (balance) makes
  every request a split; for decode-heavy requests the split buys nothing the stream of
  whole requests does not, and costs KV and a hand-off (P219/D1467 at 4.8 req/s: 112
  recomputes, 364 preemptions, 94% attainment; with the bias none, 100%);
* the timelines are corrected by what the workers report: an idle worker resets its
  timeline, and a finished request (ReportCompletion) is taken out of both.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from services.global_scheduler.baselines import colocated_candidates
from services.global_scheduler.compute_clock import ComputeClock
from services.global_scheduler.length_predictor import OutputLengthPredictor, observe_completion, predicted_output_len
from services.global_scheduler.policy import (ClusterView, CompletionReport, Placement, PlacementRequest,
                                              StagePlacement, WorkerView, worker_rank)
from services.global_scheduler.timeline import MicroRequest, Prediction, WorkerTimeline
from splitserve.core.policies.options import flag_option
from splitserve.perf.model import PerfModel

DEFAULT_PERF_MODEL = "H100/llama-3-8b"
LOST_REPORT_GRACE_S = 60.0  # a last stage's KV footprint outlives its predicted end by this at least


@dataclass(frozen=True)
class SplitOption:
    """One probe's answer: the split point and what the pair's timelines predict for it."""

    phi: float
    split: int  # s: alpha runs [0, s), beta [s, L); 0: all on beta, L_total: all on alpha
    t_alpha: float  # T1: alpha's worker's committed compute with this split (seconds of work)
    t_beta: float  # T2: beta's
    drain_alpha: float  # when alpha's worker would run dry (scheduler clock; reported, not balanced)
    drain_beta: float
    first_token: float  # when the request's first token is predicted
    longest_gap_s: float  # its worst predicted gap between tokens (the stage hand-off included)
    alpha_request: MicroRequest | None
    beta_request: MicroRequest | None
    beta_not_before: float | None

    @property
    def makespan(self) -> float:
        """The busier worker's committed compute: what the split minimises."""
        return max(self.t_alpha, self.t_beta)


class DynaServePolicy:
    """`dynaserve` placement: per-request split point from the predicted load of a worker pair."""

    name = "dynaserve"
    uses_perf_model = True  # make_policy hands it the deployment's model when none is named

    def __init__(self, perf_model: PerfModel | str | None = None, token_budget: int | str = 2048,
                 max_probes: int | str = 6, tolerance: float | str = 0.02, candidate_workers: int | str = 2,
                 kv_chunk_tokens: int | str = 64, output_len_prior: int | str = 128, output_len_margin: int | str = 20,
                 output_len_quantile: float | str = 0.75, min_output_split_tokens: int | str = 128,
                 whole_bias: float | str = 1.0, always_split: bool | str = False, prompt_cuts: bool | str = False):
        if perf_model is None or isinstance(perf_model, str):
            from splitserve.perf.store import resolve_perf_model  # names: presets, JSON files, redis:ID

            perf_model = resolve_perf_model(perf_model or DEFAULT_PERF_MODEL)
        self.perf_model = perf_model
        self.token_budget = _positive_int(token_budget, "token_budget")
        self.max_probes = _positive_int(max_probes, "max_probes")
        self.tolerance = float(tolerance)
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
        self.candidate_workers = max(2, _positive_int(candidate_workers, "candidate_workers"))
        self.kv_chunk_tokens = _positive_int(kv_chunk_tokens, "kv_chunk_tokens")
        # Cuts inside the output only for requests predicted to produce at least this many
        # tokens (see `_evaluate`); 1: anywhere, as the paper's φ.
        self.min_output_split_tokens = _positive_int(min_output_split_tokens, "min_output_split_tokens")
        self.whole_bias = float(whole_bias)
        if self.whole_bias < 0:
            raise ValueError(f"whole_bias must be >= 0, got {whole_bias!r}")
        # Every request with two eligible workers split where the search lands (φ strictly inside
        # (0, 1)), unless that split would overflow a worker's KV: no whole options but that fallback.
        self.always_split = flag_option("always_split", always_split)
        # The paper's Alg. 1 search: all of [0, 1], cuts inside the prompt included, balancing
        # T2 = load + work(beta) without beta's wait for alpha's KV (which, counted, makes such
        # a cut never win: see `_evaluate`). The experiment of whether they pay in the simulator
        # on a given timing model (benchmarks/dynaserve_prompt_cuts.py).
        self.prompt_cuts = flag_option("prompt_cuts", prompt_cuts)
        # D when the client gives no hint: learned from finished requests (paper: a length
        # predictor plus a 20-token margin).
        self.length_predictor = OutputLengthPredictor(prior=_positive_int(output_len_prior, "output_len_prior"),
                                                      margin=int(output_len_margin),
                                                      quantile=float(output_len_quantile))
        self.timelines: dict[str, WorkerTimeline] = {}
        self.clocks: dict[str, ComputeClock] = {}  # Alg. 1's per-worker execution clocks
        self.footprints: dict[str, KvFootprints] = {}  # KV each worker's placed work will hold
        self.kv_capacity: dict[str, int] = {}  # tokens of KV each worker has (its load's blocks)
        self._placed: dict[str, list[tuple[str, str]]] = {}  # request id -> (worker id, micro-request key)
        self._last_placed: dict[str, float] = {}  # worker id -> when it was last given work

    # ---- the policy ------------------------------------------------------------------------
    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        candidates = colocated_candidates(view)  # NoWorkerAvailable when none is eligible
        self._sync(view, candidates, now)
        output_len = self.predicted_output_len(request)
        if len(candidates) == 1 or request.total_len < 2:
            self.timelines[candidates[0].worker_id].advance(now)
            return self._commit_single(candidates[0], request, output_len, now, "one eligible worker: colocated")
        loads = {w.worker_id: self.clocks[w.worker_id].backlog(now) for w in candidates}
        ranked = sorted(candidates, key=lambda w: (loads[w.worker_id], w.worker_id))
        pool = ranked[: self.candidate_workers]
        for w in pool:  # only the timelines probed need to be brought to now (the rest: when they are)
            self.timelines[w.worker_id].advance(now)
        best: tuple[tuple, SplitOption, WorkerView, WorkerView, int] | None = None
        # A decode-heavy request gains little from a split (the stream of requests balances the
        # pair as well whole), while a split costs the decode side the whole sequence's KV for its
        # lifetime and a hand-off: the whole options' makespans count 1 / (1 + slack), slack =
        # `whole_bias` x its decode share. A long prompt with a short output (share ~0) gets
        # no bias: it is cut where its prefill ends when that balances the pair better.
        slack = self.whole_bias * output_len / (request.prompt_len + output_len)
        for i, first in enumerate(pool):
            for second in pool[i + 1:]:
                alpha, beta = sorted((first, second), key=worker_rank)  # KV flows up the order only
                option, probes = self._search(request, output_len, alpha, beta, loads, now)
                # No split, on either worker, is always a candidate: the whole options the bias
                # favours, the fallback when the balanced split does not fit a worker's KV (it
                # would recompute or preempt there), and the answer when one worker is the
                # bottleneck even with the prompt alone on it (the search stops there).
                options = [option]
                a, b = self.timelines[alpha.worker_id], self.timelines[beta.worker_id]
                la, lb = loads[alpha.worker_id], loads[beta.worker_id]
                for edge in (1.0, 0.0):
                    if edge != option.phi:  # an edge the search chose is not evaluated again
                        options.append(self._evaluate(request, output_len, edge, a, b, la, lb, now))
                        probes += 1
                for option in options:
                    whole = option.split <= 0 or option.split >= request.total_len
                    key = (self._overflows(option, alpha, beta, now), whole and self.always_split,
                           not self._meets_slo(request, option, now),
                           option.makespan / (1 + slack) if whole else option.makespan)
                    if best is None or key < best[0]:
                        best = (key, option, alpha, beta, probes)
        _, option, alpha, beta, probes = best
        return self._commit(request, output_len, option, alpha, beta, probes, now)

    def on_completion(self, report: CompletionReport) -> None:
        """A request ended: its micro-requests leave the timelines; the length model learns."""
        for worker_id, key in self._placed.pop(report.request_id, ()):
            timeline = self.timelines.get(worker_id)
            if timeline is not None:
                timeline.remove(key)
            clock = self.clocks.get(worker_id)
            if clock is not None:
                clock.remove(key)
            footprint = self.footprints.get(worker_id)
            if footprint is not None:
                footprint.remove(key)
        observe_completion(self.length_predictor, report)

    def predicted_output_len(self, request: PlacementRequest) -> int:
        """D: the client's hint, else the length model (with its margin), within [1, max_tokens]."""
        return predicted_output_len(request, self.length_predictor)

    # ---- Algorithm 1 -------------------------------------------------------------------------
    def _search(self, request: PlacementRequest, output_len: int, alpha: WorkerView, beta: WorkerView,
                loads: dict[str, float], now: float) -> tuple[SplitOption, int]:
        """The bounded binary search over phi for this pair: (best option, probes made)."""
        P, L = request.prompt_len, request.prompt_len + output_len
        phi = P / L  # start from prefill/decode disaggregation
        a, b = self.timelines[alpha.worker_id], self.timelines[beta.worker_id]
        load_a, load_b = loads[alpha.worker_id], loads[beta.worker_id]
        if a.drain_time <= now and b.drain_time <= now:  # cold start: both idle
            return self._evaluate(request, output_len, phi, a, b, load_a, load_b, now), 1
        # Only cuts from the prompt's end on (module docstring): phi never goes below P / L,
        # unless `prompt_cuts` asks for the paper's whole range.
        lo, hi = (0.0 if self.prompt_cuts else phi), 1.0
        best: SplitOption | None = None
        probes = 0
        for _ in range(self.max_probes):
            option = self._evaluate(request, output_len, phi, a, b, load_a, load_b, now)
            probes += 1
            if best is None or option.makespan < best.makespan:
                best = option
            horizon = max(option.makespan, 1e-3)
            if abs(option.t_alpha - option.t_beta) <= self.tolerance * horizon:
                break  # balanced
            if option.split == P - 1:
                break  # a short output: every cut from here on is moved to P - 1 (see `_evaluate`)
            if option.t_alpha > option.t_beta:
                if phi <= lo:
                    break  # alpha's worker is the bottleneck with the prompt alone: no earlier cut pays
                hi = phi  # give alpha less
            else:
                lo = phi
            phi = (lo + hi) / 2
            if hi - lo < 1.0 / (2 * L):
                break  # one token's resolution
        return best, probes

    def _evaluate(self, request: PlacementRequest, output_len: int, phi: float, a: WorkerTimeline,
                  b: WorkerTimeline, load_a: float, load_b: float, now: float) -> SplitOption:
        """Both workers' committed compute (T1, T2) if the request is cut at s = ceil(phi * L)
        (moved to P - 1 for a short output: see below; the option's phi is then s / L),
        and from the timelines when its first token comes and its longest gap (the SLO check)."""
        P, D = request.prompt_len, output_len
        L, total = P + D, request.total_len
        split = math.ceil(phi * L)
        if P >= 2 and 0 < split - P + 1 < D < self.min_output_split_tokens:
            # A cut inside the output puts the hand-off (beta's worker ending its current step,
            # then running one with this request: up to two ITL-sized steps) between two output
            # tokens; a request with fewer than ~100 gaps has that gap as its p99 TBT (in the
            # simulator every DynaServe miss on the Azure traces was that gap). Cut just inside
            # the prompt instead: alpha samples nothing, and the wait counts in the TTFT (beta
            # takes the stage with its decodes: slo_aware's hand-offs).
            split = P - 1
            phi = split / L
        if split <= 0:  # all on beta
            micro = MicroRequest(f"{request.request_id}/0", P, 0, D)
            p = b.predict(micro)
            return SplitOption(0.0, 0, load_a, load_b + self._work(micro), a.drain_time, p.drain_time,
                               p.first_token_time, p.longest_pass_s, None, micro, None)
        alpha_samples = max(0, split - P + 1)
        if split >= L or alpha_samples >= D:  # all on alpha (beta would sample nothing)
            micro = MicroRequest(f"{request.request_id}/0", P, 0, D)
            p = a.predict(micro)
            return SplitOption(1.0, total, load_a + self._work(micro), load_b, p.drain_time, b.drain_time,
                               p.first_token_time, p.longest_pass_s, micro, None, None)
        alpha = MicroRequest(f"{request.request_id}/0", min(split, P), 0, alpha_samples)
        beta = MicroRequest(f"{request.request_id}/1", max(0, P - split), split, D - alpha_samples)
        pa = a.predict(alpha)
        # Chunked push hides all but the last chunk's transfer behind alpha's compute (§4.3).
        handoff = self.perf_model.kv_transfer_time(min(split, self.kv_chunk_tokens))
        not_before = pa.finish_time + handoff
        pb = b.predict(beta, not_before=not_before)
        first_token = pa.first_token_time if alpha_samples else pb.first_token_time
        gap = max(pa.longest_pass_s, pb.longest_pass_s)
        if alpha_samples:  # the hand-off between alpha's last token and beta's first is a gap too
            gap = max(gap, pb.first_token_time - pa.finish_time)
        t_alpha = load_a + self._work(alpha)
        beta_start = load_b
        if beta.prefill > 1 and not self.prompt_cuts:
            # A cut inside the prompt leaves beta prefill it cannot start before alpha's KV is in
            # (alpha's committed compute, this part included, done, plus the hand-off): if beta's
            # own backlog ends earlier, its compute idles until then, which backlog + work does
            # not see. With the wait such a cut never finishes before the request whole on alpha
            # (work(alpha) + work(beta) is the whole request's), which is why `_search` does not
            # go there. A cut at P - 1 or in the output leaves beta one token or decodes:
            # memory-bound work that runs beside its other work, no idle compute worth counting.
            beta_start = max(load_b, t_alpha + handoff)
        return SplitOption(phi, split, t_alpha, beta_start + self._work(beta), pa.drain_time,
                           pb.drain_time, first_token, gap, alpha, beta, not_before)

    def _work(self, micro: MicroRequest) -> float:
        return self.perf_model.work_seconds(micro.prefill, micro.history, micro.decode)

    def _meets_slo(self, request: PlacementRequest, option: SplitOption, now: float) -> bool:
        if request.slo_ttft_ms and (option.first_token - now) * 1000 > request.slo_ttft_ms:
            return False
        if request.slo_itl_ms and option.longest_gap_s * 1000 > request.slo_itl_ms:
            return False
        return True

    def _overflows(self, option: SplitOption, alpha: WorkerView, beta: WorkerView, now: float) -> bool:
        """Whether a worker of the option would hold more KV than it has: its commitments plus
        this request's part there (beta holds the whole sequence by its end)."""
        for worker, micro in ((alpha, option.alpha_request), (beta, option.beta_request)):
            if micro is None:
                continue
            capacity = self.kv_capacity.get(worker.worker_id, 0)
            if capacity and self.footprints[worker.worker_id].held(now) + micro.kv_tokens > capacity:
                return True
        return False

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _sync(self, view: ClusterView, candidates: tuple[WorkerView, ...], now: float) -> None:
        """Timelines for the candidates (advanced to `now` when probed: cutting 64 timelines'
        prefixes per decision was a third of the decision time); a worker that reported itself
        idle after its last placement is idle; workers gone from the view are forgotten."""
        for w in candidates:
            timeline = self.timelines.get(w.worker_id)
            if timeline is None:
                timeline = self.timelines[w.worker_id] = WorkerTimeline(self.perf_model, self.token_budget, now)
            clock = self.clocks.setdefault(w.worker_id, ComputeClock())
            footprint = self.footprints.setdefault(w.worker_id, KvFootprints())
            load = w.load
            self.kv_capacity[w.worker_id] = load.total_blocks * load.block_size
            idle = load.running == 0 and load.waiting == 0 and w.inflight_assigned == 0
            if idle and view.taken_at > self._last_placed.get(w.worker_id, float("-inf")):
                timeline.reset(now)
                clock.reset()
                if load.free_blocks >= load.total_blocks:  # else a reservation awaits a push
                    footprint.reset()
        known = {w.worker_id for w in view.workers}
        for worker_id in [w for w in self.timelines if w not in known]:
            del self.timelines[worker_id]
            self.clocks.pop(worker_id, None)
            self.footprints.pop(worker_id, None)
            self.kv_capacity.pop(worker_id, None)

    def _commit(self, request: PlacementRequest, output_len: int, option: SplitOption, alpha: WorkerView,
                beta: WorkerView, probes: int, now: float) -> Placement:
        decision = {"phi": option.phi, "split_point": float(option.split), "probes": float(probes),
                    "predicted_output_len": float(output_len), "t1_s": option.t_alpha, "t2_s": option.t_beta,
                    "drain1_s": option.drain_alpha - now, "drain2_s": option.drain_beta - now,
                    "predicted_ttft_s": option.first_token - now}
        total = request.total_len
        if option.split <= 0 or option.split >= total:
            worker = beta if option.split <= 0 else alpha
            micro = option.beta_request if option.split <= 0 else option.alpha_request
            self._record(request.request_id, worker, micro, None, now)
            return Placement((StagePlacement(worker.worker_id, worker.address, 0, total),), self.name,
                             f"phi={option.phi:.3f}: all on {worker.worker_id} (T1={option.t_alpha:.3f}s, "
                             f"T2={option.t_beta:.3f}s of compute, {probes} probes)", decision)
        self._record(request.request_id, alpha, option.alpha_request, None, now, last_stage=False)
        self._record(request.request_id, beta, option.beta_request, option.beta_not_before, now)
        stages = (StagePlacement(alpha.worker_id, alpha.address, 0, option.split),
                  StagePlacement(beta.worker_id, beta.address, option.split, total))
        return Placement(stages, self.name,
                         f"phi={option.phi:.3f}: split at {option.split} of {total} on {alpha.worker_id} -> "
                         f"{beta.worker_id} (T1={option.t_alpha:.3f}s, T2={option.t_beta:.3f}s of compute, "
                         f"{probes} probes)", decision)

    def _commit_single(self, worker: WorkerView, request: PlacementRequest, output_len: int, now: float,
                       reason: str) -> Placement:
        micro = MicroRequest(f"{request.request_id}/0", request.prompt_len, 0, max(1, output_len))
        self._record(request.request_id, worker, micro, None, now)
        return Placement.single_stage(worker, request, self.name, reason)

    def _record(self, request_id: str, worker: WorkerView, micro: MicroRequest, not_before: float | None,
                now: float, last_stage: bool = True) -> Prediction:
        timeline = self.timelines[worker.worker_id]
        prediction = timeline.commit(micro, not_before)
        self.clocks[worker.worker_id].add(micro.key, self._work(micro), timeline.time_of_pass(prediction.first_pass),
                                          prediction.finish_time)
        # The request's last stage holds its KV until the request ends (reported): its predicted
        # end is optimistic under load, so it is kept for twice as long plus a minute, after
        # which a lost report (a coordinator that died) stops counting. A first stage until it
        # has pushed its KV, which nothing reports: its predicted end.
        ends_at = now + 2 * max(0.0, prediction.finish_time - now) + LOST_REPORT_GRACE_S if last_stage \
            else prediction.finish_time
        self.footprints[worker.worker_id].add(micro.key, micro.kv_tokens, ends_at)
        self._placed.setdefault(request_id, []).append((worker.worker_id, micro.key))
        self._last_placed[worker.worker_id] = now
        return prediction


class KvFootprints:
    """One worker's KV commitments: tokens each placed micro-request holds at its largest
    (history + prefill + predicted output), from placement until it ends — reported
    (ReportCompletion) or predicted (a first stage that ends at its split reports nothing).

    The timelines and compute clocks see compute only; a split request's decode side then
    looks idle in KV while its reservations and growing decodes fill it (P2048/D512: 161
    recomputes and 267 preemptions on beta at 5.3 req/s in the simulator, alpha 56% busy)."""

    def __init__(self) -> None:
        self.tokens: dict[str, tuple[int, float]] = {}  # key -> (tokens, predicted end)
        self.total = 0
        self._ends: list[tuple[float, str]] = []  # heap of (predicted end, key): lazy expiry

    def add(self, key: str, tokens: int, ends_at: float) -> None:
        self.remove(key)
        self.tokens[key] = (tokens, ends_at)
        self.total += tokens
        if ends_at != math.inf:
            heapq.heappush(self._ends, (ends_at, key))

    def remove(self, key: str) -> None:
        entry = self.tokens.pop(key, None)
        if entry is not None:
            self.total -= entry[0]

    def held(self, now: float) -> int:
        """Tokens committed at `now` (those predicted to have ended are let go)."""
        ends = self._ends
        while ends and ends[0][0] <= now:
            end, key = heapq.heappop(ends)
            entry = self.tokens.get(key)
            if entry is not None and entry[1] == end:  # not a stale entry of a key placed again
                self.remove(key)
        return self.total

    def reset(self) -> None:
        self.tokens.clear()
        self.total = 0
        self._ends.clear()


def _positive_int(value: int | str, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number
