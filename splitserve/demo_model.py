"""Small randomly initialised Hugging Face causal-LM directories, built fully offline."""

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

ARCHS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
TOKENIZER_VOCAB_SIZE = 259

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
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {self.arch!r}")
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


def _byte_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
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
