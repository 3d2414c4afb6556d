"""`splitserve up --model Org/Name --dtype bfloat16`, as `vllm serve Org/Name --dtype bfloat16` (issue 37).

The id is found in the local Hugging Face cache (laid out as huggingface_hub writes it,
HF_HUB_OFFLINE as the tests run), every service gets the snapshot directory, clients send the
id as the model, and the worker computes in bfloat16 and says so in its log.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from hub_cache_support import add_to_hub_cache
from real_model_support import splitserve_up

REPO = "TinyOrg/tiny-llama"


def test_up_serves_a_hugging_face_id_in_bfloat16(tiny_model_dirs, tmp_path, monkeypatch):
    snapshot = add_to_hub_cache(tmp_path / "hub", REPO, tiny_model_dirs["llama"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # inherited by `up` and its services
    logs = tmp_path / "logs"
    logs.mkdir()
    with splitserve_up(Path(REPO), logs, "--workers", "1", "--dtype", "bfloat16",
                       "--kv-cache-memory-bytes", str(16 << 20)) as up:
        models = httpx.get(f"{up['http']}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        reply = httpx.post(f"{up['http']}/v1/completions", timeout=120, json={
            "model": REPO, "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
    worker_log = (logs / "worker-0.log").read_text()
    ready = [line for line in worker_log.splitlines() if "engine ready" in line]
    assert ready and "torch.bfloat16" in ready[-1], worker_log[-2000:]
    assert f"serving {snapshot}" in worker_log  # the snapshot directory, not the id, reached the worker
