"""`--model Org/Name`: a Hugging Face repository id resolved from the local Hugging Face cache (issue 37).

The cache is laid out as huggingface_hub writes it (tests/hub_cache_support.py) with a tiny
model from splitserve.cli.demo_model. Each case runs in its own process: huggingface_hub reads
HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_ENDPOINT when it is imported, as every tool
started with them does. No hub is reachable here; "online" cases point HF_ENDPOINT at a port
that refuses connections or at one that accepts and never answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_cache_support import COMMIT, SilentHub, add_to_hub_cache, closed_port_url

from splitserve.hub_models import is_repo_id

REPO = "TinyOrg/tiny-llama"
ROOT = Path(__file__).resolve().parents[2]

RESOLVE = """
import json, sys, time
from splitserve.hub_models import HubModelNotFoundError, hub_model_dir
started = time.monotonic()  # the resolve alone, not the interpreter's start and imports
try:
    got = {"path": str(hub_model_dir(sys.argv[1], weights=sys.argv[2] == "weights"))}
except HubModelNotFoundError as err:
    got = {"error": str(err), "type": type(err).__name__}
print(json.dumps({**got, "seconds": time.monotonic() - started}))
"""


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    from splitserve.cli.demo_model import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, vocab_size=300, max_position_embeddings=256, seed=7)
    return build_demo_model(spec, tmp_path_factory.mktemp("tiny-source") / "model")


def _hf_env(**settings: str) -> dict[str, str]:
    """This environment without any Hugging Face setting of its own, plus `settings`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_")) and k != "XDG_CACHE_HOME"}
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    env.update(settings)
    return env


def _resolve(repo_id: str, env: dict[str, str], *, weights: bool = True, timeout: float = 60) -> dict:
    out = subprocess.run([sys.executable, "-c", RESOLVE, repo_id, "weights" if weights else "config"], env=env,
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_repo_ids_are_told_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and is_repo_id(REPO)
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "model").mkdir()
    assert not is_repo_id("local/model")  # an existing relative path is a path
    for not_an_id in ("model", "./a/b", "/abs/dir", "a/b/c", "org/model.gguf", "org/bad--name", "org/", ""):
        assert not is_repo_id(not_an_id), not_an_id


def test_an_id_resolves_from_the_cache_under_hf_home_offline(tmp_path, tiny_source):
    snapshot = add_to_hub_cache(tmp_path / "hf" / "hub", REPO, tiny_source)
    got = _resolve(REPO, _hf_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1"))
    assert Path(got["path"]) == snapshot and snapshot.name == COMMIT
    assert (snapshot / "config.json").is_symlink()  # huggingface_hub's layout, not a copy


def test_a_cache_hit_makes_no_request_to_the_hub(tmp_path, tiny_source):
    snapshot = add_to_hub_cache(tmp_path / "cache", REPO, tiny_source)
    hub = SilentHub()
    try:
        got = _resolve(REPO, _hf_env(HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url))
        assert Path(got["path"]) == snapshot
        assert hub.connections() == 0
    finally:
        hub.close()


def test_an_id_missing_offline_is_an_error_naming_it_and_the_cache(tmp_path):
    cache = tmp_path / "empty-cache"
    got = _resolve("TinyOrg/absent", _hf_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"), timeout=30)
    assert got["type"] == "HubModelNotFoundError"
    assert "TinyOrg/absent" in got["error"] and str(cache) in got["error"] and "HF_HUB_OFFLINE" in got["error"]


def test_an_id_missing_with_the_hub_unreachable_fails_at_once(tmp_path):
    cache = tmp_path / "empty-cache"
    got = _resolve("TinyOrg/absent", _hf_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="0",
                                             HF_ENDPOINT=closed_port_url()), timeout=30)
    assert "TinyOrg/absent" in got["error"] and str(cache) in got["error"] and "could not be downloaded" in got["error"]
    assert got["seconds"] < 5, got  # a refused connection is not retried for long


def test_a_hub_that_never_answers_is_given_up_on_after_the_etag_timeout(tmp_path):
    """snapshot_download alone would wait for good: the repository lookup is bounded by HF_HUB_ETAG_TIMEOUT."""
    hub = SilentHub()
    try:
        got = _resolve("TinyOrg/absent", _hf_env(HF_HUB_CACHE=str(tmp_path / "c"), HF_HUB_OFFLINE="0",
                                                 HF_ENDPOINT=hub.url, HF_HUB_ETAG_TIMEOUT="1"), timeout=60)
        assert "TinyOrg/absent" in got["error"] and "could not be downloaded" in got["error"]
        assert hub.connections() >= 1
        # HF_HUB_ETAG_TIMEOUT=1 honoured: 4.3 s measured here (the timeout and huggingface_hub's
        # retries); its default timeout alone is 10 s.
        assert got["seconds"] < 9, got
    finally:
        hub.close()


def test_a_cached_snapshot_without_weights_serves_only_a_tokenizer(tmp_path, tiny_source):
    """Another tool may have cached only config.json and the tokenizer: enough for the gateway and an
    emulated worker, not for the engine (offline: said so, naming what is missing)."""
    names = tuple(p.name for p in tiny_source.iterdir() if not p.name.endswith(".safetensors"))
    snapshot = add_to_hub_cache(tmp_path / "cache", REPO, tiny_source, only=names)
    env = _hf_env(HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    assert Path(_resolve(REPO, env, weights=False)["path"]) == snapshot
    got = _resolve(REPO, env)
    assert "safetensors" in got["error"] and REPO in got["error"]


def test_generate_and_serve_take_an_id(tmp_path, tiny_source):
    """The offline engine (`splitserve generate`) loads by id, and `serve gateway` gets the snapshot
    directory as its model and the id as the name clients send."""
    add_to_hub_cache(tmp_path / "hf" / "hub", REPO, tiny_source)
    env = _hf_env(HF_HOME=str(tmp_path / "hf"))  # HF_HUB_OFFLINE unset: the CLI's own default applies
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "hello", "--model", REPO,
                          "--max-tokens", "4", "--device", "cpu", "--dtype", "bfloat16"],
                         env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "tokens/s" in out.stdout
    probe = ("from splitserve.cli.models import config_model_by_name\nfrom splitserve.config import GatewayConfig\n"
             f"c = config_model_by_name(GatewayConfig(model={REPO!r}))\nprint(c.model)\nprint(c.served_model_name)")
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    model, served = out.stdout.strip().splitlines()[-2:]
    assert Path(model).name == COMMIT and served == REPO


def test_up_refuses_an_id_it_cannot_find_before_starting_anything(tmp_path):
    cache = tmp_path / "empty-cache"
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "up", "--model", "TinyOrg/absent", "--backend",
                          "emulated", "--log-dir", str(tmp_path / "logs")],
                         env={**_hf_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"), "COLUMNS": "300"},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    message = " ".join(out.stderr.replace("│", " ").split())
    assert "--model" in message and "TinyOrg/absent" in message and "HF_HUB_OFFLINE" in message
    assert not (tmp_path / "logs").exists()  # refused before any service started
