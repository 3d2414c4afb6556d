"""GGUF checkpoints (llama.cpp's format) as the engine's model.

In the runtime layer because the engine, the gateway (for the tokenizer) and the CLI all
resolve a `.gguf` path to the same directory; the conversion imports torch and
transformers only when it runs.

A `.gguf` file is dequantized once into a plain float32 Hugging Face directory (safetensors,
tokenizer, chat template, generation config) in a cache keyed by the file's content, and
then served like any other model directory, as vLLM and llama.cpp users expect a `.gguf`
path to work. transformers (with the `gguf` and `accelerate` packages) does the reading and
dequantizing; this module checks the architecture first, saves a model the engine and
transformers load without any GGUF code, and fixes what the conversion loses.

Float32, not bfloat16: a Q4_1 weight is d * q + m with float16 d and m and a 4-bit q, up to
15 significant bits, which float32 holds exactly and bfloat16 (8 bits) would round. That is
the directory on disk; what the engine computes in is the worker's `--dtype`: auto keeps
float32 (the checkpoint's dtype, so exact), `--dtype bfloat16` rounds the weights once at load
and halves the weights' and the KV cache's memory, as vLLM serves a GGUF in 16 bits.

Reading a GGUF needs the `gguf` extra (`pip install "splitserve[gguf]"`: gguf and accelerate);
`check_gguf_extra` says so before a conversion starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

# GGUF `general.architecture` -> the Hugging Face class the engine runs for it. Mistral
# checkpoints converted by llama.cpp say "llama" (same tensors); transformers tells them apart.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp pre-tokenizer names whose rule splits every digit on its own before the GPT-2
# regex (llama-vocab.cpp); transformers' GGUF tokenizer conversion drops that step, which
# would tokenize "2024" as tokens the model never saw in training.
DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})

# Bump when the directories this module writes change, so old cache entries stop matching.
BUILDER_VERSION = 1
MARKER = "splitserve_gguf.json"
CACHE_ENV = "SPLITSERVE_MODEL_CACHE"

_GGUF_MAGIC = b"GGUF"


class UnsupportedGgufError(ValueError):
    """A GGUF file whose architecture the engine cannot run."""


def model_cache_root() -> Path:
    """Where converted models live: $SPLITSERVE_MODEL_CACHE, else the user's cache dir."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitserve" / "models"


def is_gguf_file(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def resolve_model_path(model: str | os.PathLike) -> Path:
    """The Hugging Face directory to load for `model`: itself, a `.gguf` file's dequantized copy,
    or a Hugging Face repository id's snapshot in the local cache (downloaded where the hub is
    reachable: splitserve.hub_models)."""
    from splitserve.hub_models import hub_model_dir, is_repo_id

    path = Path(model)
    if is_gguf_file(path):
        return dequantized_model_dir(path)
    if is_repo_id(model):
        return hub_model_dir(os.fspath(model))
    return path


# ---- metadata --------------------------------------------------------------------------------

# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike, keys: Iterator[str] | set[str] | None = None) -> dict[str, object]:
    """Metadata key/values of a GGUF file, reading only as far as the wanted `keys` (all when None).

    A reader of its own: gguf's GGUFReader parses every field (tens of thousands of vocabulary
    strings, seconds), while the architecture check needs the first few bytes.
    """
    wanted = None if keys is None else set(keys)
    path = Path(path)
    values: dict[str, object] = {}
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {_GGUF_MAGIC!r})")
        endian = "<"
        (version,) = struct.unpack("<I", f.read(4))
        if version & 0xFFFF == 0:  # a big-endian file: its small version number reads byte-swapped
            endian = ">"
            (version,) = struct.unpack(">I", struct.pack("<I", version))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")

        def scalar(fmt: str):
            size = struct.calcsize(fmt)
            return struct.unpack(endian + fmt, f.read(size))[0]

        def string() -> str:
            return f.read(scalar("Q")).decode("utf-8", errors="replace")

        def value(kind: int):
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item_kind, count = scalar("I"), scalar("Q")
                return [value(item_kind) for _ in range(count)]
            if kind not in _SCALAR_FORMATS:
                raise ValueError(f"{path}: unknown GGUF metadata value type {kind}")
            return scalar(_SCALAR_FORMATS[kind])

        scalar("Q")  # the tensor count: tensors are transformers' to read
        kv_count = scalar("Q")
        for _ in range(kv_count):
            key = string()
            values[key] = value(scalar("I"))
            if wanted is not None and wanted <= values.keys():
                break
    return values


