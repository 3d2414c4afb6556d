"""Small randomly initialised Hugging Face model directories, built fully offline.

Causal LMs (llama, qwen2, qwen3, mistral) through transformers; the masked-diffusion LLaDA
(`llada`) directly in the layout of GSAI-ML/LLaDA-8B-Instruct (config.json fields and
`model.transformer.*` safetensors names that workers/engine/models/llada.py loads), since
transformers has no LLaDA class to build it with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from workers.engine.models.llada import ARCHITECTURE_FLAGS

ARCHS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}
# Masked-diffusion models, written without transformers (_write_llada).
DIFFUSION_ARCHS = ("llada",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
TOKENIZER_VOCAB_SIZE = 259
# LLaDA's tokenizer carries a mask token for the diffusion process; the demo's follows the
# byte tokenizer's special tokens (the real one is <|mdm_mask|> = 126336).
MASK = "<|mdm_mask|>"
MASK_ID = 259
LLADA_TOKENIZER_VOCAB_SIZE = 260
LLADA_ROPE_THETA = 500000.0  # as LLaDA-8B
LLADA_RMS_NORM_EPS = 1e-5

MARKER = "splitserve_demo.json"
# Bump when the builder's output changes, so old directories stop matching.
BUILDER_VERSION = 1

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class DemoModelSpec:
    """Shape, seed and dtype of a demo model; validated on construction."""

    arch: str
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    seed: int = 0
    dtype: str = "float32"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    rope_scaling: dict | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS and self.arch not in DIFFUSION_ARCHS:
            raise ValueError(f"arch must be one of {sorted([*ARCHS, *DIFFUSION_ARCHS])}, got {self.arch!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.vocab_size < TOKENIZER_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be >= {TOKENIZER_VOCAB_SIZE} (256 bytes + 3 special tokens), got {self.vocab_size}"
            )
        if self.arch in DIFFUSION_ARCHS:
            if self.vocab_size < LLADA_TOKENIZER_VOCAB_SIZE:
                raise ValueError(f"vocab_size must be >= {LLADA_TOKENIZER_VOCAB_SIZE} for llada "
                                 f"(256 bytes + 3 special tokens + the mask token), got {self.vocab_size}")
            # LLaDA's head dim is d_model / n_heads and its RoPE has no scaling.
            if self.head_dim is not None:
                raise ValueError(f"head_dim must be None for llada (d_model / n_heads), got {self.head_dim!r}")
            if self.rope_scaling is not None:
                raise ValueError(f"rope_scaling must be None for llada, got {self.rope_scaling!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                "when head_dim is None"
            )
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"head_dim must be a positive int or None, got {self.head_dim!r}")
        # RoPE rotates pairs of channels.
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.resolved_head_dim}")
        if self.initializer_range <= 0:
            raise ValueError(f"initializer_range must be > 0, got {self.initializer_range}")
        if self.rope_scaling is not None and not (
            isinstance(self.rope_scaling, dict) and ("rope_type" in self.rope_scaling or "type" in self.rope_scaling)
        ):
            raise ValueError(f"rope_scaling must be None or a dict with a 'rope_type' key, got {self.rope_scaling!r}")

    @property
    def resolved_head_dim(self) -> int:
        """Per-head dimension: head_dim if set, else hidden_size // num_heads."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


def bench_model_spec() -> DemoModelSpec:
    """A ~56M-parameter llama (untied embeddings) for benchmarks."""
    return DemoModelSpec(
        arch="llama",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1408,
        vocab_size=32000,
        max_position_embeddings=4096,
    )


def _model_config(spec: DemoModelSpec) -> PretrainedConfig:
    kwargs = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        # Always explicit: Qwen3Config otherwise defaults to 128 regardless of hidden_size.
        head_dim=spec.resolved_head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if spec.rope_scaling is not None:
        # Copied because the config fills defaults (rope_theta) into the dict in place.
        kwargs["rope_parameters"] = dict(spec.rope_scaling)
    if spec.arch == "mistral":
        # Full attention everywhere, so every arch has the same KV-cache semantics.
        kwargs["sliding_window"] = None
    return ARCHS[spec.arch](**kwargs)


