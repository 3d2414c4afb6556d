"""OpenAI's `n` and completions' `echo` through the gateway's HTTP app (issue 37), over a fake
coordinator whose output is a function of each request's seed: n choices with index 0..n-1,
each its own request with seed + index (vLLM's parallel sampling), whole and streamed, usage
counting the prompt once; echo prepending the prompt, with its logprobs (the first token's
null) when logprobs are asked, and max_tokens 0 (lm-eval-harness's loglikelihood request).
Also the assembler stitching prompt logprobs by position across stages."""

from __future__ import annotations

import json

import pytest

from gateway.coordinator_client import GenerationDelta, OutputAssembler
from gateway.core import GatewayCore
from gateway.openai_format import completion_logprobs
from gateway.tokenization import Tokenization
from gateway.validation import SEED_LIMIT, Limits, chat_request, completion_request
from splitserve.config import GatewayConfig
from splitserve.core.sampling import TokenLogprobs
from splitserve.errors import InvalidArgument, SplitserveError
from tests.unit.test_openai_compat_http import BOS, HI, MAX_LEN, ByteTokenizer
from gateway_support import call, events

TOK = Tokenization(ByteTokenizer(), max_model_len=MAX_LEN)
LIMITS = Limits(served_model="demo", max_model_len=MAX_LEN, default_max_tokens=16, max_tokens_limit=40)


def prompt_score(position: int) -> TokenLogprobs:
    """The fake engine's logprob of the prompt token at `position` (its top 1: token 120)."""
    return TokenLogprobs(-0.125 * position, ((120, -0.0625),))


class SeededCoordinator:
    """Two tokens per request, both a function of its seed (greedy: always "gg"), in two deltas;
    the prompt's logprobs on the first delta when asked; the engine's one token dropped at
    max_tokens 0 as the real assembler drops it."""

    def __init__(self):
        self.submitted = []

    async def generate(self, request, timeout_s=None, trace_context=None):
        submit = request.submit_request()
        self.submitted.append(submit)
        prompt = len(request.prompt_token_ids)
        scores = None
        if submit.sampling.HasField("num_prompt_logprobs"):
            scores = [None] + [prompt_score(p) for p in range(1, prompt)]
        if request.max_tokens == 0:
            yield GenerationDelta("", [], "length", prompt, 0, prompt_logprobs=scores)
            return
        if request.temperature == 0:
            letter = ord("g")
        else:
            letter = ord("a") + (submit.sampling.seed % 26 if submit.sampling.HasField("seed") else 25)
        sampled = [TokenLogprobs(-0.5, ())] if submit.sampling.HasField("num_logprobs") else []
        yield GenerationDelta(chr(letter), [letter], "", prompt, 1, sampled, prompt_logprobs=scores)
        yield GenerationDelta(chr(letter), [letter], "length", prompt, 2, sampled)

    async def ready(self, timeout_s: float = 1.0, engine_family: str = "") -> tuple[bool, str]:
        return True, ""

    async def close(self) -> None:
        pass


def gateway(**config):
    coordinator = SeededCoordinator()
    settings = {"model": "/models/demo", "default_max_tokens": 16, "max_tokens_limit": 1000, **config}
    return GatewayCore(GatewayConfig(**settings), TOK, coordinator), coordinator


# --- validation

def test_each_choice_is_a_request_of_its_own_seeded_seed_plus_index():
    req = completion_request({"prompt": "hi", "n": 3, "seed": 41}, TOK, LIMITS, "r1")
    choices = [req.choice(i) for i in range(3)]
    assert [c.request_id for c in choices] == ["r1-0", "r1-1", "r1-2"]
    assert [c.seed for c in choices] == [41, 42, 43] and all(c.n == 1 for c in choices)
    assert [c.submit_request().sampling.seed for c in choices] == [41, 42, 43]
    # Choice 0 of n asks what the request with n = 1 asks; n = 1 is the request itself.
    single = completion_request({"prompt": "hi", "seed": 41}, TOK, LIMITS, "r1")
    assert single.choice(0) is single
    assert choices[0].submit_request().sampling == single.submit_request().sampling
    top = completion_request({"prompt": "hi", "n": 2, "seed": SEED_LIMIT - 1}, TOK, LIMITS, "r1")
    assert top.choice(1).seed == 0  # wraps within the seed's range
    unseeded = completion_request({"prompt": "hi", "n": 2}, TOK, LIMITS, "r1")
    assert unseeded.choice(1).seed is None and not unseeded.choice(1).submit_request().sampling.HasField("seed")


