"""Output-length prediction for placement: an online model of completed requests, and the client hint.

DynaServe (§3.1, Alg. 1) splits a request of prompt length P and predicted output length
D at φ = P / (P + D) and refines φ from there; §5 adds a margin (20 tokens) to the
prediction because underestimating D overloads the decode side while overestimating it
costs a little efficiency. This module gives a policy that D:

    predictor = OutputLengthPredictor()               # prior 128, margin 20, 75th percentile
    d = predicted_output_len(request, predictor)      # the client's hint, else the model; in [1, max_tokens]
    ...
    def on_completion(self, report):                  # the policy's CompletionListener half
        observe_completion(self.predictor, report)

The model: output lengths of recently completed requests, kept per (tag, prompt-length
bucket) in sliding windows, and a chosen quantile of the window plus a margin. Buckets
are log-spaced (`buckets_per_octave` per doubling of the prompt length); a bucket with
fewer than `min_samples` falls back to the prompt's octave, then to everything the tag has
seen, then to the same three levels over all tags, then to the configured `prior`. The
tag is the caller's (a model name, a workload label; "" by default): it separates
populations whose lengths differ. Defaults and their measured accuracy on the Azure
traces: `benchmarks/length_predictor_accuracy.py`, `docs/benchmarks.md`.

Pure: no I/O, no clock (windows count completions, not seconds), no randomness.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module must stay importable on its own
    from services.global_scheduler.policy import CompletionReport, PlacementRequest

DEFAULT_PRIOR = 128
DEFAULT_MARGIN = 20  # DynaServe §5: "a configurable margin (20 tokens in our setup)"
DEFAULT_QUANTILE = 0.75
DEFAULT_WINDOW = 128
DEFAULT_BUCKETS_PER_OCTAVE = 4
DEFAULT_MIN_SAMPLES = 8
DEFAULT_MAX_TAGS = 64
# Prompt lengths beyond this share the last bucket: bounds the number of buckets whatever
# a report claims (2^32 is already far beyond any model's context).
MAX_PROMPT_LEN = 2**32
# Completions whose output length is known (stop) or a lower bound of it (length); abort,
# error and cancelled requests ended for reasons unrelated to what the model wanted to say.
LEARNED_FINISH_REASONS = ("stop", "length")


class _Window:
    """The last `size` samples, also kept sorted so any quantile is one index away."""

    __slots__ = ("size", "_arrivals", "_sorted")

    def __init__(self, size: int) -> None:
        self.size = size
        self._arrivals: deque[int] = deque()
        self._sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._arrivals)

    def add(self, value: int) -> None:
        if len(self._arrivals) == self.size:
            oldest = self._arrivals.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._arrivals.append(value)
        bisect.insort(self._sorted, value)

    def quantile(self, q: float) -> int:
        """Nearest-rank quantile: the smallest sample with at least a share q of samples <= it."""
        n = len(self._sorted)
        return self._sorted[min(n - 1, max(0, math.ceil(q * n) - 1))]


class _Population:
    """One population's windows: per fine bucket, per octave, and all of it."""

    __slots__ = ("fine", "octave", "all")

    def __init__(self, window: int) -> None:
        self.fine: dict[int, _Window] = {}
        self.octave: dict[int, _Window] = {}
        self.all = _Window(window)

    def add(self, fine: int, octave: int, value: int, window: int) -> None:
        for windows, key in ((self.fine, fine), (self.octave, octave)):
            w = windows.get(key)
            if w is None:
                w = windows[key] = _Window(window)
            w.add(value)
        self.all.add(value)

    def levels(self, fine: int, octave: int) -> tuple[_Window | None, _Window | None, _Window]:
        """Finest first."""
        return self.fine.get(fine), self.octave.get(octave), self.all

    @property
    def num_samples(self) -> int:
        return sum(map(len, self.fine.values())) + sum(map(len, self.octave.values())) + len(self.all)


