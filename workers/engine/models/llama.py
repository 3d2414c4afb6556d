"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral) over a paged KV cache.

Parameter names follow the Hugging Face checkpoints except that q/k/v and gate/up
projections are fused (`qkv_proj`, `gate_up_proj`); the loader stacks them.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from workers.engine.attention import AttentionMetadata, paged_attention
from workers.engine.config import ModelSpec


class RMSNorm(nn.Module):
    """RMS norm computed in float32, as the reference implementation does.

    With `residual`, `residual += x` first (in place) and the sum is normalised: the "add,
    then norm" between two sub-layers. `fused` (the compiled CPU kernels, or the Triton ones on
    CUDA; set by the model runner) does either in one pass; without it, the same in torch ops."""

    fused = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused is not None and x.dim() == 2:
            return self.fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            residual.add_(x)
            x = residual
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, from transformers' rope initialisers."""

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        cfg = spec.hf_config
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            dim = spec.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, [tokens, 1, head_dim]: looked up once per step
        and shared by every layer (per layer, the lookups were 4 of its ~50 small ops)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fused=None):
    cos, sin = rope
    if fused is not None:  # in place in the qkv projection's output: q and k are views of it
        fused.rotary_inplace(q, k, cos, sin)
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    fused = None  # the compiled CPU kernels or the Triton ones (rotary), set by the model runner

    def __init__(self, spec: ModelSpec, layer_idx: int, use_flash: bool):
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.sliding_window = spec.layer_sliding_windows[layer_idx]
        self.use_flash = use_flash
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:  # Qwen3 normalises each head's q and k before rope
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(self, hidden, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope, self.fused)
        out = paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.use_flash, self.sliding_window
        )
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = ACT2FN[spec.hidden_act]
        self.silu = spec.hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # The projection's output is this step's own: SiLU and the product in place, no new
        # tensors (the engine runs under inference_mode; autograd would refuse the in-place view op).
        if self.silu:
            return self.down_proj(torch.nn.functional.silu(gate, inplace=True).mul_(up))
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, use_flash: bool):
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, use_flash)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, hidden, residual, rope, kv_cache, meta, kv_written=None):
        """One layer on (hidden, residual): the residual stream is `residual + hidden` (the
        first layer gets hidden alone, residual None), so that each residual add is fused
        into the norm after it. Returns the layer's (output, residual)."""
        if residual is None:  # the embeddings, a tensor of this step's own: the residual buffer
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(normed, rope, kv_cache, meta)
        if kv_written is not None:
            kv_written()  # this layer's KV of the step is in the cache (and final): the MLP still runs
        normed = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int, use_flash: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, use_flash) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec, max_positions)


class LlamaFamilyForCausalLM(nn.Module):
    """Forward over a flattened varlen batch; logits only for the rows that sample."""

    stacked_params = {  # checkpoint name -> (fused name, shard index)
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, spec: ModelSpec, max_positions: int, use_flash: bool = False):
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec, max_positions, use_flash)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        on_layer_kv: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Return logits [len(logits_indices), vocab] in float32.

        `on_layer_kv(i)` runs as soon as layer i has written its KV of the step (after its
        attention, before its MLP): a per-layer KV push starts there.
        """
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.tables(positions, hidden.dtype)
        residual = None
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            written = None if on_layer_kv is None else functools.partial(on_layer_kv, index)
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta, written)
        # Only the rows that sample: the last residual add and the final norm on those alone.
        hidden = self.model.norm(hidden[logits_indices], residual[logits_indices])
        return self.lm_head(hidden).float()

    def use_fused_ops(self, fused) -> int:
        """Run RMSNorm (with its residual add) and rotary by `fused` (the compiled CPU kernels,
        or the Triton ones on CUDA; None: torch ops again). Returns how many modules took them."""
        taken = 0
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.fused = fused
                taken += 1
        return taken

    def shard_sizes(self, fused_name: str) -> list[int]:
        s = self.spec
        if fused_name == "qkv_proj":
            return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        return [s.intermediate_size, s.intermediate_size]
