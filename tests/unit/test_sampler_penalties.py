"""vLLM's penalties, min_p and min_tokens in the sampler against a per-row reference (issue 37).

The reference below is the definition written out one row and one token at a time, in float32
as the sampler computes (vLLM's semantics: repetition over prompt and output tokens, dividing a
positive logit and multiplying a negative one; then frequency x count and presence once over the
output tokens; min_tokens masks EOS and stop_token_ids; min_p over the tempered softmax). The
sampler must equal it bit for bit, whatever rows share the batch.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.core import SamplingParams
from splitserve.core.errors import InvalidInput
from workers.engine.sampler import apply_penalties, sample


def reference_logits(row: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int],
                     eos: set[int]) -> np.ndarray:
    """One row's logits after min_tokens and the penalties, token by token."""
    out = row.astype(np.float32).copy()
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | eos:
            out[t] = -np.inf
    seen = set(prompt) | set(output)
    counts = Counter(output)
    rep, freq, pres = (np.float32(v) for v in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    for t in range(len(out)):
        if t in seen and rep != 1:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        if counts[t]:
            out[t] = out[t] - freq * np.float32(counts[t])
            out[t] = out[t] - pres
    return out


@st.composite
def rows(draw, max_rows: int = 6):
    """(logits, params, prompts, outputs, eos) for a batch over a small vocabulary."""
    vocab = draw(st.integers(2, 24))
    n = draw(st.integers(1, max_rows))
    seed = draw(st.integers(0, 2**31 - 1))
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 4
    token = st.integers(0, vocab - 1)
    eos = set(draw(st.lists(token, max_size=2)))
    params, prompts, outputs = [], [], []
    for _ in range(n):
        prompts.append(draw(st.lists(token, min_size=1, max_size=12)))
        outputs.append(draw(st.lists(token, max_size=12)))
        params.append(SamplingParams(
            max_tokens=64, temperature=draw(st.sampled_from([0.0, 0.7, 1.0, 1.6])),
            presence_penalty=draw(st.sampled_from([0.0, 0.5, -0.75, 2.0, -2.0])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.3, -1.1, 2.0])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.6, 2.5])),
            min_p=draw(st.sampled_from([0.0, 0.05, 0.3, 1.0])),
            min_tokens=draw(st.sampled_from([0, 3, 20])),
            stop_token_ids=draw(st.lists(token, max_size=2)),
            top_k=draw(st.sampled_from([0, 0, 3])), seed=draw(st.integers(0, 2**63 - 1))))
    return logits, params, prompts, outputs, eos


def _sample(logits, params, prompts, outputs, eos):
    return sample(logits, params, [p.seed for p in params], [len(o) for o in outputs],
                  token_ids=[pr + o for pr, o in zip(prompts, outputs)], prompt_lens=[len(pr) for pr in prompts],
                  eos_token_ids=eos)


@settings(max_examples=150, deadline=None)
@given(rows())
def test_penalties_equal_the_per_row_reference_bit_for_bit(case):
    logits, params, prompts, outputs, _ = case
    got = apply_penalties(logits.clone(), prompts, outputs, [p.presence_penalty for p in params],
                          [p.frequency_penalty for p in params], [p.repetition_penalty for p in params])
    for i, p in enumerate(params):
        no_min_tokens = SamplingParams(presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                       repetition_penalty=p.repetition_penalty)
        want = reference_logits(logits[i].numpy(), no_min_tokens, prompts[i], outputs[i], set())
        np.testing.assert_array_equal(got[i].numpy(), want)


@settings(max_examples=150, deadline=None)
@given(rows())
def test_a_greedy_row_takes_the_argmax_of_the_reference_logits(case):
    logits, params, prompts, outputs, eos = case
    params = [SamplingParams(**{**vars(p), "temperature": 0.0}) for p in params]
    tokens = _sample(logits, params, prompts, outputs, eos)
    for i, p in enumerate(params):
        want = reference_logits(logits[i].numpy(), p, prompts[i], outputs[i], eos)
        if np.isfinite(want).any():  # a row whose every token is masked has no answer
            assert tokens[i] == int(np.argmax(want))