class OutputLengthPredictor:
    """Predicts a request's output length from the lengths of completed requests.

    `predict` answers in O(1) (a few dict lookups and one index into a sorted window); it
    runs on every placement. `observe` costs O(window) list moves (bisect insert and
    delete), once per completion.

    Memory is bounded: at most `max_tags` tags (least recently used evicted) plus the
    all-tags population, each with at most `buckets_per_octave * 33` fine and 33 octave
    windows of at most `window` samples (`max_samples()` gives the bound).

    Parameters (ValueError names a bad one):
      prior: the prediction before `min_samples` completions were seen at any level; used
        as is (the margin is not added to it: the operator chose it).
      margin: tokens added to every learned prediction (DynaServe: 20), against
        underestimating.
      quantile: which quantile of the window, in (0, 1]; above the median trades accuracy
        for fewer underestimates.
      window: samples kept per bucket (a sliding window: the model follows drift).
      buckets_per_octave: fine buckets per doubling of the prompt length.
      min_samples: a window answers once it holds this many samples; before that the
        next coarser level does.
      max_tags: distinct tags kept.
    """

    def __init__(self, *, prior: int = DEFAULT_PRIOR, margin: int = DEFAULT_MARGIN,
                 quantile: float = DEFAULT_QUANTILE, window: int = DEFAULT_WINDOW,
                 buckets_per_octave: int = DEFAULT_BUCKETS_PER_OCTAVE, min_samples: int = DEFAULT_MIN_SAMPLES,
                 max_tags: int = DEFAULT_MAX_TAGS) -> None:
        _check_int("prior", prior, 1)
        _check_int("margin", margin, 0)
        if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
        _check_int("window", window, 1)
        _check_int("buckets_per_octave", buckets_per_octave, 1)
        _check_int("min_samples", min_samples, 1)
        if min_samples > window:
            raise ValueError(f"min_samples ({min_samples}) must be <= window ({window}): a window would never answer")
        _check_int("max_tags", max_tags, 0)
        self.prior = prior
        self.margin = margin
        self.quantile = float(quantile)
        self.window = window
        self.buckets_per_octave = buckets_per_octave
        self.min_samples = min_samples
        self.max_tags = max_tags
        self._everything = _Population(window)
        self._tags: OrderedDict[str, _Population] = OrderedDict()
        self.num_observed = 0

    def predict(self, prompt_len: int, tag: str = "", max_tokens: int | None = None) -> int:
        """Predicted output tokens of a request with this prompt length: >= 1; within [1, max_tokens] when given.

        The caller passes the request's max_tokens (predicted_output_len below does): the
        prediction is a population's, the budget is this request's own.
        """
        estimate = self.estimate(prompt_len, tag)
        value = self.prior if estimate is None else estimate + self.margin
        return max(1, value) if max_tokens is None else clamp_output_len(value, max_tokens)

    def estimate(self, prompt_len: int, tag: str = "") -> int | None:
        """The learned quantile (no margin, no clamp) at the finest level with enough samples; None: none has."""
        fine, octave = self._buckets(prompt_len)
        tagged = self._tags.get(tag) if tag else None
        for population in (tagged, self._everything):
            if population is None:
                continue
            for window in population.levels(fine, octave):
                if window is not None and len(window) >= self.min_samples:
                    return window.quantile(self.quantile)
        return None

    def observe(self, prompt_len: int, output_len: int, tag: str = "") -> None:
        """Learn one completed request; ValueError for a prompt_len < 1 or an output_len < 0."""
        _check_int("prompt_len", prompt_len, 1)
        _check_int("output_len", output_len, 0)
        fine, octave = self._buckets(prompt_len)
        self._everything.add(fine, octave, output_len, self.window)
        if tag and self.max_tags:
            population = self._tags.get(tag)
            if population is None:
                if len(self._tags) >= self.max_tags:
                    self._tags.popitem(last=False)  # the tag observed least recently
                population = self._tags[tag] = _Population(self.window)
            else:
                self._tags.move_to_end(tag)
            population.add(fine, octave, output_len, self.window)
        self.num_observed += 1

    @property
    def tags(self) -> tuple[str, ...]:
        """Tags with their own windows, least recently observed first."""
        return tuple(self._tags)

    def num_samples(self) -> int:
        """Samples held over every window (for the memory bound)."""
        return self._everything.num_samples + sum(p.num_samples for p in self._tags.values())

    def max_samples(self) -> int:
        """The most samples this predictor can ever hold."""
        octaves = MAX_PROMPT_LEN.bit_length()
        per_population = (octaves * self.buckets_per_octave + octaves + 1) * self.window
        return (1 + self.max_tags) * per_population

    def _buckets(self, prompt_len: int) -> tuple[int, int]:
        """(fine bucket, octave) of a prompt length: floor(k * log2 p) and floor(log2 p)."""
        p = min(max(1, prompt_len), MAX_PROMPT_LEN)
        octave = p.bit_length() - 1  # exact, where log2 of a float could land on the wrong side
        if self.buckets_per_octave == 1:
            return octave, octave
        # Fine buckets nest in their octave: the fraction of the octave picks one of k.
        fine = octave * self.buckets_per_octave + min(
            self.buckets_per_octave - 1, int(math.log2(p / (1 << octave)) * self.buckets_per_octave))
        return fine, octave


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def clamp_output_len(value: int, max_tokens: int) -> int:
    """`value` within [1, max_tokens] (0 when max_tokens is 0: the request may generate nothing)."""
    return min(max(value, 1), max_tokens)


def predicted_output_len(request: PlacementRequest, predictor: OutputLengthPredictor | None, tag: str = "") -> int:
    """The output length a policy plans `request` with: the client's hint when given, else the predictor's.

    Always within [1, request.max_tokens]: the request cannot generate more than its
    budget, and the hint is clamped here too because a RequestMeta may come from any
    caller. Without a predictor (None) and without a hint, the budget itself (the
    pessimistic choice for the decode side).
    """
    if request.predicted_output_len is not None:
        return clamp_output_len(request.predicted_output_len, request.max_tokens)
    if predictor is None:
        return clamp_output_len(request.max_tokens, request.max_tokens)
    return predictor.predict(request.prompt_len, tag, request.max_tokens)


def observe_completion(predictor: OutputLengthPredictor, report: CompletionReport, tag: str = "") -> bool:
    """Feed a finished request to `predictor` (from a policy's `on_completion`); whether it was used.

    "stop" gives the exact output length. "length" (the request hit max_tokens) gives a
    lower bound of what it wanted; it is kept at that value rather than dropped: dropping
    it would remove exactly the longest requests and pull every quantile down (the
    underestimate DynaServe's margin exists to avoid), while recording the bound leaves
    every quantile that lies below it exact (order statistics only compare samples) and
    errs low only when the quantile itself is a truncated sample. abort, error and
    cancelled requests, and reports without a prompt, teach nothing and are skipped.
    Never raises for a bad report: feedback must not fail the scheduler.
    """
    if report.finish_reason not in LEARNED_FINISH_REASONS or report.prompt_tokens < 1 or report.output_tokens < 0:
        return False
    predictor.observe(report.prompt_tokens, report.output_tokens, tag)
    return True


__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_PRIOR",
    "DEFAULT_QUANTILE",
    "LEARNED_FINISH_REASONS",
    "OutputLengthPredictor",
    "clamp_output_len",
    "observe_completion",
    "predicted_output_len",
]