def _byte_tokenizer(model_max_length: int, with_mask: bool = False) -> PreTrainedTokenizerFast:
    # GPT-2 byte-to-unicode table: printable bytes map to themselves, the rest to chr(256 + n).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_to_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_to_char[b] = chr(b)
        else:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    assert sorted(byte_to_char.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())

    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, PAD)])
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [BOS_ID, EOS_ID, PAD_ID]
    if with_mask:
        tok.add_special_tokens([AddedToken(MASK, special=True)])
        assert tok.token_to_id(MASK) == MASK_ID
    # Like Llama 3: encode() prepends BOS unless add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        **({"mask_token": MASK} if with_mask else {}),
    )


def build_demo_model(spec: DemoModelSpec, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write a random model, byte-level tokenizer and generation config for `spec` into `out_dir`."""
    out_dir = Path(out_dir)
    marker = out_dir / MARKER
    wanted = {"builder_version": BUILDER_VERSION, "spec": json.loads(json.dumps(asdict(spec)))}
    if (out_dir / "config.json").exists() and not overwrite:
        if marker.exists() and json.loads(marker.read_text()) == wanted:
            return out_dir
        raise FileExistsError(
            f"{out_dir} already holds a model that was not built from this spec; "
            "pass overwrite=True to replace it or choose another directory"
        )
    # Removed first and written last, so an interrupted build never looks complete.
    marker.unlink(missing_ok=True)
    if spec.arch in DIFFUSION_ARCHS:
        _write_llada(spec, out_dir)
        marker.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
        return out_dir

    config = _model_config(spec)
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(DTYPES[spec.dtype])
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    # transformers 5 always writes safetensors (safe_serialization is gone) plus generation_config.json.
    model.save_pretrained(out_dir)
    _byte_tokenizer(spec.max_position_embeddings).save_pretrained(out_dir)
    marker.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
    return out_dir


def _llada_config(spec: DemoModelSpec) -> dict:
    """config.json in the layout of GSAI-ML/LLaDA-8B-Instruct's (without its remote-code auto_map)."""
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        # The architecture switches of modeling_llada.py, at LLaDA-8B's values (the loader's own list).
        **ARCHITECTURE_FLAGS,
        "d_model": spec.hidden_size,
        "n_heads": spec.num_heads,
        "n_kv_heads": spec.num_kv_heads,
        "n_layers": spec.num_layers,
        # The width of each of ff_proj (gate) and up_proj, as in LLaDA-8B (12288).
        "mlp_hidden_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "embedding_size": spec.vocab_size,
        "rope_theta": LLADA_ROPE_THETA,
        "rms_norm_eps": LLADA_RMS_NORM_EPS,
        "max_sequence_length": spec.max_position_embeddings,
        "mask_token_id": MASK_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "weight_tying": spec.tie_word_embeddings,
        "use_cache": False,
        "torch_dtype": spec.dtype,
    }


def _llada_weights(spec: DemoModelSpec) -> dict[str, torch.Tensor]:
    """Random weights under LLaDA's checkpoint names: N(0, initializer_range) matrices, unit norms."""
    d, kv_width, ff = spec.hidden_size, spec.num_kv_heads * (spec.hidden_size // spec.num_heads), spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.transformer.wte.weight": (spec.vocab_size, d)}
    for i in range(spec.num_layers):
        block = f"model.transformer.blocks.{i}."
        shapes |= {
            f"{block}attn_norm.weight": (d,), f"{block}q_proj.weight": (d, d), f"{block}k_proj.weight": (kv_width, d),
            f"{block}v_proj.weight": (kv_width, d), f"{block}attn_out.weight": (d, d), f"{block}ff_norm.weight": (d,),
            f"{block}ff_proj.weight": (ff, d), f"{block}up_proj.weight": (ff, d), f"{block}ff_out.weight": (d, ff),
        }
    shapes["model.transformer.ln_f.weight"] = (d,)
    if not spec.tie_word_embeddings:
        shapes["model.transformer.ff_out.weight"] = (spec.vocab_size, d)
    # An explicit generator: the caller's global RNG is left alone.
    generator = torch.Generator().manual_seed(spec.seed)
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensor = torch.ones(shape)
        else:
            tensor = torch.randn(shape, generator=generator) * spec.initializer_range
        weights[name] = tensor.to(DTYPES[spec.dtype]).contiguous()
    return weights


def _write_llada(spec: DemoModelSpec, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(_llada_config(spec), indent=2) + "\n")
    save_file(_llada_weights(spec), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _byte_tokenizer(spec.max_position_embeddings, with_mask=True).save_pretrained(out_dir)