# What transformers needs to read and dequantize a GGUF: the `gguf` extra of the distribution.
GGUF_EXTRA_MODULES = ("gguf", "accelerate")


class GgufExtraMissingError(ModuleNotFoundError):
    """Serving a .gguf without the packages that read it (`pip install "splitserve[gguf]"`)."""


def check_gguf_extra(find_spec: Callable[[str], object] | None = None) -> None:
    """GgufExtraMissingError naming what is missing, before a conversion that would fail deep in transformers."""
    import importlib.util

    find_spec = find_spec or importlib.util.find_spec
    missing = [name for name in GGUF_EXTRA_MODULES if find_spec(name) is None]
    if missing:
        raise GgufExtraMissingError(
            f"a .gguf model needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install \"splitserve[gguf]\" (a converted model directory or a Hugging Face id needs neither)",
            name=missing[0])


def gguf_architecture(path: str | os.PathLike) -> str:
    """`general.architecture` of a GGUF file."""
    arch = read_gguf_metadata(path, {"general.architecture"}).get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    return arch


def check_gguf_architecture(path: str | os.PathLike) -> str:
    """The file's architecture, or UnsupportedGgufError naming it and the ones the engine runs."""
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedGgufError(
            f"{path}: GGUF architecture {arch!r} is not supported; the engine runs "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (as {', '.join(sorted(set(GGUF_ARCHITECTURES.values())))})"
        )
    return arch


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def converted_dir_for(sha256: str, cache_root: Path | None = None) -> Path:
    """Where the dequantized directory of the GGUF file with this SHA-256 lives (present or not)."""
    return (cache_root or model_cache_root()) / "gguf" / f"{sha256[:16]}-v{BUILDER_VERSION}"


def _remembered_sha256(path: Path, memo_dir: Path) -> str:
    """The file's SHA-256, hashed once per (path, size, mtime): every worker and the gateway resolve
    the same .gguf at start, and hashing gigabytes each time would hold all of them up."""
    stat = path.stat()
    identity = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    memo = memo_dir / hashlib.sha256(identity.encode()).hexdigest()[:32]
    try:
        remembered = memo.read_text().strip()
        if len(remembered) == 64:
            return remembered
    except FileNotFoundError:
        pass
    digest = file_sha256(path)
    memo_dir.mkdir(parents=True, exist_ok=True)
    partial = memo.with_name(f".{memo.name}.{os.getpid()}")
    partial.write_text(digest + "\n")
    os.replace(partial, memo)  # whole or absent, whoever writes it
    return digest


# ---- conversion ------------------------------------------------------------------------------