def test_n_is_capped_by_max_n_naming_n():
    assert completion_request({"prompt": "hi", "n": 16}, TOK, LIMITS, "r1").n == 16
    with pytest.raises(InvalidArgument) as info:
        completion_request({"prompt": "hi", "n": 5}, TOK, Limits("demo", MAX_LEN, max_n=4), "r1")
    assert info.value.param == "n" and "[1, 4]" in info.value.message and "max_n" in info.value.message
    assert completion_request({"prompt": "hi", "n": 3, "best_of": 3}, TOK, LIMITS, "r1").n == 3


def test_completions_echo_keeps_the_prompt_and_max_tokens_0_only_with_echo():
    req = completion_request({"prompt": "hi", "echo": True, "logprobs": 2, "max_tokens": 0}, TOK, LIMITS, "r1")
    assert (req.echo, req.echo_text, req.max_tokens, req.prompt_logprobs) == (True, "hi", 0, 2)
    sampling = req.submit_request().sampling
    assert sampling.max_tokens == 1 and sampling.num_prompt_logprobs == 2 and sampling.num_logprobs == 2
    assert completion_request({"prompt": [BOS, 104], "echo": True}, TOK, LIMITS, "r1").echo_text is None
    plain = completion_request({"prompt": "hi", "echo": True}, TOK, LIMITS, "r1")
    assert plain.prompt_logprobs is None and not plain.submit_request().sampling.HasField("num_prompt_logprobs")
    with pytest.raises(InvalidArgument) as info:
        completion_request({"prompt": "hi", "max_tokens": 0}, TOK, LIMITS, "r1")
    assert info.value.param == "max_tokens"


def test_chat_echo_prepends_the_last_message_in_the_replys_role():
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
    req = chat_request({"messages": conversation, "echo": True, "add_generation_prompt": False,
                        "continue_final_message": True}, TOK, LIMITS, "r1")
    assert req.echo_text == "The answer"
    assert chat_request({"messages": conversation, "echo": True}, TOK, LIMITS, "r1").echo_text == "The answer"
    assert chat_request({"messages": HI, "echo": True}, TOK, LIMITS, "r1").echo_text == ""


# --- n through the HTTP app

def test_n_seeded_completions_give_n_distinct_reproducible_choices_and_usage_counts_the_prompt_once():
    core, coordinator = gateway()
    body = {"prompt": "hi", "n": 3, "seed": 7, "max_tokens": 2}
    reply = call(core, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == ["hh", "ii", "jj"]  # seeds 7, 8, 9
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert sorted(s.sampling.seed for s in coordinator.submitted) == [7, 8, 9]
    assert len({s.request_id for s in coordinator.submitted}) == 3
    assert call(core, "/v1/completions", body).json()["choices"] == answer["choices"]


def test_n_greedy_gives_n_identical_choices():
    core, _ = gateway()
    answer = call(core, "/v1/chat/completions", {"messages": HI, "n": 2, "temperature": 0}).json()
    assert [(c["index"], c["message"]["content"]) for c in answer["choices"]] == [(0, "gg"), (1, "gg")]


@pytest.mark.parametrize("chat", [False, True])
def test_n_streamed_every_chunk_names_its_choice_and_each_choice_finishes(chat):
    core, _ = gateway()
    path, body = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": "hi"})
    reply = call(core, path, {**body, "n": 3, "seed": 1, "max_tokens": 2, "stream": True,
                              "stream_options": {"include_usage": True}})
    assert reply.status_code == 200, reply.text
    chunks = events(reply)
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": len(TOK.encode_prompt("hi")) if not chat
                                                         else usage["usage"]["prompt_tokens"],
                                                         "completion_tokens": 6,
                                                         "total_tokens": usage["usage"]["prompt_tokens"] + 6}
    assert all(len(c["choices"]) == 1 for c in chunks)
    by_index: dict[int, list[dict]] = {}
    for c in chunks:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1, 2]
    for index, choice_chunks in by_index.items():
        finishes = [c["finish_reason"] for c in choice_chunks if c["finish_reason"]]
        assert finishes == ["length"] and choice_chunks[-1]["finish_reason"] == "length"
        text = "".join(c["delta"].get("content", "") if chat else c["text"] for c in choice_chunks)
        assert text == chr(ord("a") + 1 + index) * 2
        if chat:
            assert choice_chunks[0]["delta"] == {"role": "assistant", "content": ""}


# --- echo through the HTTP app

