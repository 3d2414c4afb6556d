"""LLaDA, the masked-diffusion LLM (GSAI-ML/LLaDA-8B-Instruct layout), in plain PyTorch.

A Llama-shaped encoder with **bidirectional** attention: every position attends to every
other (no causal mask), so one forward predicts a token for every masked position.
Pre-norm blocks of RMSNorm, RoPE attention (GQA when n_kv_heads < n_heads) and a SwiGLU
MLP; a final RMSNorm and an LM head (or the tied input embedding).

Checkpoint layout (names and shapes as the public `modeling_llada.py` builds them, its
`LLaDALlamaBlock` with `activation_type: "silu"`): per block `attn_norm`, `q_proj`, `k_proj`,
`v_proj`, `attn_out`, `ff_norm`, `ff_proj` (the gate: `silu(ff_proj(x)) * up_proj(x)`),
`up_proj`, `ff_out` (down). `mlp_hidden_size` is the width of *each* of `ff_proj` and
`up_proj` (12288 for LLaDA-8B), not their combined width: that block builds both as
`Linear(d_model, mlp_hidden_size)` and `ff_out` as `Linear(mlp_hidden_size, d_model)`
(the silu activation's output multiplier is 1; only OLMo's fused `swiglu` halves it), and
only that reading gives LLaDA-8B its 8.02 B parameters (docs/perf_model.md).

For dLLM-Serve's two phases (dLLM-Serve §2.3) the model has two forms:

* Refresh — `forward_with_kv(...)` computes the whole sequence and returns every
  layer's keys/values (`LayerKV`, RoPE already applied, so a cached key stays valid at its
  position whatever the later queries are);
* Reuse — `forward_queries(...)` computes only some query positions (the active block):
  their fresh keys/values replace the cached ones at those positions, every other
  position's keys/values come from the cache, and only the queries get logits.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "model.transformer."

# Fields of the real config.json that select other architectures in modeling_llada.py; when
# present they must hold the LLaDA-8B value this implementation computes.
ARCHITECTURE_FLAGS: dict[str, object] = {
    "activation_type": "silu",
    "block_type": "llama",
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "rope": True,
    "alibi": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "attention_layer_norm": False,
    "scale_logits": False,
    "input_emb_norm": False,
    "block_group_size": 1,
    "multi_query_attention": None,
    "rope_scaling": None,
}


@dataclass(frozen=True)
class LladaConfig:
    """The fields of a LLaDA config.json that shape the model; validated on construction."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int  # width of each of ff_proj (gate) and up_proj
    vocab_size: int
    embedding_size: int  # rows of wte / the LM head; >= vocab_size (padded for throughput)
    rope_theta: float
    rms_norm_eps: float
    max_sequence_length: int
    mask_token_id: int
    weight_tying: bool

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size",
                     "embedding_size", "max_sequence_length"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not _is_number(value) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.weight_tying, bool):
            raise ValueError(f"weight_tying must be a bool, got {self.weight_tying!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"d_model / n_heads (head dim {self.head_dim}) must be even for RoPE")
        if self.embedding_size < self.vocab_size:
            raise ValueError(f"embedding_size ({self.embedding_size}) must be >= vocab_size ({self.vocab_size})")
        if not _is_int(self.mask_token_id) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be an int in [0, vocab_size={self.vocab_size}), "
                             f"got {self.mask_token_id!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> LladaConfig:
        """From the parsed config.json; errors name `source` and the field."""
        if raw.get("model_type") != "llada":
            raise ValueError(f"{source}: model_type must be 'llada', got {raw.get('model_type')!r}")
        for name, wanted in ARCHITECTURE_FLAGS.items():
            if name in raw and raw[name] != wanted and not (wanted is None and raw[name] is False):
                raise ValueError(f"{source}: {name} = {raw[name]!r} is not supported (LLaDA-8B has {wanted!r})")

        def field(name: str):
            if name not in raw or raw[name] is None:
                raise ValueError(f"{source}: field {name!r} is missing")
            return raw[name]

        # As modeling_llada.py: n_kv_heads null means plain multi-head attention, mlp_hidden_size
        # null means mlp_ratio * d_model, embedding_size null means vocab_size.
        n_kv_heads = raw["n_kv_heads"] if raw.get("n_kv_heads") is not None else field("n_heads")
        if raw.get("mlp_hidden_size") is None and raw.get("mlp_ratio") is not None:
            mlp_hidden_size = raw["mlp_ratio"] * field("d_model")
        else:
            mlp_hidden_size = field("mlp_hidden_size")
        embedding_size = raw["embedding_size"] if raw.get("embedding_size") is not None else field("vocab_size")
        try:
            return cls(
                d_model=field("d_model"),
                n_heads=field("n_heads"),
                n_kv_heads=n_kv_heads,
                n_layers=field("n_layers"),
                mlp_hidden_size=mlp_hidden_size,
                vocab_size=field("vocab_size"),
                embedding_size=embedding_size,
                rope_theta=field("rope_theta"),
                rms_norm_eps=field("rms_norm_eps"),
                max_sequence_length=field("max_sequence_length"),
                mask_token_id=field("mask_token_id"),
                weight_tying=field("weight_tying"),
            )
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> LladaConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{str(model_dir)!r} has no config.json")
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: must hold a JSON object")
        return cls.from_dict(raw, source=str(path))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class LayerKV:
    """One layer's keys and values, [batch, n_kv_heads, positions, head_dim], keys after RoPE."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class LladaOutput:
    logits: torch.Tensor  # [batch, query positions, vocab_size] float32
    kv: list[LayerKV]  # per layer; for forward_queries the queries' fresh keys/values only


class RMSNorm(nn.Module):
    """Normalised in float32 and cast back before the weight, as modeling_llada's RMSLayerNorm."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LladaBlock(nn.Module):
    """Pre-norm block: x + attn_out(attention(attn_norm(x))), then x + ff_out(swiglu(ff_norm(x)))."""

    def __init__(self, config: LladaConfig, device=None, dtype=None):
        super().__init__()
        d, kv_width, ff = config.d_model, config.n_kv_heads * config.head_dim, config.mlp_hidden_size
        factory = dict(bias=False, device=device, dtype=dtype)
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.attn_norm = RMSNorm(d, config.rms_norm_eps, device, dtype)
        self.q_proj = nn.Linear(d, d, **factory)
        self.k_proj = nn.Linear(d, kv_width, **factory)
        self.v_proj = nn.Linear(d, kv_width, **factory)
        self.attn_out = nn.Linear(d, d, **factory)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps, device, dtype)
        self.ff_proj = nn.Linear(d, ff, **factory)
        self.up_proj = nn.Linear(d, ff, **factory)
        self.ff_out = nn.Linear(ff, d, **factory)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None,
        cached: LayerKV | None = None,
        query_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LayerKV]:
        """`hidden` [B, S, d]. Without `cached` the S positions attend to each other; with it
        they are the positions `query_index` [B, S] of the cached sequence, and attend to the
        cache with their own fresh keys/values in place of the cached ones there."""
        batch, length, _ = hidden.shape
        normed = self.attn_norm(hidden)
        q = self.q_proj(normed).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(normed).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(normed).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        fresh = LayerKV(k, v)
        if cached is None:
            keys, values = k, v
        else:
            index = query_index[:, None, :, None].expand(batch, self.n_kv_heads, length, self.head_dim)
            # Out of place: the caller's cache is not changed (Reuse decides what to keep).
            keys = cached.keys.scatter(2, index, k.to(cached.keys.dtype))
            values = cached.values.scatter(2, index, v.to(cached.values.dtype))
        # Query head h reads key/value head h // (n_heads / n_kv_heads), as modeling_llada's GQA.
        repeat = self.n_heads // self.n_kv_heads
        if repeat > 1:
            keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]
        # Bidirectional: no causal mask; padding keys (key_mask False) are the only ones hidden.
        attended = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=attn_mask)
        hidden = hidden + self.attn_out(attended.transpose(1, 2).reshape(batch, length, -1))
        normed = self.ff_norm(hidden)
        hidden = hidden + self.ff_out(F.silu(self.ff_proj(normed)) * self.up_proj(normed))
        return hidden, fresh


