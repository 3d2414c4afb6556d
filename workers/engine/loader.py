"""Build a model from a Hugging Face directory and load its safetensors weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from workers.engine.config import ModelSpec
from workers.engine.models import MODEL_REGISTRY

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors shards (from the index when there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"weight shards listed in {index.name} are missing: {missing}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no *.safetensors weight files")
    return files


def load_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device, max_positions: int, use_flash: bool):
    """Instantiate the architecture on `device` in `dtype` and fill in the checkpoint."""
    cls = MODEL_REGISTRY[spec.architecture]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(spec, max_positions, use_flash)
    finally:
        torch.set_default_dtype(previous)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in weight_files(spec.model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and spec.tie_word_embeddings:
                    continue
                _load_one(model, params, name, f.get_tensor(name), loaded)
    missing = sorted(_expected_names(model, params) - loaded - ({"lm_head.weight"} if spec.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"checkpoint in {str(spec.model_dir)!r} lacks weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return model.eval()


def _load_one(model, params: dict, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
    for ckpt_part, (fused_part, shard) in model.stacked_params.items():
        if f".{ckpt_part}." not in name:
            continue
        fused_name = name.replace(f".{ckpt_part}.", f".{fused_part}.")
        param = params[fused_name]
        sizes = model.shard_sizes(fused_part)
        offset = sum(sizes[:shard])
        target = param.data.narrow(0, offset, sizes[shard])
        _copy(target, tensor, name)
        loaded.add(f"{fused_name}#{shard}")
        return
    if name not in params:
        log.warning("ignoring checkpoint tensor %s (no such parameter)", name)
        return
    _copy(params[name].data, tensor, name)
    loaded.add(name)


def _expected_names(model, params: dict) -> set[str]:
    fused_parts = {fused for fused, _ in model.stacked_params.values()}
    expected = set()
    for name in params:
        fused = next((p for p in fused_parts if f".{p}." in name), None)
        if fused is None:
            expected.add(name)
        else:
            expected |= {f"{name}#{i}" for i in range(len(model.shard_sizes(fused)))}
    return expected


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor.to(dtype=target.dtype))
