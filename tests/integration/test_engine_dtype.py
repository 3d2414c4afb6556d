"""`--dtype` (vLLM's flag) for safetensors and .gguf models (issue 37).

A .gguf is dequantized once into a float32 directory; the engine computes in what `--dtype`
says: auto keeps float32 on the CPU, bfloat16 rounds the weights once at load and halves the
weights' and the KV cache's memory. The dtype is in the engine's start line, which a worker
logs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.core import SamplingParams
from workers.engine import LLM

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from splitserve.cli.demo_model import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, vocab_size=300, max_position_embeddings=256, seed=3)
    return build_demo_model(spec, tmp_path_factory.mktemp("dtype") / "model")


@pytest.mark.parametrize("flag, dtype", [("bfloat16", torch.bfloat16), ("half", torch.float16),
                                         ("float", torch.float32), ("auto", torch.float32)])
def test_the_engine_loads_and_generates_in_the_dtype_asked(tiny_dir, caplog, flag, dtype):
    caplog.set_level(logging.INFO, logger="workers.engine.engine")
    llm = LLM(str(tiny_dir), dtype=flag, device="cpu", kv_cache_memory_bytes=4 << 20, num_threads=1)
    runner = llm.engine.runner
    assert runner.dtype == dtype
    assert {p.dtype for p in runner.model.parameters()} == {dtype}
    assert runner.kv_cache.dtype == dtype
    out = llm.generate(["hello"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert ready and str(dtype) in ready[-1]  # what a worker's log says


def test_a_gguf_is_served_in_bfloat16(caplog):
    """The real SmolLM2 .gguf (from the model cache; skipped, saying why, where it cannot be had)."""
    from splitserve.model_presets import SMOLLM2_135M_INSTRUCT, ModelUnavailableError, fetch_preset_gguf

    try:
        gguf_path = fetch_preset_gguf(SMOLLM2_135M_INSTRUCT)
    except ModelUnavailableError as err:
        pytest.skip(f"the SmolLM2 .gguf is not available: {err}")
    caplog.set_level(logging.INFO, logger="workers.engine.engine")
    llm = LLM(str(gguf_path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=256)
    runner = llm.engine.runner
    assert runner.spec.checkpoint_dtype == torch.float32  # the dequantized directory on disk
    assert runner.dtype == torch.bfloat16 and {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4 and out.text.strip()
    assert any("torch.bfloat16" in r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))


@pytest.mark.parametrize("args, expected", [
    (["--dtype", "float8"], "dtype must be one of auto | bfloat16 | float16 | float32 | half | float, got 'float8'"),
    (["--dtype", "bfloat16", "--backend", "emulated"], "emulated backend"),
])
def test_up_refuses_a_dtype_it_cannot_serve_before_starting_anything(tmp_path, args, expected):
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "up", *args, "--log-dir", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "300"})
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    message = " ".join(out.stderr.replace("│", " ").split())
    assert "--dtype" in message and expected in message
    assert not (tmp_path / "logs").exists()
