"""Models named by Hugging Face repository id (`--model Qwen/Qwen2.5-0.5B-Instruct`), as `vllm serve` takes them.

An id is looked up in the local Hugging Face cache first, with no network at all: where the
cache is, and whether the hub may be reached, are huggingface_hub's own settings (HF_HOME,
HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN), so a cache filled by `hf download`,
vLLM or transformers is found as they would find it. Only on a miss, and unless offline, is
the repository downloaded into that cache: the files the engine reads (config, tokenizer,
safetensors), not every format a repository carries (.bin, .gguf, ONNX ...).

A hub that does not answer must not hold a service's start for minutes: the hub is asked
once, with a short timeout (HF_HUB_ETAG_TIMEOUT, 10 s by default), before any download, and
every way of failing ends in `HubModelNotFoundError` naming the id and the cache directory.

huggingface_hub is imported on use: the gateway and the CLI import this module to ask
`is_repo_id` before anything heavy.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What the engine and the gateway read from a model repository.
TOKENIZER_PATTERNS = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken")
ENGINE_PATTERNS = (*TOKENIZER_PATTERNS, "*.safetensors")

# Org/Name: the Hub's ids are namespaced (the few legacy un-namespaced ones moved under an
# organisation), and a bare word is far more often a local directory that is missing.
_REPO_ID_SHAPE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubModelNotFoundError(FileNotFoundError):
    """A repository id that is neither in the local Hugging Face cache nor downloadable now."""

    def __init__(self, repo_id: str, cache_dir: Path, reason: str):
        super().__init__(f"model {repo_id!r} is not a local path, and the Hugging Face repository {repo_id} "
                         f"{reason} (cache: {cache_dir}; set HF_HOME or HF_HUB_CACHE for another, or fill it "
                         f"where the hub is reachable with `hf download {repo_id}`)")
        self.repo_id = repo_id
        self.cache_dir = cache_dir


def is_repo_id(model: str | os.PathLike) -> bool:
    """Whether `model` names a Hugging Face repository rather than a local file or directory:
    no such path exists and it has the Hub's Org/Name shape (checked by huggingface_hub)."""
    text = os.fspath(model)
    if not _REPO_ID_SHAPE.match(text) or text.lower().endswith(".gguf") or os.path.exists(text):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process uses (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_model_dir(repo_id: str, *, weights: bool = True, cache_dir: str | os.PathLike | None = None,
                  offline: bool | None = None, timeout_s: float | None = None) -> Path:
    """The local snapshot directory of `repo_id`: from the cache when it holds a usable one
    (config.json, and *.safetensors unless `weights` is False), else downloaded unless
    `offline` (default: huggingface_hub's HF_HUB_OFFLINE). `timeout_s` bounds the one request
    that asks the hub for the repository (default: HF_HUB_ETAG_TIMEOUT)."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()
    patterns = list(ENGINE_PATTERNS if weights else TOKENIZER_PATTERNS)
    try:
        cached = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True, allow_patterns=patterns))
    except (FileNotFoundError, ValueError, HfHubHTTPError):  # LocalEntryNotFoundError, IncompleteSnapshotError
        cached = None
    missing = _missing_files(cached, weights) if cached is not None else "is not in the local cache"
    if not missing:
        return cached
    if hub_offline() if offline is None else offline:
        raise HubModelNotFoundError(repo_id, cache, f"{missing} and HF_HUB_OFFLINE is set (no download)")
    timeout = constants.HF_HUB_ETAG_TIMEOUT if timeout_s is None else timeout_s
    try:
        # snapshot_download asks for the repository without a timeout: a hub that accepts the
        # connection and never answers would hold the start for good. Asked here, bounded, and
        # the commit it names is then downloaded (snapshot_download skips its own lookup).
        commit = HfApi().repo_info(repo_id, timeout=timeout).sha
        path = Path(snapshot_download(repo_id, revision=commit, cache_dir=cache, allow_patterns=patterns,
                                      etag_timeout=timeout))
    except Exception as err:  # network, auth, missing repo: all end the same way, with the cause
        raise HubModelNotFoundError(repo_id, cache, f"{missing} and could not be downloaded "
                                    f"({type(err).__name__}: {_first_line(err)})") from err
    missing = _missing_files(path, weights)
    if missing:
        raise HubModelNotFoundError(repo_id, cache, f"was downloaded to {path} but {missing}")
    return path


def _missing_files(snapshot: Path, weights: bool) -> str:
    """Why `snapshot` cannot be served ('' when it can)."""
    if not (snapshot / "config.json").is_file():
        return f"has no config.json in its cached snapshot {snapshot}"
    if weights and not any(snapshot.glob("*.safetensors")):
        return f"has no *.safetensors weights in its cached snapshot {snapshot} (the engine loads safetensors only)"
    return ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"