def test_echo_prepends_the_prompt_text():
    core, _ = gateway()
    answer = call(core, "/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 2, "seed": 0}).json()
    assert answer["choices"][0]["text"] == "hiaa"
    by_ids = call(core, "/v1/completions", {"prompt": [BOS, 104, 105], "echo": True, "max_tokens": 2,
                                            "seed": 0}).json()
    # Token ids echoed as the tokenizer decodes them, special tokens included (as vLLM's decode).
    assert by_ids["choices"][0]["text"] == "<s>hiaa"


def test_echo_with_max_tokens_0_and_no_logprobs_asks_the_model_nothing():
    core, coordinator = gateway()
    answer = call(core, "/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0, "n": 2}).json()
    assert [(c["text"], c["finish_reason"], c["logprobs"]) for c in answer["choices"]] == \
        [("hi", "length", None), ("hi", "length", None)]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    assert coordinator.submitted == []


PROMPT_LOGPROBS = {
    "tokens": ["<s>", "h", "i"],
    "token_logprobs": [None, -0.125, -0.25],
    "top_logprobs": [None, {"h": -0.125, "x": -0.0625}, {"i": -0.25, "x": -0.0625}],
    "text_offset": [0, 3, 4],
}


def test_echo_logprobs_max_tokens_0_scores_the_prompt_first_token_null():
    core, coordinator = gateway()
    reply = call(core, "/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == "hi" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == PROMPT_LOGPROBS
    assert reply.json()["usage"]["completion_tokens"] == 0
    sampling = coordinator.submitted[0].sampling
    assert sampling.num_prompt_logprobs == 1 and sampling.max_tokens == 1


def test_echo_logprobs_with_output_lists_the_prompt_then_the_output():
    core, _ = gateway()
    choice = call(core, "/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 0, "max_tokens": 2,
                                            "temperature": 0}).json()["choices"][0]
    assert choice["text"] == "higg"
    assert choice["logprobs"]["tokens"] == ["<s>", "h", "i", "g", "g"]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.125, -0.25, -0.5, -0.5]
    assert choice["logprobs"]["text_offset"] == [0, 3, 4, 5, 6]


def test_echo_streamed_sends_the_prompt_and_its_logprobs_first():
    core, _ = gateway()
    chunks = events(call(core, "/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0,
                                                   "stream": True}))
    assert len(chunks) == 1
    choice = chunks[0]["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("hi", "length")
    assert choice["logprobs"] == PROMPT_LOGPROBS


# --- the pieces

class Text:
    stopped = False

    def push(self, token_ids, final=False):
        return "".join(chr(t) for t in token_ids)


def test_the_assembler_stitches_prompt_logprobs_by_position_over_stages():
    assembler = OutputAssembler(Text(), 5, max_tokens=2, prompt_logprobs=True)
    # Stage 0 computed positions [0, 3): it scored prompt tokens 1 and 2; no token yet.
    assert assembler.feed([], "", 5, (), [prompt_score(1), prompt_score(2)], 1) is None
    delta = assembler.feed([65], "", 5, (), [prompt_score(3), prompt_score(4)], 3)
    assert delta.prompt_logprobs == [None] + [prompt_score(p) for p in range(1, 5)]
    assert assembler.feed([66], "length", 5).prompt_logprobs is None  # once


def test_the_assembler_refuses_to_answer_with_a_prompt_position_unscored():
    assembler = OutputAssembler(Text(), 5, max_tokens=2, prompt_logprobs=True)
    assembler.feed([], "", 5, (), [prompt_score(1)], 1)
    with pytest.raises(SplitserveError) as info:
        assembler.feed([65], "", 5, (), [prompt_score(3), prompt_score(4)], 3)
    assert info.value.param == "prompt_logprobs" and "first: 2" in info.value.message


def test_the_assembler_drops_the_engines_token_at_max_tokens_0():
    assembler = OutputAssembler(Text(), 2, max_tokens=0)
    delta = assembler.feed([65], "", 2)
    assert (delta.text, delta.token_ids, delta.finish_reason, delta.completion_tokens) == ("", [], "length", 0)
    assert assembler.finished


def test_completion_logprobs_of_an_unscored_token_are_null():
    shaped = completion_logprobs([BOS, 104], [None, TokenLogprobs(-1.0, ())], 0, lambda t: chr(t) if t < 256 else "<s>")
    assert shaped == {"tokens": ["<s>", "h"], "token_logprobs": [None, -1.0], "top_logprobs": [None, {"h": -1.0}],
                      "text_offset": [0, 3]}
