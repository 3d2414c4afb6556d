"""`splitserve demo-model --preset ...`: random presets offline, the real preset from the cache,
and flags that do not fit the preset refused by name."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from splitserve.cli.app import app
from splitserve.model_presets import MARKER, SMOLLM2_135M_INSTRUCT, cached_preset_dir
from splitserve.gguf import BUILDER_VERSION
from splitserve.gguf import MARKER as GGUF_MARKER

SMALL = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
         "--vocab", "300", "--max-positions", "128"]


def _run(*args: str):
    result = CliRunner().invoke(app, list(args))
    # rich draws error boxes and wraps lines: compare words only
    return result.exit_code, " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


@pytest.mark.parametrize("preset, model_type", [("random-qwen2", "qwen2"), ("random-mistral", "mistral")])
def test_random_presets_build_offline(tmp_path, preset, model_type):
    code, output = _run("demo-model", "--preset", preset, "--out", str(tmp_path / "m"), *SMALL)
    assert code == 0, output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == model_type


@pytest.mark.parametrize("args, message", [
    (["--preset", "random-qwen2", "--arch", "llama"], "--arch llama contradicts --preset random-qwen2"),
    (["--preset", "smollm2-135m-instruct", "--layers", "3"],
     "--layers sizes a random model; it does not apply to --preset smollm2-135m-instruct"),
    (["--preset", "smollm2-135m-instruct", "--bench"], "--bench sizes a random model"),
    (["--preset", "llama-70b"], "must be one of smollm2-135m-instruct, random-llama"),
])
def test_flags_that_do_not_fit_the_preset_are_refused(tmp_path, args, message):
    code, output = _run("demo-model", "--out", str(tmp_path / "m"), *args)
    assert code == 2 and message in output, output
    assert not (tmp_path / "m").exists()


def test_real_preset_comes_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    entry = cached_preset_dir(SMOLLM2_135M_INSTRUCT, cache)
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")
    (entry / GGUF_MARKER).write_text(json.dumps(
        {"builder_version": BUILDER_VERSION, "gguf_sha256": SMOLLM2_135M_INSTRUCT.gguf_sha256}))
    code, output = _run("demo-model", "--preset", "smollm2-135m-instruct", "--out", str(tmp_path / "m"),
                        "--model-cache", str(cache))
    assert code == 0, output
    assert "downloading" not in output and "model written to" in output
    assert json.loads((tmp_path / "m" / MARKER).read_text())["preset"] == "smollm2-135m-instruct"
