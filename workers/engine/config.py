"""Engine configuration and the model description read from a Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from splitserve.core import make_batch_policy
from splitserve.core.shapes import parse_sizes

if TYPE_CHECKING:  # torch is imported on use: the emulated backend never loads it
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
# Rope types whose frequencies do not depend on the running sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = ("bfloat16", "float16", "float32")
# vLLM's --dtype spellings: half and float name float16 and float32 there.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPE_CHOICES = ("auto", *_DTYPES, *DTYPE_ALIASES)


def normalize_dtype(name: str) -> str:
    """'auto' or the canonical name of a --dtype value (torch-free: the CLI checks before starting workers)."""
    name = DTYPE_ALIASES.get(name, name)
    if name != "auto" and name not in _DTYPES:
        raise ValueError(f"dtype must be one of {' | '.join(DTYPE_CHOICES)}, got {name!r}")
    return name


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    name = normalize_dtype(name)
    if name == "auto":
        raise ValueError("dtype must be a concrete dtype here, got 'auto'")
    return getattr(torch, name)


@dataclass
class EngineConfig:
    """Options of one engine instance; defaults suit a laptop CPU."""

    model: str
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA, float32 on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None  # CPU default: enough for max_num_seqs full sequences, at most 2 GiB
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    batch_policy: str = "fcfs"
    batch_policy_options: dict = field(default_factory=dict)  # JSON-able, as `make_batch_policy` takes them
    # A fitted performance model's JSON (`splitserve profile --out`), given to a batch policy
    # that predicts step latency (slo_aware); the emulated engine gives its own model without one.
    perf_model: str = ""
    # auto: flash-attn on CUDA where it fits, else on the CPU the compiled paged decode kernel
    # (workers/engine/kernels) where it builds, and on CUDA without flash-attn the Triton paged
    # decode kernel (workers/engine/triton_attention.py) where triton imports, else torch SDPA;
    # sdpa: torch only; cpu_kernel: the CPU kernel or an error; flash: flash-attn or an error;
    # triton: the Triton decode kernel on CUDA or an error.
    attention_backend: str = "auto"
    # CPU linear layers: auto/onednn run them on oneDNN over weights reordered once
    # (workers/engine/cpu_linear.py, 1.3-1.9x faster than torch's default here); torch keeps F.linear.
    cpu_linear: str = "auto"
    # LAPS captured shapes: steps of short prefills padded to a (tokens, batch) bucket of
    # these sizes (`workers/engine/captured_shapes.py`); off: every step runs unpadded.
    captured_shapes: bool = False
    shape_tokens: str = "8,16,32,64,128,256"
    shape_batches: str = "1,2,4,8,16,32,64"
    # How a bucket runs: cuda_graph (captured once, replayed), eager or compile (torch.compile
    # per bucket); auto: cuda_graph on CUDA, eager on the CPU.
    captured_shapes_executor: str = "auto"
    max_captured_buckets: int = 64  # buckets (and CUDA graphs) kept; a step of another bucket runs unpadded
    # Decode steps as captured shapes (vLLM's decode CUDA graphs): a step of decodes only is
    # padded to the next of `decode_graph_batches` and run as a bucket (1 token per row), a
    # graph replay on CUDA. auto: on a CUDA device; on: on the CPU too (eager: the layout only,
    # what the CPU tests run); off. On the GPU check's H200 a batch-1 decode of an 8B model was
    # 1,565 kernel launches, 31 ms of host time for 6.6 ms of device work.
    decode_graphs: str = "auto"
    decode_graph_batches: str = "1,2,4,8,16,24,32,48,64,96,128,192,256"
    # Compiled structured-output grammars kept (workers/engine/structured.py), LRU by the constraint.
    structured_output_cache_size: int = 256
    # Diffusion models (LLaDA; workers/diffusion): dual = Refresh at each block start, Reuse
    # the cache within the block (dLLM-Serve §2.3); none = every step recomputes the sequence.
    dllm_cache: str = "dual"
    max_num_logits: int = 2048  # logit rows materialised at once (dLLM-Serve §4.3)
    sparse_kv: str = "head"  # head (dLLM-Serve §4.5) | uniform (Sparse-dLLM), for retention_ratio < 1
    diffusion_policy: str = "phase_multiplexed"  # | static (request-level batches, the baseline)
    static_batch_size: int = 8
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default
    seed: int = 0  # draws per-request seeds for requests that bring none
    # Produce text with every token; when off, text is still decoded for stop strings.
    detokenize: bool = True

    def validate(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_captured_buckets",
                     "max_num_logits", "static_batch_size", "structured_output_cache_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.decode_graphs not in ("auto", "on", "off"):
            raise ValueError(f"decode_graphs must be auto, on or off, got {self.decode_graphs!r}")
        parse_sizes("decode_graph_batches", self.decode_graph_batches)
        if self.captured_shapes_executor not in ("auto", "eager", "compile", "cuda_graph"):
            raise ValueError("captured_shapes_executor must be one of auto, eager, compile, cuda_graph, "
                             f"got {self.captured_shapes_executor!r}")
        for name, value, choices in (("dllm_cache", self.dllm_cache, ("dual", "none")),
                                     ("sparse_kv", self.sparse_kv, ("head", "uniform")),
                                     ("diffusion_policy", self.diffusion_policy, ("phase_multiplexed", "static"))):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        if self.attention_backend not in ("auto", "sdpa", "flash", "cpu_kernel", "triton"):
            raise ValueError("attention_backend must be auto, sdpa, flash, cpu_kernel or triton, "
                             f"got {self.attention_backend!r}")
        if self.cpu_linear not in ("auto", "onednn", "torch"):
            raise ValueError(f"cpu_linear must be auto, onednn or torch, got {self.cpu_linear!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        normalize_dtype(self.dtype)
        # The batch policy and its options, before any weights are loaded (ValueError naming them).
        if not isinstance(self.batch_policy_options, dict):
            raise ValueError(f"batch_policy_options must be a JSON object, got {self.batch_policy_options!r}")
        make_batch_policy(self.batch_policy, **self.batch_policy_options)
        if self.perf_model and not self.perf_model.startswith("redis:") and not Path(self.perf_model).is_file():
            raise ValueError(f"perf_model: {self.perf_model!r} is not a file")


@dataclass
class ModelSpec:
    """What the engine needs to know about a Llama-family checkpoint."""

    model_dir: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    layer_sliding_windows: list[int | None]
    eos_token_ids: list[int]
    checkpoint_dtype: torch.dtype
    hf_config: object = field(repr=False)


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read config.json (and generation_config.json) of a local model directory.

    A `.gguf` file is accepted too: it is dequantized once into a cached directory
    (workers/engine/gguf.py), whose path is the spec's `model_dir`.
    """
    import torch
    from transformers import AutoConfig

    from splitserve.gguf import resolve_model_path

    path = resolve_model_path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model directory {str(path)!r} has no *.safetensors weight files")
    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or '(none in config.json)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if arch == "MistralForCausalLM":
        windows = [window] * cfg.num_hidden_layers
    elif layer_types and getattr(cfg, "use_sliding_window", False):
        windows = [window if t == "sliding_attention" else None for t in layer_types]
    else:
        windows = [None] * cfg.num_hidden_layers
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    return ModelSpec(
        model_dir=path,
        architecture=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act=cfg.hidden_act,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        max_position_embeddings=cfg.max_position_embeddings,
        layer_sliding_windows=windows,
        eos_token_ids=_eos_token_ids(path, cfg),
        checkpoint_dtype=dtype,
        hf_config=cfg,
    )


