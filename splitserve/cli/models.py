"""The models the commands serve: a Hugging Face id resolved to a local snapshot, the demo model
built once; shared by `up`, `serve` and the demo commands."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import typer
from rich.console import Console

console = Console()

DEFAULT_DEMO_DIR = Path(os.environ.get("SPLITSERVE_DEMO_MODEL_DIR", "models/demo-llama"))


def quiet_hf() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def ensure_demo_model(path: Path = DEFAULT_DEMO_DIR) -> Path:
    """Build the default demo model once; later calls reuse it."""
    quiet_hf()
    from splitserve.cli.demo_model import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         intermediate_size=704, vocab_size=259, max_position_embeddings=2048,
                         initializer_range=0.2)  # vocab = the byte tokenizer's, so every id decodes
    try:
        return build_demo_model(spec, path)
    except FileExistsError:  # an older demo model: this directory is ours to replace
        return build_demo_model(spec, path, overwrite=True)


def model_by_name(model: str | None, *, weights: bool, flag: str = "--model") -> tuple[str | None, str]:
    """A Hugging Face repository id given as the model -> (its snapshot directory in the local
    Hugging Face cache, the id: the name it is served under, as vLLM names it); a path comes
    back as it is, with no name. Resolved once here, before the services start, so every
    service gets a directory: a cache hit needs no network, a miss downloads unless
    HF_HUB_OFFLINE is set (`weights`: the safetensors too, not only config and tokenizer)."""
    if not model:
        return model, ""
    from splitserve.hub_models import HubModelNotFoundError, hub_model_dir, is_repo_id

    if not is_repo_id(model):
        return model, ""
    console.print(f"resolving the Hugging Face model {model} ...")
    try:
        return str(hub_model_dir(model, weights=weights)), model
    except HubModelNotFoundError as err:
        raise typer.BadParameter(str(err), param_hint=flag) from None


def config_model_by_name(config):
    """`serve worker|gateway --model Org/Name`: the config with the snapshot directory as its model
    (and the id as the gateway's served_model_name unless one is given)."""
    model = getattr(config, "model", "")
    path, name = model_by_name(model, weights=getattr(config, "backend", "real") == "real")
    if not name:
        return config
    changes = {"model": path}
    if hasattr(config, "served_model_name") and not config.served_model_name:
        changes["served_model_name"] = name
    return dataclasses.replace(config, **changes)