@settings(max_examples=150, deadline=None)
@given(rows())
def test_a_random_row_draws_only_what_min_tokens_min_p_and_top_k_keep(case):
    logits, params, prompts, outputs, eos = case
    tokens = _sample(logits, params, prompts, outputs, eos)
    for i, p in enumerate(params):
        want = reference_logits(logits[i].numpy(), p, prompts[i], outputs[i], eos).astype(np.float64)
        if p.greedy or not np.isfinite(want).any():
            continue
        t = tokens[i]
        assert np.isfinite(want[t]), "a masked token (min_tokens) was drawn"
        # min_p over the tempered softmax: p_t / p_max = exp((l_t - l_max) / T) (float64; a hair of slack)
        assert np.exp((want[t] - want.max()) / p.temperature) >= p.min_p * (1 - 1e-5)
        if p.top_k:
            assert (want > want[t]).sum() < p.top_k


@settings(max_examples=100, deadline=None)
@given(rows(max_rows=8))
def test_each_row_samples_as_if_alone_in_its_step(case):
    """What makes a split request exact: a row's token depends on its own history only."""
    logits, params, prompts, outputs, eos = case
    batch = _sample(logits, params, prompts, outputs, eos)
    alone = [_sample(logits[i:i + 1], params[i:i + 1], prompts[i:i + 1], outputs[i:i + 1], eos)[0]
             for i in range(len(params))]
    assert batch == alone


def test_min_tokens_holds_back_eos_and_stop_ids_then_lets_them_end_the_output():
    vocab, eos, stop = 8, 7, 5
    logits = torch.zeros(1, vocab)
    logits[0, eos], logits[0, stop], logits[0, 2] = 9.0, 8.0, 1.0
    for temperature in (0.0, 1.0):
        p = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[stop], temperature=temperature, seed=1)
        drawn = [_sample(logits, [p], [[1, 2]], [[3] * n], {eos})[0] for n in range(5)]
        assert eos not in drawn[:3] and stop not in drawn[:3]
        if temperature == 0.0:
            assert drawn == [2, 2, 2, eos, eos]
    # ignore_eos does not lift it: vLLM masks the model's EOS under min_tokens either way.
    p = SamplingParams(max_tokens=10, min_tokens=3, ignore_eos=True, temperature=0.0)
    assert _sample(logits, [p], [[1]], [[]], {eos}) == [stop]


def test_repetition_penalty_reads_the_prompt_presence_and_frequency_only_the_output():
    logits = torch.tensor([[2.0, 2.0, -1.0, 2.0, 0.5]])
    got = apply_penalties(logits.clone(), [[0, 2]], [[3, 3]], [0.25], [0.5], [2.0])
    # 0 and 2 in the prompt: only the repetition penalty (2 / 2, -1 * 2); 3 twice in the output:
    # 2 / 2 - 0.5 * 2 - 0.25; 1 and 4 untouched.
    assert got.tolist() == [[1.0, 2.0, -2.0, -0.25, 0.5]]


def test_min_p_one_keeps_only_the_top_token():
    logits = torch.tensor([[1.0, 3.0, 2.9, -4.0]])
    p = SamplingParams(temperature=1.0, min_p=1.0, seed=3)
    assert {_sample(logits, [SamplingParams(**{**vars(p), "seed": s})], [[0]], [[]], set())[0]
            for s in range(20)} == {1}


def test_penalties_without_the_history_are_a_programming_error():
    with pytest.raises(ValueError, match="token_ids"):
        sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [0], [0])


@pytest.mark.parametrize("field,value,limit", [
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3.0, "[-2, 2]"),
    ("presence_penalty", float("nan"), "[-2, 2]"), ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", float("inf"), "> 0"), ("min_p", 1.5, "[0, 1]"), ("min_p", -0.01, "[0, 1]"),
    ("min_tokens", -1, "[0, max_tokens=16]"), ("min_tokens", 17, "[0, max_tokens=16]")])
def test_the_core_refuses_out_of_range_values_naming_the_field(field, value, limit):
    with pytest.raises(InvalidInput) as info:
        SamplingParams(**{field: value}).validate(100)
    assert info.value.param == field and field in info.value.message and limit in info.value.message