def _eos_token_ids(path: Path, cfg) -> list[int]:
    # generation_config.json wins: chat models list several end tokens there.
    eos = None
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


DEFAULT_BLOCK_SIZE = 16
FLASH_BLOCK_SIZE = 256  # flash-attn's paged-KV kernels take only page sizes that are multiples of 256


def resolve_block_size(block_size: int, device: str, attention_backend: str, *, real_engine: bool,
                       have_flash: bool | None = None, cuda_available: bool | None = None) -> int:
    """Tokens per KV block; 0 (auto): 256 where flash-attn will run (a real engine on CUDA with
    flash-attn installed and the backend auto or flash) — with 16 its paged kernels cannot
    run and every step would gather the KV into dense tensors; else 16. A given size is kept
    (the engine reports a mismatch with flash when it starts). torch and flash-attn are
    looked up only for a real engine that may be on CUDA."""
    if block_size < 0:
        raise ValueError(f"block_size must be >= 0 (0: auto), got {block_size}")
    if block_size:
        return block_size
    if not real_engine or device == "cpu" or attention_backend not in ("auto", "flash"):
        return DEFAULT_BLOCK_SIZE
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not (device.startswith("cuda") or (device == "auto" and cuda_available)):
        return DEFAULT_BLOCK_SIZE
    if have_flash is None:
        from workers.engine.attention import HAVE_FLASH_ATTN as have_flash
    return FLASH_BLOCK_SIZE if have_flash else DEFAULT_BLOCK_SIZE
