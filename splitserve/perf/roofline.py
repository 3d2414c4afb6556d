"""The kernel-class roofline: analytic step tables for GPUs and models without measured data.

The datasheet roofline (`splitserve.perf.presets.preset`, backend `datasheet`) times a
whole step as max(compute, memory) of two affine lines at 50 % of the peak FLOPs, so a
decode batch's attention hides under a prefill chunk's GEMMs, and a GEMM of 64 rows runs at
the efficiency of one of 8,192. This module keeps the roofline where no
measurements exist (H20, RTX 4090, models the database lacks) but builds it the way the
measured backend is built (`splitserve.perf.tables`): a step is the **sum** of kernel
classes, each its own max(compute, memory), tabulated on the measured backend's grids:

    seconds = overhead
            + linear(T)                   GEMMs + norms/activations + all-reduces of T tokens
            + logits(rows)                the lm_head GEMM over the rows that get logits
            + sum_i prefill_attention(L_i, H_i)
            + decode_attention(B, C)

Per GPU of a `tp`-way instance (weights, heads and KV heads split over `tp`; KV heads
replicated when tp > kv_heads), with peak FLOP/s `F`, HBM bytes/s `W`, and the fitted
constants of `RooflineConstants` (all >= 0):

    linear(T) = 7·layers·k_lat                                    (launch floors: 4 GEMMs, 2 norms, 1 act)
              + max(2·P·(T + t_half) / (F·gemm_eff),             (GEMMs: eff(T) = gemm_eff·T/(T + t_half))
                    (P·w + T·io) / (W·weight_bw))                 (weights once, GEMM inputs/outputs per token)
              + T·elem / (W·weight_bw)                           (norms, residual adds, SiLU·gate)
              + [tp > 1] 2·layers·(ar_lat + 2(tp−1)/tp·T·h·2 / (link·ar_eff))
    logits(r) = k_lat + max(2·V·(r + t_half)/(F16·gemm_eff), (2·V + r·(h + vocab/tp)·2)/(W·weight_bw))
    prefill_attention(L, H) = layers·pa_lat
              + max(A·L·(H + L/2 + k_half) / (F16·attn_eff),     (causal pairs, + k_half keys of fixed work a row)
                    (kv·(H + L) + q·L) / (W·kv_bw))              (KV read and written, Q read, O written)
    decode_attention(B, C) = layers·da_lat + B·layers·kvh·seq_s
              + max(A·B·C / (F16·attn_eff), kv·B·C / (W·kv_bw))

For a mixture-of-experts model (Mixtral) the GEMM term counts each expert apart: with P_d the
weights every token runs through (attention, router), P_e one expert's MLP of all layers per GPU,
k experts per token and e(T) = E·(1 − (1 − k/E)^T) the expected distinct experts T tokens touch,

    GEMMs = max(2·(P_d·(T + t_half) + P_e·(k·T + e(T)·t_half)) / (F·gemm_eff),
                ((P_d + e(T)·P_e)·w + T·io) / (W·weight_bw))

(FLOPs of the top-k experts per token; the weights of the experts touched; one padded GEMM per
expert touched); io and elem count the k experts' activations. For a dense model e = 0 and
P_d = P, the formula above. The constants were fitted to dense models only.

P = linear weights per GPU, w = weight bytes (2 for bf16, 1 for fp8 linear layers), io / elem =
bytes per token of the GEMMs' activations / of the elementwise kernels, V = lm_head weights per
GPU, A = attention FLOPs per (query, key) pair per GPU (4·layers·heads/tp·head_dim), kv = KV
bytes per token per GPU, kvh = KV heads per GPU. `gemm_eff·T/(T + t_half)` is the GEMM
efficiency of a T-row GEMM: the GEMM computes about t_half rows more than it is asked for (the
M tile padded, the pipeline filling and draining), which is the same as an efficiency rising
from 0 to `gemm_eff` with half of it at T = t_half. The attention's `k_half` is the same idea
per query row (loading Q, the softmax rescales, writing O: work worth k_half keys).

The constants are fitted (`benchmarks/fit_roofline.py`) by least squares in relative error to
NVIDIA aiconfigurator's measured database (`splitserve.perf.aiconfigurator`) over prefill,
decode and mixed steps, and each kernel class on its own, of the preset models on A100, H100,
H200 and L40S, one set per GPU
generation (`FITTED`; Ampere, Hopper, Ada) and one over all four (`FITTED["all"]`), which
times GPUs of another generation. An uncovered GPU takes its generation's constants
(`GENERATION`: H20 is Hopper, RTX 4090 is Ada). docs/perf_model.md has the error table.

Pure arithmetic on numpy; no aiconfigurator needed.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from splitserve.perf.model import PerfModel
from splitserve.perf.presets import GB, GpuSpec, ModelSpec, gpu_spec, model_spec, preset
from splitserve.perf.tables import (BATCH_GRID, CHUNK_GRID, LOGITS_GRID, TOKEN_GRID, StepTables, context_grid,
                                    history_grid)

__all__ = ["FITTED", "GENERATION", "RooflineConstants", "RooflineKernels", "constants_for", "generation",
           "roofline_model", "roofline_tables"]

LINEAR_KERNELS_PER_LAYER = 7  # q/k/v, o, gate-up and down GEMMs; two add-norms; SiLU·gate


@dataclass(frozen=True)
class RooflineConstants:
    """Achieved fractions of the datasheet peaks and fixed costs (see the module docstring)."""

    gemm_eff: float  # large-GEMM fraction of the dense peak FLOP/s
    gemm_t_half: float  # tokens at which a GEMM reaches half of gemm_eff
    weight_bw: float  # HBM efficiency streaming weights and activations
    attn_eff: float  # attention fraction of the dense BF16 peak
    attn_k_half: float  # keys' worth of fixed work per attention query row
    kv_bw: float  # HBM efficiency reading and writing KV
    kernel_latency_s: float  # floor of each linear-class kernel (per layer) and of the lm_head
    prefill_attn_latency_s: float  # floor of a prefill-attention kernel, per layer
    decode_attn_latency_s: float  # floor of the decode-attention kernel, per layer
    decode_seq_s: float  # decode attention per (sequence, layer, KV head on the GPU)
    allreduce_eff: float  # all-reduce bus bandwidth / link bandwidth
    allreduce_latency_s: float  # per all-reduce (two a layer)
    step_overhead_s: float  # per step

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"RooflineConstants.{f.name} must be a finite number >= 0, got {v!r}")
        for name in ("gemm_eff", "weight_bw", "attn_eff", "kv_bw", "allreduce_eff"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"RooflineConstants.{name} must be in (0, 1], got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_vector(cls, values) -> RooflineConstants:
        return cls(*(float(v) for v in values))


# GPU generation of each preset GPU (GpuSpec.name); the fitted constants are per generation.
GENERATION: Mapping[str, str] = MappingProxyType({
    "A100-SXM4-80GB": "ampere",
    "H100-SXM5-80GB": "hopper", "H200-SXM-141GB": "hopper", "H20-96GB": "hopper",
    "L40S-48GB": "ada", "GeForce-RTX-4090-24GB": "ada",
})

# Fitted by benchmarks/fit_roofline.py (`--write` rewrites the block between the markers).
# BEGIN FITTED
FITTED: Mapping[str, RooflineConstants] = MappingProxyType({
    "all": RooflineConstants(gemm_eff=0.8173, gemm_t_half=24.45, weight_bw=0.7592, attn_eff=0.6359,
        attn_k_half=605.6, kv_bw=0.9178, kernel_latency_s=2.851e-06, prefill_attn_latency_s=2.216e-05,
        decode_attn_latency_s=1.123e-05, decode_seq_s=2.073e-08, allreduce_eff=0.4658, allreduce_latency_s=3.146e-06,
        step_overhead_s=7.47e-05),
    "ampere": RooflineConstants(gemm_eff=0.9219, gemm_t_half=48.98, weight_bw=0.7669, attn_eff=0.5962,
        attn_k_half=535.2, kv_bw=0.7828, kernel_latency_s=8.964e-06, prefill_attn_latency_s=2.195e-05,
        decode_attn_latency_s=1.621e-05, decode_seq_s=2.669e-08, allreduce_eff=0.3549, allreduce_latency_s=0.0,
        step_overhead_s=0.0),
    "hopper": RooflineConstants(gemm_eff=0.7839, gemm_t_half=7.291, weight_bw=0.7855, attn_eff=0.7125,
        attn_k_half=812.2, kv_bw=0.9489, kernel_latency_s=3.181e-06, prefill_attn_latency_s=2.378e-05,
        decode_attn_latency_s=1.13e-05, decode_seq_s=2.004e-08, allreduce_eff=0.6363, allreduce_latency_s=3.494e-06,
        step_overhead_s=0.0),
    "ada": RooflineConstants(gemm_eff=0.6746, gemm_t_half=13.8, weight_bw=0.7456, attn_eff=0.5378, attn_k_half=410.4,
        kv_bw=0.962, kernel_latency_s=1.584e-06, prefill_attn_latency_s=1.879e-05, decode_attn_latency_s=8.548e-06,
        decode_seq_s=1.758e-08, allreduce_eff=0.5188, allreduce_latency_s=0.0, step_overhead_s=3.119e-05),
})
FIT_SOURCE: Mapping[str, Any] = MappingProxyType({"aiconfigurator_core": "0.12.0", "cases": 24,
        "database_versions": ["A100:0.14.0", "H100:0.24.0", "H200:0.24.0", "L40S:0.24.0"], "framework": "vllm",
        "script": "benchmarks/fit_roofline.py", "steps": 3982})
# END FITTED


def generation(gpu: str | GpuSpec) -> str:
    """The fitted-constant set that times `gpu`: its generation's, else `all`."""
    g = gpu_spec(gpu)
    gen = GENERATION.get(g.name)
    return gen if gen in FITTED else "all"