def dequantized_model_dir(gguf_path: str | os.PathLike, *, sha256: str | None = None, cache_root: Path | None = None,
                          progress: Callable[[str], None] | None = None) -> Path:
    """The cached Hugging Face directory for a GGUF file, converting it on first use.

    Keyed by the file's SHA-256 (pass `sha256` when it is already known) and BUILDER_VERSION;
    safe when several processes ask at once (a worker and the gateway starting together):
    one converts under a file lock, into a temporary directory renamed into place, and the
    others wait and reuse it.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    check_gguf_architecture(gguf_path)  # before hashing or converting gigabytes
    root = (cache_root or model_cache_root()) / "gguf"
    digest = sha256 or _remembered_sha256(gguf_path, root / "digests")
    final = converted_dir_for(digest, cache_root)
    wanted = {"builder_version": BUILDER_VERSION, "gguf_sha256": digest}
    if marker_matches(final, wanted):
        return final
    check_gguf_extra()  # converting needs it; a converted directory in the cache does not
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{final.name}.lock"):
        if marker_matches(final, wanted):  # another process converted it while we waited
            return final
        if progress:
            progress(f"dequantizing {gguf_path.name} into {final} (once; later starts reuse it)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            convert_gguf(gguf_path, tmp)
            (tmp / MARKER).write_text(json.dumps({**wanted, "source": gguf_path.name}, indent=2) + "\n")
            make_readable(tmp)
            if final.exists():  # incomplete or from an older layout: ours to replace
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the GGUF model into `out_dir` as a float32 Hugging Face directory (no cache, no lock)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    arch = check_gguf_architecture(gguf_path)
    meta = read_gguf_metadata(gguf_path, _TOKEN_KEYS | {f"{arch}.context_length"})
    with _no_progress_bars():
        with _parse_gguf_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            quantized = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                             dtype=torch.float32)
        model = _plain_model(quantized, gguf_path)
        del quantized
        eos = _end_of_generation_ids(meta, tokenizer)
        model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos,
            pad_token_id=model.config.pad_token_id)
        model.save_pretrained(out_dir)

    _restore_pre_tokenizer(tokenizer, str(meta.get("tokenizer.ggml.pre", "")))
    context = meta.get(f"{arch}.context_length")
    if isinstance(context, int) and context > 0:
        tokenizer.model_max_length = context
    # Decoded text must be exactly the tokens' bytes, as the original HF tokenizers say.
    tokenizer.clean_up_tokenization_spaces = False
    for how_it_was_loaded in ("local_files_only", "is_local"):  # not the tokenizer's; varies by environment
        tokenizer.init_kwargs.pop(how_it_was_loaded, None)
    tokenizer.save_pretrained(out_dir)
    return out_dir


_TOKEN_KEYS = frozenset({"tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                         "tokenizer.ggml.eom_token_id"})


def _plain_model(quantized, gguf_path: Path):
    """The dequantized weights in an ordinary model of the same class, without a quantization_config
    (transformers refuses to save a model loaded from GGUF, and a plain directory needs no gguf)."""
    import torch
    from transformers import AutoModelForCausalLM

    settings = quantized.config.to_dict()
    # _name_or_path / _model_name_or_path: the GGUF's general.name, which names no loadable model
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures", "transformers_version"):
        settings.pop(key, None)
    config = type(quantized.config).from_dict(settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    name = type(model).__name__
    supported = sorted(set(GGUF_ARCHITECTURES.values()))
    if name not in supported:
        raise UnsupportedGgufError(f"{gguf_path}: transformers reads it as {name}, which the engine does not run; "
                                   f"supported: {', '.join(supported)}")
    state = {k: v.to(torch.float32) for k, v in quantized.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _end_of_generation_ids(meta: dict, tokenizer) -> list[int]:
    """EOS plus llama.cpp's end-of-turn and end-of-message tokens: every token that ends a reply."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def _restore_pre_tokenizer(tokenizer, pre: str) -> None:
    if pre not in DIGIT_SPLIT_PRE_TOKENIZERS:
        return
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    current = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    if current.get("type") != "ByteLevel":  # not the shape we know how to extend
        log.warning("GGUF pre-tokenizer %r: leaving transformers' %s pre-tokenizer as it is", pre, current.get("type"))
        return
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(current.get("add_prefix_space", False)),
                                 trim_offsets=bool(current.get("trim_offsets", True)),
                                 use_regex=bool(current.get("use_regex", True))),
    ])


@contextlib.contextmanager
def _no_progress_bars():
    """transformers draws a per-tensor progress bar with tqdm, which its own switch does not reach;
    callers print one line of their own instead (a worker's log is JSON lines, not a terminal)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as hf_logging

    original = getattr(gguf_loading, "tqdm", None)
    if original is not None:
        gguf_loading.tqdm = functools.partial(original, disable=True)
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading and saving weights
    try:
        yield
    finally:
        if original is not None:
            gguf_loading.tqdm = original
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _parse_gguf_once():
    """transformers parses the file anew for the config, the tokenizer and the weights, and rebuilds
    gguf's tensor-name map for every submodule: seconds each on a 49k-token vocabulary. Within
    this block one parse per file and one map per (arch, layers) serve them all. Both names are
    looked up on the gguf module at call time by transformers, so rebinding them is enough."""
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, mode="r"):
        key = (os.path.abspath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
        readers.clear()


# ---- cache helpers (shared with splitserve.model_presets) -----------------------------------

def marker_matches(directory: Path, wanted: dict, marker_name: str = MARKER) -> bool:
    """Whether `directory` is complete (its marker is written last) and was built for `wanted`."""
    marker = directory / marker_name
    try:
        recorded = json.loads(marker.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return False
    return all(recorded.get(k) == v for k, v in wanted.items())


def make_readable(directory: Path) -> None:
    """mkdtemp makes a private (0700) directory; a cache entry is as readable as any file the user writes."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock held for the block (released by the OS if the process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