def _rope_cos_sin(config: LladaConfig, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, S, head_dim] in float32 (LLaDA's rope_full_precision) for `positions` [B, S]."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    freqs = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :, :]
    return emb.cos(), emb.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (first half of each head paired with the second), computed in float32."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class LladaModel(nn.Module):
    """LLaDA mask predictor. Parameter names are the checkpoint's without `model.` in front."""

    def __init__(self, config: LladaConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        modules = dict(
            wte=nn.Embedding(config.embedding_size, config.d_model, device=device, dtype=dtype),
            blocks=nn.ModuleList(LladaBlock(config, device, dtype) for _ in range(config.n_layers)),
            ln_f=RMSNorm(config.d_model, config.rms_norm_eps, device, dtype),
        )
        if not config.weight_tying:
            modules["ff_out"] = nn.Linear(config.d_model, config.embedding_size, bias=False,
                                          device=device, dtype=dtype)
        self.transformer = nn.ModuleDict(modules)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab_size] float32 for `input_ids` [B, T].

        `attention_mask` [B, T] bool: False marks padding keys nobody attends to (their own rows
        are computed but meaningless). `positions` [B, T] are the RoPE positions, default
        0..T-1; a left-padded row equals its unpadded self only with positions counted from
        its first real token (`positions_from_mask`).
        """
        return self.forward_with_kv(input_ids, attention_mask, positions).logits

    def forward_with_kv(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> LladaOutput:
        """The Refresh phase (dLLM-Serve §2.3): `forward`'s logits plus every layer's keys and
        values for all T positions, [B, n_kv_heads, T, head_dim], the cache Reuse reads."""
        batch, length = self._check_ids(input_ids, "input_ids")
        key_mask = self._check_mask(attention_mask, batch, length)
        positions = self._positions(positions, batch, length, input_ids.device, "positions")
        rope = _rope_cos_sin(self.config, positions, input_ids.device)
        hidden = self.transformer.wte(input_ids)
        kv: list[LayerKV] = []
        for block in self.transformer.blocks:
            hidden, layer_kv = block(hidden, rope, key_mask)
            kv.append(layer_kv)
        return LladaOutput(self._logits(hidden), kv)

    def forward_queries(
        self,
        input_ids: torch.Tensor,
        query_index: torch.Tensor,
        cached_kv: list[LayerKV],
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> LladaOutput:
        """The Reuse phase (dLLM-Serve §2.3): logits for the query tokens only.

        `input_ids` [B, S] are the tokens now at positions `query_index` [B, S] (distinct per
        row) of a sequence whose keys/values `cached_kv` holds for all T positions (as
        `forward_with_kv` returns them). Per layer the queries' fresh keys/values
        stand in for the cached ones at their positions; the rest are read from the cache,
        stale or not. `attention_mask` [B, T] masks cached padding keys; `positions` [B, S]
        are the queries' RoPE positions (default `query_index`). Returns the queries' logits
        [B, S, vocab_size] and, per layer, their fresh keys/values [B, n_kv_heads, S, head_dim].
        """
        batch, length = self._check_ids(input_ids, "input_ids")
        if len(cached_kv) != self.config.n_layers:
            raise ValueError(f"cached_kv has {len(cached_kv)} layers, the model n_layers={self.config.n_layers}")
        cached_len = cached_kv[0].keys.shape[2]
        expected = (batch, self.config.n_kv_heads, cached_len, self.config.head_dim)
        for layer, layer_kv in enumerate(cached_kv):
            if tuple(layer_kv.keys.shape) != expected or tuple(layer_kv.values.shape) != expected:
                raise ValueError(f"cached_kv[{layer}] keys/values must be {expected}, got "
                                 f"{tuple(layer_kv.keys.shape)}/{tuple(layer_kv.values.shape)}")
        if query_index.shape != (batch, length) or query_index.dtype != torch.long:
            raise ValueError(f"query_index must be a long tensor of shape {(batch, length)}, "
                             f"got {query_index.dtype} {tuple(query_index.shape)}")
        if length and (query_index.min() < 0 or query_index.max() >= cached_len):
            raise ValueError(f"query_index must lie in [0, {cached_len}) (the cached length)")
        ordered = query_index.sort(dim=1).values
        if length > 1 and (ordered[:, 1:] == ordered[:, :-1]).any():
            raise ValueError("query_index must not repeat a position within a row")
        key_mask = self._check_mask(attention_mask, batch, cached_len)
        positions = query_index if positions is None else positions
        positions = self._positions(positions, batch, length, input_ids.device, "positions")
        rope = _rope_cos_sin(self.config, positions, input_ids.device)
        hidden = self.transformer.wte(input_ids)
        fresh: list[LayerKV] = []
        for block, layer_kv in zip(self.transformer.blocks, cached_kv):
            hidden, layer_fresh = block(hidden, rope, key_mask, layer_kv, query_index)
            fresh.append(layer_fresh)
        return LladaOutput(self._logits(hidden), fresh)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer.ln_f(hidden)
        head = self.transformer.wte.weight if self.config.weight_tying else self.transformer.ff_out.weight
        # Rows past vocab_size are embedding padding, not tokens: no logits for them.
        return F.linear(hidden, head[: self.config.vocab_size]).float()

    def _check_ids(self, input_ids: torch.Tensor, name: str) -> tuple[int, int]:
        if input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"{name} must be a long tensor [batch, positions], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        return input_ids.shape[0], input_ids.shape[1]

    def _check_mask(self, attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        if attention_mask.shape != (batch, length):
            raise ValueError(f"attention_mask must have shape {(batch, length)}, got {tuple(attention_mask.shape)}")
        key_mask = attention_mask.to(torch.bool)
        if length and not key_mask.any(dim=1).all():
            raise ValueError("attention_mask hides every position of some row; each row needs one real token")
        return key_mask

    def _positions(self, positions, batch: int, length: int, device, name: str) -> torch.Tensor:
        if positions is None:
            if length > self.config.max_sequence_length:
                raise ValueError(f"{length} positions exceed max_sequence_length={self.config.max_sequence_length}")
            return torch.arange(length, device=device).expand(batch, length)
        if positions.shape != (batch, length):
            raise ValueError(f"{name} must have shape {(batch, length)}, got {tuple(positions.shape)}")
        if positions.numel() and (positions.min() < 0 or positions.max() >= self.config.max_sequence_length):
            raise ValueError(f"{name} must lie in [0, max_sequence_length={self.config.max_sequence_length})")
        return positions


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions of a left-padded batch: each row counts from its first real token."""
    counted = attention_mask.long().cumsum(dim=1) - 1
    return counted.clamp(min=0)


def expected_weight_shapes(config: LladaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `config` must hold, by its checkpoint name."""
    d, kv_width, ff = config.d_model, config.n_kv_heads * config.head_dim, config.mlp_hidden_size
    shapes: dict[str, tuple[int, ...]] = {f"{CHECKPOINT_PREFIX}wte.weight": (config.embedding_size, d)}
    for i in range(config.n_layers):
        block = f"{CHECKPOINT_PREFIX}blocks.{i}."
        shapes |= {
            f"{block}attn_norm.weight": (d,),
            f"{block}q_proj.weight": (d, d),
            f"{block}k_proj.weight": (kv_width, d),
            f"{block}v_proj.weight": (kv_width, d),
            f"{block}attn_out.weight": (d, d),
            f"{block}ff_norm.weight": (d,),
            f"{block}ff_proj.weight": (ff, d),
            f"{block}up_proj.weight": (ff, d),
            f"{block}ff_out.weight": (d, ff),
        }
    shapes[f"{CHECKPOINT_PREFIX}ln_f.weight"] = (d,)
    if not config.weight_tying:
        shapes[f"{CHECKPOINT_PREFIX}ff_out.weight"] = (config.embedding_size, d)
    return shapes


def load_llada(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LladaModel:
    """The LLaDA model in `model_dir` (config.json + safetensors), every weight checked by name
    and shape; errors name the missing or misshapen weights."""
    from workers.engine.loader import weight_files

    model_dir = Path(model_dir)
    config = LladaConfig.from_dir(model_dir)
    shapes = expected_weight_shapes(config)
    # Built on the meta device: the checkpoint fills every parameter, so none is initialised.
    with torch.device("meta"):
        model = LladaModel(config, dtype=dtype)
    model = model.to_empty(device=device)
    params = {CHECKPOINT_PREFIX + name.removeprefix("transformer."): p for name, p in model.named_parameters()}
    assert params.keys() == shapes.keys(), "the model's parameters and expected_weight_shapes disagree"
    loaded: set[str] = set()
    with torch.no_grad():
        for path in weight_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in shapes:
                        log.warning("ignoring checkpoint tensor %s (no such LLaDA weight)", name)
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != shapes[name]:
                        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {shapes[name]}")
                    params[name].copy_(tensor.to(dtype))
                    loaded.add(name)
    missing = sorted(shapes.keys() - loaded)
    if missing:
        more = f" ... ({len(missing)} in all)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint in {str(model_dir)!r} lacks weights: {missing[:8]}{more}")
    # Inference only: no autograd graph is ever built over the weights.
    return model.eval().requires_grad_(False)

