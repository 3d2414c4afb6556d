"""Which family a model directory belongs to, from its config.json (torch-free: the gateway,
the CLI and the workers all ask before anything heavy is loaded)."""

from __future__ import annotations

import json
from pathlib import Path

# config.json `model_type`s of diffusion LLMs (dLLM-Serve): served by the diffusion engine,
# their requests placed whole on diffusion workers and taking the denoising knobs.
DIFFUSION_MODEL_TYPES = frozenset({"llada"})


def is_diffusion_model(model_dir: str | Path) -> bool:
    """A diffusion model's directory (config.json `model_type` in DIFFUSION_MODEL_TYPES)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") in DIFFUSION_MODEL_TYPES
    except (OSError, ValueError):
        return False