def constants_for(gpu: str | GpuSpec) -> RooflineConstants:
    return FITTED[generation(gpu)]


class RooflineKernels:
    """The four kernel classes of `model` on one GPU of a `tp`-way `gpu` instance (vectorised:
    every method takes numpy arrays or floats)."""

    def __init__(self, gpu: str | GpuSpec, model: str | ModelSpec, tp: int = 1, *, dtype: str = "bf16",
                 constants: RooflineConstants | None = None):
        g, m = gpu_spec(gpu), model_spec(model)
        if dtype not in ("bf16", "fp8"):
            raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")
        if dtype == "fp8" and not g.fp8_tflops:
            raise ValueError(f"{g.name} has no FP8 tensor cores")
        self.gpu, self.model, self.tp, self.dtype = g, m, tp, dtype
        self.c = constants if constants is not None else constants_for(g)
        h, hd, layers = m.hidden, m.head_dim, m.layers
        qh = m.heads / tp
        self.kvh = max(m.kv_heads / tp, 1.0)
        # MLP width a token runs through, per GPU: an MoE token runs through experts_per_token
        # experts (tensor-parallel experts: every GPU holds 1/tp of each).
        inter = (m.experts_per_token * m.expert_intermediate if m.is_moe else m.intermediate) / tp
        self.layers = layers
        self.peak_lin = (g.fp8_tflops if dtype == "fp8" else g.bf16_tflops) * 1e12
        self.peak16 = g.bf16_tflops * 1e12
        self.hbm = g.mem_bw_gbs * GB
        # per GPU: linear weights (elements), bytes per token of GEMM activations and elementwise kernels.
        # p_lin is what a token multiplies by (an MoE model's active parameters); p_dense the part
        # every step reads whole, p_expert one expert of all layers (0 for a dense model).
        self.p_lin = layers * (2 * h * qh * hd + 2 * h * self.kvh * hd + 3 * h * inter)
        self.p_expert = layers * m.expert_params / tp
        self.p_dense = self.p_lin - m.experts_per_token * self.p_expert
        self.w_bytes = 1.0 if dtype == "fp8" else 2.0
        self.io = 2.0 * layers * ((h + (qh + 2 * self.kvh) * hd) + (qh * hd + h) + (h + 2 * inter) + (inter + h))
        self.elem = 2.0 * layers * (8 * h + 3 * inter)
        self.p_vocab = m.vocab * h / tp
        self.logit_io = 2.0 * (h + m.vocab / tp)
        self.pair_flops = 4.0 * layers * qh * hd
        self.kv = 2.0 * layers * self.kvh * hd * 2  # BF16 K and V
        self.q_bytes = 2.0 * layers * qh * hd * 2  # Q read and O written, per query token
        self.ar_bytes = 2.0 * layers * 2 * (tp - 1) / tp * h * 2 if tp > 1 else 0.0  # per token
        link = g.nvlink_gbs or g.pcie_gbs
        self.link = link * GB

    # ---- kernel classes ------------------------------------------------------------------
    def experts_touched(self, tokens):
        """Expected distinct experts per layer that `tokens` tokens route to (uniform routing:
        E·(1 − (1 − k/E)^T), `ModelSpec.experts_touched`); 0 for a dense model."""
        m, t = self.model, np.asarray(tokens, dtype=np.float64)
        if not m.is_moe:
            return np.zeros_like(t)
        return m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** np.maximum(t, 0.0))

    def linear_s(self, tokens):
        c, t = self.c, np.asarray(tokens, dtype=np.float64)
        # Each GEMM computes t_half rows more than asked; an MoE layer runs one GEMM per expert
        # touched, so its experts pad t_half rows each. Weights read: the dense part whole, the
        # experts the step's tokens touch (Mixtral: 2 of 8 at one decode, 7.9 at 16 tokens).
        touched = self.experts_touched(t)
        padded = self.p_dense * (t + c.gemm_t_half) + self.p_expert * (self.model.experts_per_token * t
                                                                       + touched * c.gemm_t_half)
        read = self.p_dense + touched * self.p_expert
        gemm = np.maximum(2 * padded / (self.peak_lin * c.gemm_eff),
                          (read * self.w_bytes + t * self.io) / (self.hbm * c.weight_bw))
        floors = LINEAR_KERNELS_PER_LAYER * self.layers * c.kernel_latency_s
        out = floors + gemm + t * self.elem / (self.hbm * c.weight_bw)
        if self.tp > 1:
            out = out + 2 * self.layers * c.allreduce_latency_s + t * self.ar_bytes / (self.link * c.allreduce_eff)
        return out

    def logits_s(self, rows):
        c, r = self.c, np.asarray(rows, dtype=np.float64)
        return c.kernel_latency_s + np.maximum(2 * self.p_vocab * (r + c.gemm_t_half) / (self.peak16 * c.gemm_eff),
                                               (2 * self.p_vocab + r * self.logit_io) / (self.hbm * c.weight_bw))

    def prefill_attention_s(self, l_incr, l_hist):
        c = self.c
        n, h = np.asarray(l_incr, dtype=np.float64), np.asarray(l_hist, dtype=np.float64)
        compute = self.pair_flops * n * (h + n / 2 + c.attn_k_half) / (self.peak16 * c.attn_eff)
        memory = (self.kv * (h + n) + self.q_bytes * n) / (self.hbm * c.kv_bw)
        return self.layers * c.prefill_attn_latency_s + np.maximum(compute, memory)

    def decode_attention_s(self, batch, ctx):
        c = self.c
        b, x = np.asarray(batch, dtype=np.float64), np.asarray(ctx, dtype=np.float64)
        compute = self.pair_flops * b * x / (self.peak16 * c.attn_eff)
        memory = self.kv * b * x / (self.hbm * c.kv_bw)
        return self.layers * (c.decode_attn_latency_s + b * self.kvh * c.decode_seq_s) + np.maximum(compute, memory)

    def step_s(self, chunk_tokens, chunk_hist, decode_batch, decode_ctx):
        """One-chunk steps in closed form, element by element (what `StepTables.step_s` computes
        from the tables of `tables()`, up to their interpolation): 0 for an empty step."""
        n = np.asarray(chunk_tokens, dtype=np.float64)
        h = np.asarray(chunk_hist, dtype=np.float64)
        b = np.asarray(decode_batch, dtype=np.float64)
        x = np.asarray(decode_ctx, dtype=np.float64)
        has_p, has_d = n > 0, b > 0
        total = (self.c.step_overhead_s + self.linear_s(n + b) + self.logits_s(has_p + b)
                 + np.where(has_p, self.prefill_attention_s(n, h), 0.0)
                 + np.where(has_d, self.decode_attention_s(b, x), 0.0))
        return np.where(has_p | has_d, total, 0.0)

    # ---- tables --------------------------------------------------------------------------
    def tables(self, source: Mapping[str, Any] | None = None) -> StepTables:
        """The kernel classes on the measured backend's grids (`splitserve.perf.aiconfigurator`)."""
        ctx, hist = context_grid(self.model.context_len), history_grid(self.model.context_len)
        linear = tuple(float(v) for v in self.linear_s(np.array(TOKEN_GRID)))
        pa = self.prefill_attention_s(np.array(CHUNK_GRID, dtype=np.float64)[:, None], np.array(hist)[None, :])
        da = self.decode_attention_s(np.array(BATCH_GRID, dtype=np.float64)[:, None], np.array(ctx)[None, :])
        return StepTables(
            tokens=tuple(map(float, TOKEN_GRID)), context_linear=linear, generation_linear=linear,
            logits_rows=tuple(map(float, LOGITS_GRID)),
            logits=tuple(float(v) for v in self.logits_s(np.array(LOGITS_GRID))),
            chunk_tokens=tuple(map(float, CHUNK_GRID)), chunk_history=tuple(map(float, hist)),
            prefill_attention=tuple(tuple(float(v) for v in row) for row in pa),
            decode_batch=tuple(map(float, BATCH_GRID)), decode_context=tuple(map(float, ctx)),
            decode_attention=tuple(tuple(float(v) for v in row) for row in da),
            overhead_s=float(self.c.step_overhead_s), source=dict(source or {}))


