"""The output-length predictor, the hint-or-prediction helper and completion feedback (pure)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.global_scheduler.length_predictor import (
    LEARNED_FINISH_REASONS,
    OutputLengthPredictor,
    clamp_output_len,
    observe_completion,
    predicted_output_len,
)
from services.global_scheduler.policy import CompletionReport, PlacementRequest
from services.global_scheduler.server import placement_request_from_meta
from splitserve.proto import types_pb2

prompt_lens = st.integers(1, 70_000)
output_lens = st.integers(0, 5_000)
observations = st.lists(st.tuples(prompt_lens, output_lens, st.sampled_from(["", "a", "b"])), max_size=120)


def request(max_tokens: int = 1000, hint: int | None = None, prompt_len: int = 100) -> PlacementRequest:
    return PlacementRequest("r", prompt_len=prompt_len, max_tokens=max_tokens, predicted_output_len=hint)


def fed(observed, **params) -> OutputLengthPredictor:
    predictor = OutputLengthPredictor(**params)
    for prompt, output, tag in observed:
        predictor.observe(prompt, output, tag)
    return predictor


# ---- a reference: every observation kept, windows recomputed from scratch ---------------

def reference_estimate(observed, prompt_len: int, tag: str, *, quantile: float, window: int, min_samples: int,
                       buckets_per_octave: int) -> int | None:
    """The finest level whose last `window` matching samples number >= min_samples, by definition."""
    def fine(p):
        octave = math.floor(math.log2(p))
        return octave, min(buckets_per_octave - 1, math.floor(math.log2(p / 2**octave) * buckets_per_octave))

    def octave(p):
        return math.floor(math.log2(p))

    populations = ([(p, o) for p, o, t in observed if t == tag] if tag else None,
                   [(p, o) for p, o, _ in observed])
    for samples in populations:
        if samples is None:
            continue
        for key in (fine, octave, lambda p: None):
            matching = [o for p, o in samples if key(p) == key(prompt_len)][-window:]
            if len(matching) >= min_samples:
                ordered = sorted(matching)
                return ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]
    return None


@settings(max_examples=100, deadline=None)
@given(observed=observations, prompt=prompt_lens, tag=st.sampled_from(["", "a", "b", "unseen"]),
       quantile=st.sampled_from([0.5, 0.75, 0.9, 1.0]), window=st.integers(1, 40),
       per_octave=st.integers(1, 8), data=st.data())
def test_estimate_equals_the_reference_definition(observed, prompt, tag, quantile, window, per_octave, data):
    min_samples = data.draw(st.integers(1, window))
    params = dict(quantile=quantile, window=window, min_samples=min_samples, buckets_per_octave=per_octave)
    predictor = fed(observed, **params)
    assert predictor.estimate(prompt, tag) == reference_estimate(observed, prompt, tag, **params)


# ---- properties ----------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(observed=observations, window=st.integers(1, 20), max_tags=st.integers(0, 3),
       extra_tags=st.lists(st.text(min_size=1, max_size=3), max_size=30))
def test_memory_is_bounded(observed, window, max_tags, extra_tags):
    predictor = fed(observed, window=window, min_samples=1, max_tags=max_tags)
    for i, tag in enumerate(extra_tags):
        predictor.observe(1 + i * 97, i, tag)
    assert len(predictor.tags) <= max_tags
    assert predictor.num_samples() <= predictor.max_samples()
    populations = [predictor._everything, *predictor._tags.values()]
    for population in populations:
        for w in (*population.fine.values(), *population.octave.values(), population.all):
            assert len(w) <= window and len(w._sorted) == len(w)
    # At most one window per fine bucket and octave a prompt length can fall in.
    assert all(len(p.octave) <= 33 and len(p.fine) <= 33 * predictor.buckets_per_octave for p in populations)


@settings(max_examples=100, deadline=None)
@given(observed=observations, prompt=prompt_lens, margins=st.tuples(st.integers(0, 500), st.integers(0, 500)),
       max_tokens=st.none() | st.integers(1, 4000))
def test_prediction_is_monotone_in_the_margin(observed, prompt, margins, max_tokens):
    low, high = sorted(margins)
    assert (fed(observed, margin=low, min_samples=2).predict(prompt, max_tokens=max_tokens)
            <= fed(observed, margin=high, min_samples=2).predict(prompt, max_tokens=max_tokens))


@settings(max_examples=100, deadline=None)
@given(observed=observations, prompt=prompt_lens,
       quantiles=st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0)))
def test_prediction_is_monotone_in_the_quantile(observed, prompt, quantiles):
    low, high = sorted(quantiles)
    assert fed(observed, quantile=low).predict(prompt) <= fed(observed, quantile=high).predict(prompt)


@settings(max_examples=100, deadline=None)
@given(observed=observations, prompt=prompt_lens, max_tokens=st.integers(0, 5000),
       hint=st.none() | st.integers(0, 2**32 - 1), with_predictor=st.booleans())
def test_hint_wins_and_the_result_stays_within_the_budget(observed, prompt, max_tokens, hint, with_predictor):
    predictor = fed(observed) if with_predictor else None
    got = predicted_output_len(request(max_tokens, hint, prompt), predictor)
    if hint is not None:
        assert got == clamp_output_len(hint, max_tokens)  # whatever the predictor learned
    elif predictor is None:
        assert got == max_tokens  # no model: plan for the whole budget
    else:
        assert got == clamp_output_len(predictor.predict(prompt), max_tokens)
    assert got == max_tokens if max_tokens == 0 else 1 <= got <= max_tokens


@settings(max_examples=100, deadline=None)
@given(a=prompt_lens, b=prompt_lens, per_octave=st.integers(1, 8))
def test_buckets_are_monotone_and_nest_in_octaves(a, b, per_octave):
    predictor = OutputLengthPredictor(buckets_per_octave=per_octave)
    (fine_a, octave_a), (fine_b, octave_b) = predictor._buckets(min(a, b)), predictor._buckets(max(a, b))
    assert fine_a <= fine_b and octave_a <= octave_b
    assert fine_a // per_octave == octave_a and octave_a == min(a, b).bit_length() - 1


# ---- behaviour -----------------------------------------------------------------------

def test_cold_start_answers_the_prior_as_is_clamped_to_the_budget():
    predictor = OutputLengthPredictor(prior=200, margin=20)
    assert predictor.predict(500) == 200  # no margin on the configured prior
    assert predictor.predict(500, max_tokens=64) == 64
    assert predictor.predict(500, max_tokens=0) == 0  # a request that may generate nothing
    assert predictor.estimate(500) is None


def test_learned_prediction_is_the_quantile_plus_the_margin():
    predictor = OutputLengthPredictor(quantile=0.5, margin=20, min_samples=4, window=8)
    for output in (10, 40, 20, 30):
        predictor.observe(1000, output)
    assert predictor.estimate(1000) == 20  # nearest rank: the 2nd of 4
    assert predictor.predict(1000) == 40
    assert predictor.predict(1000, max_tokens=25) == 25


def test_sparse_buckets_fall_back_to_the_octave_then_everything_then_other_tags():
    predictor = OutputLengthPredictor(quantile=0.5, margin=0, min_samples=3, window=16, buckets_per_octave=4)
    for _ in range(3):
        predictor.observe(1024, 100, "chat")  # fine bucket [1024, 1218)
    for _ in range(3):
        predictor.observe(5000, 900, "code")
    assert predictor.estimate(1100, "chat") == 100  # its own fine bucket
    assert predictor.estimate(1900, "chat") == 100  # same octave [1024, 2048), another fine bucket
    assert predictor.estimate(50, "chat") == 100  # another octave: all of the tag
    assert predictor.estimate(50, "new") == 100  # unknown tag, another octave: everything (100 x3, 900 x3)
    assert predictor.estimate(5000, "new") == 900  # unknown tag: everything's own fine bucket
    assert predictor.estimate(5000, "chat") == 100  # the tag's own window comes first


def test_the_window_slides_so_the_model_follows_drift():
    predictor = OutputLengthPredictor(quantile=0.5, margin=0, window=4, min_samples=4)
    for output in (500, 500, 500, 500):
        predictor.observe(300, output)
    for output in (50, 50, 50):
        predictor.observe(300, output)
    assert predictor.estimate(300) == 50  # three of the last four
    predictor.observe(300, 50)
    assert predictor.estimate(300) == 50 and predictor.num_samples() == 3 * 4


def test_least_recently_observed_tag_is_evicted():
    predictor = OutputLengthPredictor(max_tags=2, min_samples=1)
    for tag in ("a", "b", "a", "c"):
        predictor.observe(10, 5, tag)
    assert predictor.tags == ("a", "c")


@pytest.mark.parametrize("params,name", [
    (dict(prior=0), "prior"),
    (dict(margin=-1), "margin"),
    (dict(quantile=0.0), "quantile"),
    (dict(quantile=1.5), "quantile"),
    (dict(quantile=True), "quantile"),
    (dict(window=0), "window"),
    (dict(window=2.5), "window"),
    (dict(buckets_per_octave=0), "buckets_per_octave"),
    (dict(min_samples=0), "min_samples"),
    (dict(window=4, min_samples=5), "min_samples"),
    (dict(max_tags=-1), "max_tags"),
])
def test_bad_parameters_are_named(params, name):
    with pytest.raises(ValueError, match=name):
        OutputLengthPredictor(**params)


def test_observe_refuses_impossible_lengths_by_name():
    predictor = OutputLengthPredictor()
    with pytest.raises(ValueError, match="prompt_len"):
        predictor.observe(0, 5)
    with pytest.raises(ValueError, match="output_len"):
        predictor.observe(5, -1)
    assert predictor.num_observed == 0


# ---- feedback from completions ---------------------------------------------------------

@pytest.mark.parametrize("reason", ["stop", "length", "abort", "error", "cancelled", ""])
def test_only_stop_and_length_completions_teach(reason):
    predictor = OutputLengthPredictor(min_samples=1, margin=0)
    used = observe_completion(predictor, CompletionReport("r", reason, prompt_tokens=40, output_tokens=7))
    assert used == (reason in LEARNED_FINISH_REASONS)
    assert predictor.estimate(40) == (7 if used else None)


def test_a_truncated_completion_counts_at_its_length_a_lower_bound():
    # Three requests finished at 30, 30, 100 tokens; three more hit max_tokens=200 (they
    # wanted >= 200). The true median is 100, below the truncation point, so recording the
    # bounds gives it exactly; dropping them would say 30.
    kept = OutputLengthPredictor(quantile=0.5, margin=0, min_samples=1)
    for output in (30, 30, 100):
        observe_completion(kept, CompletionReport("r", "stop", prompt_tokens=10, output_tokens=output))
        observe_completion(kept, CompletionReport("r", "length", prompt_tokens=10, output_tokens=200))
    assert kept.estimate(10) == 100
    dropped = OutputLengthPredictor(quantile=0.5, margin=0, min_samples=1)
    for output in (30, 30, 100):
        dropped.observe(10, output)
    assert dropped.estimate(10) == 30


def test_reports_without_a_prompt_are_skipped_not_raised():
    predictor = OutputLengthPredictor()
    assert not observe_completion(predictor, CompletionReport("r", "stop", prompt_tokens=0, output_tokens=3))
    assert predictor.num_observed == 0


# ---- the hint on the way in ------------------------------------------------------------

def test_placement_request_tells_a_hint_of_zero_from_no_hint():
    assert placement_request_from_meta(types_pb2.RequestMeta(request_id="r", prompt_len=5,
                                                             max_tokens=9)).predicted_output_len is None
    zero = types_pb2.RequestMeta(request_id="r", prompt_len=5, max_tokens=9, predicted_output_len=0)
    assert zero.HasField("predicted_output_len")
    assert placement_request_from_meta(zero).predicted_output_len == 0
    hinted = placement_request_from_meta(types_pb2.RequestMeta(request_id="r", prompt_len=5, max_tokens=9,
                                                               predicted_output_len=700))
    assert hinted.predicted_output_len == 700  # kept as sent; the helper clamps
    assert predicted_output_len(hinted, OutputLengthPredictor()) == 9
    assert predicted_output_len(placement_request_from_meta(zero), None) == 1
    with pytest.raises(ValueError, match="predicted_output_len"):
        PlacementRequest("r", prompt_len=5, max_tokens=9, predicted_output_len=-1)


def test_the_helper_uses_the_predictor_without_a_hint():
    predictor = OutputLengthPredictor(prior=50)
    assert predicted_output_len(request(max_tokens=1000), predictor) == 50
    assert predicted_output_len(request(max_tokens=30), predictor) == 30
    for _ in range(8):
        predictor.observe(100, 300, "t")
    assert predicted_output_len(request(max_tokens=1000), predictor, tag="t") == 320
