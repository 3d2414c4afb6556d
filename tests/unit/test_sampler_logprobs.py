"""Sampled-token logprobs (issue 37): vLLM's raw_logprobs, i.e. log_softmax of the logits as the
model gave them, at the sampled id and the top N, per row; whatever temperature, penalties,
min_tokens and filters the row samples with, and whatever rows share its step."""

from __future__ import annotations

import pytest
import torch

from splitserve.core import SamplingParams
from splitserve.core.errors import InvalidInput
from splitserve.core.sampling import MAX_LOGPROBS
from workers.engine.sampler import sample, token_logprobs

VOCAB = 97


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


PARAMS = [
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=1.7, top_k=7, top_p=0.8, seed=3, logprobs=0),
    SamplingParams(temperature=0.5, min_p=0.1, presence_penalty=1.5, frequency_penalty=-0.7, repetition_penalty=1.9,
                   seed=11, logprobs=MAX_LOGPROBS),
    SamplingParams(temperature=0.9, seed=5),  # asks for none
    SamplingParams(temperature=0.0, repetition_penalty=2.0, min_tokens=4, stop_token_ids=[0, 1, 2], logprobs=3),
]


def test_logprobs_are_the_raw_log_softmax_at_the_sampled_id_and_the_top_n_per_row():
    logits = _logits(len(PARAMS))
    raw = logits.clone()
    history = [[1, 2, 3, 2, 9, 9], [4, 5], [6, 6, 6, 7, 8], [1], [2, 0, 1]]
    tokens = sample(logits, PARAMS, [0] * len(PARAMS), [3, 0, 2, 0, 1], token_ids=history,
                    prompt_lens=[2, 1, 3, 1, 2], eos_token_ids={1})
    assert torch.equal(logits, raw)  # sampling processed a copy
    found = token_logprobs(logits, PARAMS, tokens)
    assert sorted(found) == [0, 1, 2, 4]  # the row that did not ask gets none
    for i, record in found.items():
        expected = torch.log_softmax(raw[i], dim=-1)
        assert record.logprob == expected[tokens[i]].item()
        n = PARAMS[i].logprobs
        values, ids = expected.topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert record.top == tuple(zip(ids.tolist(), values.tolist()))
        assert [v for _, v in record.top] == sorted((v for _, v in record.top), reverse=True)


def test_temperature_penalties_and_filters_leave_the_logprobs_as_they_are():
    logits = _logits(1, seed=7)
    plain = SamplingParams(temperature=1.0, logprobs=4)
    tuned = [plain,
             SamplingParams(temperature=0.05, top_k=2, logprobs=4, seed=1),
             SamplingParams(temperature=2.0, top_p=0.3, min_p=0.2, logprobs=4, seed=2),
             SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=3.0,
                            logprobs=4)]
    history = [[5, 6, 7, 7, 7]]
    for params in tuned:
        token = sample(logits, [params], [9], [3], token_ids=history, prompt_lens=[2])
        record = token_logprobs(logits, [params], token)[0]
        reference = token_logprobs(logits, [plain], token)[0]  # the same token under no processing
        assert record == reference
        assert record.logprob == torch.log_softmax(logits[0], -1)[token[0]].item()


def test_a_row_s_logprobs_do_not_depend_on_the_rows_beside_it():
    logits = _logits(len(PARAMS), seed=2)
    tokens = [int(t) for t in logits.argmax(-1)]
    together = token_logprobs(logits, PARAMS, tokens)
    for i in together:
        alone = token_logprobs(logits[i:i + 1], [PARAMS[i]], [tokens[i]])
        assert alone[0] == together[i]


def test_no_row_asks_nothing_is_computed():
    assert token_logprobs(_logits(2), [SamplingParams(), SamplingParams()], [0, 1]) == {}


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 2.5])
def test_logprobs_outside_the_range_are_refused_naming_the_field(bad):
    with pytest.raises(InvalidInput) as err:
        SamplingParams(logprobs=bad).validate(VOCAB)
    assert err.value.param == "logprobs"
