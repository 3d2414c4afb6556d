"""The real model out of the box: SmolLM2-135M-Instruct, converted from its GGUF, served by the engine.

Greedy output equals transformers' token for token on chat prompts (float32, 48 new tokens
and more); the chat template, <|im_end|> as the end of a turn and skip_special_tokens behave
as vLLM's do on the same directory; a `.gguf` path loads the same model.
"""

from __future__ import annotations

import json

import pytest
from real_model_support import (
    FRANCE,
    FRANCE_ANSWER,
    IM_END_ID,
    MAX_NEW_TOKENS,
    PHOTOSYNTHESIS,
    chat_prompt_ids,
    real_model_dir,
    transformers_greedy,
)
from safetensors import safe_open

from workers.engine import LLM, SamplingParams

MAX_NEW = MAX_NEW_TOKENS
CONVERSATIONS = [FRANCE, PHOTOSYNTHESIS]


@pytest.fixture(scope="module")
def model_dir():
    return real_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_prompt_ids(tokenizer, messages) for messages in CONVERSATIONS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    return transformers_greedy(model_dir, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir))


def test_converted_directory_is_a_plain_float32_llama(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # loads without gguf or accelerate
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "vocab_size", "tie_word_embeddings", "max_position_embeddings")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        assert {weights.get_slice(k).get_dtype() for k in names} == {"F32"}
    assert "lm_head.weight" not in names  # tied to the embeddings
    assert len(names) == 30 * 9 + 2
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == IM_END_ID


def test_tokenizer_and_chat_template_are_smollm2s(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END_ID
    text = tokenizer.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # No BOS is added to plain text (ChatML opens turns itself), and special tokens in text are parsed.
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=True)[0] == tokenizer.bos_token_id
    assert chat_prompt_ids(tokenizer, FRANCE) == tokenizer.encode(text, add_special_tokens=False)
    # SmolLM2's pre-tokenizer writes every digit as its own token (llama.cpp's "smollm" rule).
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("in 2024")) == ["in", "Ġ", "2", "0", "2", "4"]
    assert tokenizer.decode(tokenizer.encode("a  b\n\n c ,d")) == "a  b\n\n c ,d"  # no space clean-up
    # skip_special_tokens drops every added control token, as vLLM's detokenizer does.
    assert tokenizer.decode([IM_END_ID, 0, 1, 3], skip_special_tokens=True) == ""


def test_greedy_chat_equals_transformers(llm, prompts, reference):
    # Batched together: one stops at <|im_end|> after 8 tokens while the other decodes on.
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.token_ids for o in outputs] == reference
    france, photosynthesis = outputs
    assert france.token_ids[-1] == IM_END_ID and france.finish_reason == "stop"
    assert france.text == FRANCE_ANSWER  # <|im_end|> ends the turn and is not in the text
    assert len(photosynthesis.token_ids) == MAX_NEW and photosynthesis.finish_reason == "length"
    assert IM_END_ID not in photosynthesis.token_ids
    assert "<|im" not in photosynthesis.text and len(photosynthesis.text.split()) > 20  # real text


def test_gguf_path_serves_the_same_model(model_dir, prompts, reference):
    """`--model x.gguf`: the engine resolves the file to its dequantized directory (the preset's,
    as the cache is keyed by content) and answers alike."""
    from splitserve.model_presets import SMOLLM2_135M_INSTRUCT, fetch_preset_gguf

    gguf_path = fetch_preset_gguf(SMOLLM2_135M_INSTRUCT)
    llm = LLM(str(gguf_path))
    assert llm.engine.spec.model_dir == model_dir
    assert llm.engine.tokenizer is not None
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_NEW, temperature=0.0))[0]
    assert out.token_ids == reference[0]
    assert out.text == FRANCE_ANSWER


def test_gateway_tokenization_of_a_gguf_path(model_dir, tokenizer):
    from gateway.tokenization import Tokenization
    from splitserve.model_presets import SMOLLM2_135M_INSTRUCT, fetch_preset_gguf

    tokenization = Tokenization.from_model_dir(fetch_preset_gguf(SMOLLM2_135M_INSTRUCT))
    assert (tokenization.max_model_len, tokenization.vocab_size) == (8192, 49152)
    assert tokenization.encode_chat(FRANCE) == chat_prompt_ids(tokenizer, FRANCE)