def roofline_tables(gpu: str | GpuSpec, model: str | ModelSpec, tp: int = 1, *, dtype: str = "bf16",
                    constants: RooflineConstants | None = None) -> StepTables:
    """Analytic `StepTables` of `model` on `tp` x `gpu`; `source` names the backend, the constant
    set and its values."""
    g = gpu_spec(gpu)
    gen = generation(g) if constants is None else "custom"
    k = RooflineKernels(g, model, tp, dtype=dtype, constants=constants)
    source = {"backend": "roofline", "gpu": g.name, "model": k.model.name, "tp": tp, "dtype": dtype,
              "constants": gen, **k.c.to_dict()}
    if constants is None and FIT_SOURCE:
        source["fitted_to"] = dict(FIT_SOURCE)
    return k.tables(source)


_LOCK = threading.Lock()
_MEMORY: dict[tuple, PerfModel] = {}


def roofline_model(gpu: str | GpuSpec, model: str | ModelSpec, tp: int = 1, *, dtype: str = "bf16",
                   link: str = "rdma-400g", check_memory: bool = True,
                   constants: RooflineConstants | None = None) -> PerfModel:
    """The kernel-class roofline `PerfModel`: the datasheet preset (its coefficients serve the
    closed forms and KV transfer, and its memory check) with analytic step tables. A diffusion
    LM keeps the datasheet preset: its denoising steps are timed by `splitserve.core.diffusion_perf`
    and `PerfModel.diffusion_step_time`, which read the coefficients, not tables."""
    g, m = gpu_spec(gpu), model_spec(model)
    base = preset(g, m, tp, dtype=dtype, link=link, check_memory=check_memory)
    if m.kind != "ar":
        return base
    key = (g.name, m.name, tp, dtype, link, constants)
    with _LOCK:
        cached = _MEMORY.get(key)
        if cached is None:
            tables = roofline_tables(g, m, tp, dtype=dtype, constants=constants)
            cached = dataclasses.replace(base, tables=tables,
                                         label=f"roofline:{g.name}/{m.name}/tp{tp}/{dtype}/{link}"
                                               f"/{tables.source['constants']}")
            _MEMORY[key] = cached
        return cached
