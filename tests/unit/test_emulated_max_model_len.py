"""An emulated worker's max_model_len is its preset model's context (issue 12), unless given."""

from __future__ import annotations

import json

import pytest

from splitserve.core import SamplingParams, StageKey, StageSpec
from splitserve.perf.presets import MODEL_SPECS
from workers.engine.config import EngineConfig
from workers.engine.emulated import Emulation, build_emulated_engine, emulated_spec

CONTEXTS = {"Llama-3-8B": 8192, "Qwen2.5-14B": 32768, "Qwen2.5-32B": 32768, "Llama-3.1-70B": 131072}


@pytest.mark.parametrize("preset, context", sorted(CONTEXTS.items()))
def test_presets_carry_their_context_length(preset, context):
    assert MODEL_SPECS[preset].context_len == context
    assert emulated_spec(Emulation("H100", preset)).max_position_embeddings == context


@pytest.fixture
def small_tokenizer_dir(tmp_path):
    """What `splitserve up` hands an emulated worker: a small model's directory, for its tokenizer."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512, "max_position_embeddings": 2048,
                                                      "eos_token_id": 2, "bos_token_id": 1}))
    return tmp_path


def _engine(model_dir, max_model_len=None):
    config = EngineConfig(model=str(model_dir), max_model_len=max_model_len, kv_cache_memory_bytes=20 << 30)
    return build_emulated_engine(config, Emulation("H100", "llama-3-8b"))


def test_the_tokenizer_directory_lends_its_vocabulary_not_its_max_length(small_tokenizer_dir):
    spec = emulated_spec(Emulation("H100", "llama-3-8b"), small_tokenizer_dir)
    assert spec.vocab_size == 512 and spec.eos_token_ids == [2]
    assert spec.max_position_embeddings == 8192
    engine = _engine(small_tokenizer_dir)
    assert engine.max_model_len == engine.scheduler.config.max_model_len == 8192
    # An Azure-length prompt (3,000 tokens) is admitted; it was refused over 2,048 before.
    engine.add_stage(StageSpec(StageKey("azure", 0), [5] * 3000, SamplingParams(max_tokens=16)))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_stage(StageSpec(StageKey("too-long", 0), [5] * 8190, SamplingParams(max_tokens=16)))


def test_an_explicit_max_model_len_wins(small_tokenizer_dir):
    engine = _engine(small_tokenizer_dir, max_model_len=4096)
    assert engine.max_model_len == 4096
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_stage(StageSpec(StageKey("r", 0), [5] * 4090, SamplingParams(max_tokens=16)))
