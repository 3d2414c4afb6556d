"""Analytical roofline presets for named GPU x model pairs, and memory-fit checks.

`preset(gpu, model, tp)` turns datasheet numbers (GPU_SPECS) and model shapes
(MODEL_SPECS) into the coefficients of a `splitserve.perf.model.PerfModel`:

    time = max(FLOPs / (tp * peak * mfu), bytes / (tp * bw * bw_eff)) + overheads

with per-step overhead, per-sequence overhead and, for tp > 1, two all-reduces per layer
(ring: 2(tp-1)/tp * tokens * hidden * 2 bytes over NVLink, or PCIe without it). The
efficiency factors are in `Efficiency`; every hardware number and model shape is cited
in its `source` field and in docs/perf_model.md. Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from splitserve.perf.model import DecodeCoeffs, PerfModel, PrefillCoeffs, TransferCoeffs

__all__ = [
    "DEFAULT_EFFICIENCY", "Efficiency", "GPU_SPECS", "GpuSpec", "LINK_SPECS", "LinkSpec",
    "MODEL_SPECS", "ModelSpec", "TP_DEGREES", "fits_in_memory", "gpu_spec", "link_spec",
    "max_kv_tokens", "model_spec", "preset",
]

TP_DEGREES = (1, 2, 4, 8)
GB = 1e9  # datasheet gigabytes (10^9 bytes); the conservative reading of "80GB"


@dataclass(frozen=True)
class GpuSpec:
    """Vendor datasheet numbers. TFLOPs are dense (without 2:4 sparsity); link
    bandwidths are per direction (datasheet NVLink/PCIe figures are bidirectional)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    mem_gb: float
    mem_bw_gbs: float
    nvlink_gbs: float  # per direction; 0 = no NVLink
    pcie_gbs: float  # per direction
    source: str


@dataclass(frozen=True)
class ModelSpec:
    """Transformer shape from the model's Hugging Face config.json.

    A mixture-of-experts model (`experts` > 0, e.g. Mixtral) replaces every layer's gated MLP
    with `experts` gated MLPs of `expert_intermediate` each and a router; a token runs through
    `experts_per_token` of them (top-k). Its FLOPs follow the experts a token uses
    (`linear_params`, the active parameters), its memory all of them (`stored_linear_params`),
    and the weights a step reads the experts its tokens touch (`linear_params_read`). Dense
    models leave the three fields 0."""

    name: str
    hf_id: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    kind: str  # "ar" or "diffusion" (bidirectional, every position gets logits)
    source: str
    context_len: int  # longest prompt + output the model was trained for: an emulated worker's max_model_len
    experts: int = 0  # routed experts per layer (config.json num_local_experts); 0 = dense
    experts_per_token: int = 0  # top-k (num_experts_per_tok)
    expert_intermediate: int = 0  # each expert's MLP width (Mixtral: its intermediate_size)

    def __post_init__(self) -> None:
        if self.experts < 0:
            raise ValueError(f"ModelSpec.experts must be >= 0 (0 = dense), got {self.experts}")
        if self.experts == 0:
            if self.experts_per_token or self.expert_intermediate:
                raise ValueError(f"{self.name}: a dense model (experts = 0) takes experts_per_token = 0 and "
                                 f"expert_intermediate = 0, got {self.experts_per_token} and "
                                 f"{self.expert_intermediate}")
            return
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(f"{self.name}: ModelSpec.experts_per_token must be in [1, experts={self.experts}], "
                             f"got {self.experts_per_token}")
        if self.expert_intermediate <= 0:
            raise ValueError(f"{self.name}: ModelSpec.expert_intermediate must be > 0 for an MoE model, "
                             f"got {self.expert_intermediate}")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def attention_params(self) -> int:
        """q, k, v and o projections of all layers."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (q_o + k_v)

    @property
    def expert_params(self) -> int:
        """One expert's gated MLP in one layer (gate, up, down); 0 for a dense model."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def router_params(self) -> int:
        return self.layers * self.hidden * self.experts

    @property
    def linear_params(self) -> int:
        """Per-token matmul weights of all layers: q, k, v, o and the gated MLP; for an MoE model
        the router and the `experts_per_token` experts a token runs through (the active
        parameters: 2 FLOPs each per token)."""
        if not self.is_moe:
            return self.attention_params + self.layers * 3 * self.hidden * self.intermediate
        return self.attention_params + self.router_params + self.layers * self.experts_per_token * self.expert_params

    @property
    def stored_linear_params(self) -> int:
        """Matmul weights held in memory: `linear_params`, with every expert for an MoE model."""
        if not self.is_moe:
            return self.linear_params
        return self.attention_params + self.router_params + self.layers * self.experts * self.expert_params

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts per layer that `tokens` tokens route to, each choosing
        `experts_per_token` of the `experts` uniformly and independently:
        E·(1 − (1 − k/E)^tokens) (Mixtral at one decode: 2; at 8: 7.2; at 16: 7.9 of 8).
        Real routing is skewed, so this is the most a batch can touch on average."""
        if not self.is_moe or tokens <= 0:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens)

    def linear_params_read(self, tokens: float) -> float:
        """Matmul weights a step of `tokens` tokens reads from memory: all of them for a dense
        model; for an MoE model the attention, the router and the experts the tokens touch
        (`experts_touched`)."""
        if not self.is_moe:
            return float(self.linear_params)
        return (self.attention_params + self.router_params
                + self.layers * self.experts_touched(tokens) * self.expert_params)

    @property
    def vocab_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        return self.stored_linear_params + self.vocab_params * (1 if self.tied_embeddings else 2)

    @property
    def attn_flops_per_pair(self) -> int:
        """FLOPs per (query, key) pair: QK^T and PV, 2 FLOPs per MAC, all query heads."""
        return 4 * self.layers * self.heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class LinkSpec:
    """A KV-transfer link: seconds = latency + bytes / (n * bandwidth * efficiency), with
    n = tp when every GPU has its own link (`per_gpu`), else 1. `gpu_link` takes the
    bandwidth from the GPU's NVLink or PCIe figure."""

    name: str
    bandwidth_gbs: float  # per direction, GB/s; ignored when gpu_link is set
    efficiency: float
    latency_s: float
    per_gpu: bool
    source: str
    gpu_link: str | None = None  # "nvlink" | "pcie"


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of datasheet peaks, and fixed costs (assumptions, see docs)."""

    prefill_mfu: float = 0.5  # GEMM + attention FLOP efficiency in prefill
    decode_mfu: float = 0.5  # the same for large-batch decode
    prefill_bw: float = 0.8  # HBM efficiency when a short prefill is memory-bound
    decode_bw: float = 0.8  # HBM efficiency of decode (weights + KV streaming)
    collective: float = 0.8  # all-reduce bus-bandwidth efficiency
    step_overhead_s: float = 0.5e-3  # scheduler + launch per step
    per_seq_overhead_s: float = 5e-6  # per decode sequence (sampling, metadata)
    allreduce_latency_nvlink_s: float = 8e-6
    allreduce_latency_pcie_s: float = 25e-6


DEFAULT_EFFICIENCY = Efficiency()

_NV = "NVIDIA datasheet"
GPU_SPECS: Mapping[str, GpuSpec] = MappingProxyType({
    "A100": GpuSpec("A100-SXM4-80GB", 312.0, None, 80, 2039, 300, 32,
                    f"{_NV} A100 80GB SXM (nvidia.com/en-us/data-center/a100): BF16 312 TFLOPS "
                    "dense (624 sparse), 80GB HBM2e, 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s"),
    "H100": GpuSpec("H100-SXM5-80GB", 989.0, 1979.0, 80, 3350, 450, 64,
                    f"{_NV} H100 SXM (nvidia.com/en-us/data-center/h100): BF16 1,979 / FP8 3,958 "
                    "TFLOPS with sparsity (half dense), 80GB HBM3, 3.35 TB/s, NVLink 900 GB/s, "
                    "PCIe Gen5 128 GB/s"),
    "H200": GpuSpec("H200-SXM-141GB", 989.0, 1979.0, 141, 4800, 450, 64,
                    f"{_NV} H200 SXM (nvidia.com/en-us/data-center/h200): BF16 1,979 / FP8 3,958 "
                    "TFLOPS with sparsity, 141GB HBM3e, 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s"),
    # AMPD's evaluation GPU (§7.1): export-grade Hopper, little compute, full HBM bandwidth.
    "H20": GpuSpec("H20-96GB", 148.0, 296.0, 96, 4000, 450, 64,
                   f"{_NV} H20 (HGX H20 product brief): BF16 148 / FP8 296 TFLOPS dense, 96GB HBM3, "
                   "4.0 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s"),
    "L40S": GpuSpec("L40S-48GB", 362.05, 733.0, 48, 864, 0, 32,
                    f"{_NV} L40S (nvidia.com/en-us/data-center/l40s): BF16 362.05 (733 sparse), "
                    "FP8 733 TFLOPS dense, 48GB GDDR6, 864 GB/s, PCIe Gen4 x16 64 GB/s "
                    "bidirectional, no NVLink"),
    "RTX4090": GpuSpec("GeForce-RTX-4090-24GB", 165.2, 330.3, 24, 1008, 0, 32,
                       "NVIDIA Ada Lovelace GPU architecture whitepaper, GeForce RTX 4090: BF16 "
                       "tensor with FP32 accumulate 165.2 TFLOPS dense (330.4 sparse), FP8 330.3, "
                       "24GB GDDR6X, 1,008 GB/s, PCIe Gen4 x16, no NVLink"),
})

_HF = "https://huggingface.co/{}/blob/main/config.json"
MODEL_SPECS: Mapping[str, ModelSpec] = MappingProxyType({
    "Llama-3-8B": ModelSpec("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", 32, 4096, 32, 8, 128,
                            14336, 128256, False, "ar", _HF.format("meta-llama/Meta-Llama-3-8B"), 8192),
    # Qwen2.5: max_position_embeddings 131072 in config.json, but natively 32,768 (beyond it needs YaRN).
    "Qwen2.5-14B": ModelSpec("Qwen2.5-14B", "Qwen/Qwen2.5-14B", 48, 5120, 40, 8, 128, 13824,
                             152064, False, "ar", _HF.format("Qwen/Qwen2.5-14B")
                             + "; Qwen2.5 technical report (arXiv:2412.15115) Table 1", 32768),
    "Qwen2.5-32B": ModelSpec("Qwen2.5-32B", "Qwen/Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648,
                             152064, False, "ar", _HF.format("Qwen/Qwen2.5-32B")
                             + "; Qwen2.5 technical report (arXiv:2412.15115) Table 1", 32768),
    # DynaServe's largest model (§6.1: 72B on TP4 A100s); untied embeddings, Qwen2 qkv bias.
    "Qwen2.5-72B": ModelSpec("Qwen2.5-72B", "Qwen/Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568,
                             152064, False, "ar", _HF.format("Qwen/Qwen2.5-72B")
                             + "; Qwen2.5 technical report (arXiv:2412.15115) Table 1", 32768),
    # Qwen3: head_dim 128 with 64 query heads (wider than hidden / heads); 32,768 native context.
    "Qwen3-32B": ModelSpec("Qwen3-32B", "Qwen/Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, False, "ar",
                           _HF.format("Qwen/Qwen3-32B"), 32768),
    "Llama-3.1-70B": ModelSpec("Llama-3.1-70B", "meta-llama/Llama-3.1-70B", 80, 8192, 64, 8, 128,
                               28672, 128256, False, "ar", _HF.format("meta-llama/Llama-3.1-70B"), 131072),
    # Mixtral: 8 experts of 14,336 per layer (intermediate_size is each expert's), top-2; 46.7B
    # parameters, 12.9B active per token (Mixtral of Experts, arXiv:2401.04088 §2).
    "Mixtral-8x7B": ModelSpec("Mixtral-8x7B", "mistralai/Mixtral-8x7B-Instruct-v0.1", 32, 4096, 32, 8, 128,
                              14336, 32000, False, "ar",
                              _HF.format("mistralai/Mixtral-8x7B-Instruct-v0.1")
                              + "; Mixtral of Experts (arXiv:2401.04088) Table 1", 32768,
                              experts=8, experts_per_token=2, expert_intermediate=14336),
    "LLaDA-8B": ModelSpec("LLaDA-8B", "GSAI-ML/LLaDA-8B-Base", 32, 4096, 32, 32, 128, 12288,
                          126464, False, "diffusion", _HF.format("GSAI-ML/LLaDA-8B-Base")
                          + "; LLaDA paper (arXiv:2502.09992) Table 5: 8.02B params, MHA", 4096),
})

LINK_SPECS: Mapping[str, LinkSpec] = MappingProxyType({
    "rdma-400g": LinkSpec("rdma-400g", 50.0, 0.8, 30e-6, True,
                          "400 Gb/s InfiniBand/RoCE NIC per GPU (ConnectX-7, as in DGX H100)"),
    "rdma-200g": LinkSpec("rdma-200g", 25.0, 0.8, 30e-6, True, "200 Gb/s NIC per GPU"),
    "nvlink": LinkSpec("nvlink", 0.0, 0.8, 10e-6, True, "GPU NVLink, per direction", "nvlink"),
    "pcie": LinkSpec("pcie", 0.0, 0.8, 15e-6, True, "GPU PCIe link, per direction", "pcie"),
    "tcp-10g": LinkSpec("tcp-10g", 1.25, 0.7, 200e-6, False, "10 GbE host NIC shared by the node"),
})


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9.]", "", name.lower())


_GPU_ALIASES = {"a10080gb": "A100", "a100sxm": "A100", "a10080gbsxm": "A100", "a100sxm480gb": "A100",
                "h100sxm": "H100", "h100sxm5": "H100", "h100sxm580gb": "H100", "h200sxm": "H200",
                "4090": "RTX4090", "geforcertx4090": "RTX4090"}
# Llama-3.1-8B and Llama-3.3-70B share their predecessors' shapes.
_MODEL_ALIASES = {"llama3.18b": "Llama-3-8B", "llama3.370b": "Llama-3.1-70B", "llada8b": "LLaDA-8B",
                  "mixtral8x7binstructv0.1": "Mixtral-8x7B", "mixtral8x7bv0.1": "Mixtral-8x7B"}


def _lookup(name: str, table: Mapping, aliases: dict[str, str], what: str):
    key = _norm(name.split("/")[-1])
    if what == "model":
        key = re.sub(r"(instruct|base|chat|hf)$", "", key.removeprefix("meta"))
    for canon in table:
        if _norm(canon) == key:
            return table[canon]
    if key in aliases:
        return table[aliases[key]]
    raise ValueError(f"unknown {what} {name!r}; known: {', '.join(table)}")


def gpu_spec(gpu: str | GpuSpec) -> GpuSpec:
    return gpu if isinstance(gpu, GpuSpec) else _lookup(gpu, GPU_SPECS, _GPU_ALIASES, "gpu")


def model_spec(model: str | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else _lookup(model, MODEL_SPECS, _MODEL_ALIASES, "model")


def link_spec(link: str | LinkSpec) -> LinkSpec:
    if isinstance(link, LinkSpec):
        return link
    if link not in LINK_SPECS:
        raise ValueError(f"unknown link {link!r}; known: {', '.join(LINK_SPECS)}")
    return LINK_SPECS[link]


def _weight_bytes(m: ModelSpec, dtype: str) -> tuple[float, float]:
    """(bytes read per step, bytes resident) for the whole model. fp8 stores the linear
    layers in 1 byte; embeddings and lm_head stay BF16. An MoE model's step reads every expert
    here: the whole-step roofline's weight read is one constant per step, and a batch of 16
    tokens already touches 7.9 of Mixtral's 8 experts (`ModelSpec.experts_touched`), so only
    steps of a few tokens are overstated (one decode reads 2 experts, not 8; the kernel-class
    roofline, `splitserve.perf.roofline`, counts the experts touched)."""
    w = 1 if dtype == "fp8" else 2
    lin = m.stored_linear_params * w
    return lin + 2 * m.vocab_params, lin + 2 * m.vocab_params * (1 if m.tied_embeddings else 2)


def _check(gpu: GpuSpec, tp: int, dtype: str) -> None:
    if tp not in TP_DEGREES:
        raise ValueError(f"tp must be one of {TP_DEGREES}, got {tp}")
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")
    if dtype == "fp8" and not gpu.fp8_tflops:
        raise ValueError(f"{gpu.name} has no FP8 tensor cores")


def _free_bytes_per_gpu(g: GpuSpec, m: ModelSpec, tp: int, dtype: str, mem_util: float,
                        reserve_gb: float) -> float:
    _check(g, tp, dtype)
    return g.mem_gb * GB * mem_util - reserve_gb * GB - _weight_bytes(m, dtype)[1] / tp


def max_kv_tokens(gpu: str | GpuSpec, model: str | ModelSpec, tp: int = 1, *, dtype: str = "bf16",
                  mem_util: float = 0.9, reserve_gb: float = 2.0) -> int:
    """Tokens of BF16 KV cache that fit per instance beside the weights: per GPU,
    mem*mem_util - reserve (activations, CUDA graphs, NCCL) - weights/tp, over the per-GPU
    KV bytes per token (KV heads split over tp, replicated when tp > kv_heads). 0 when
    the weights alone do not fit."""
    g, m = gpu_spec(gpu), model_spec(model)
    free = _free_bytes_per_gpu(g, m, tp, dtype, mem_util, reserve_gb)
    per_token = m.kv_bytes_per_token() * max(m.kv_heads / tp, 1) / m.kv_heads
    return math.floor(free / per_token) if free > 0 else 0


def fits_in_memory(gpu: str | GpuSpec, model: str | ModelSpec, tp: int = 1, kv_tokens: int = 0, *,
                   dtype: str = "bf16", mem_util: float = 0.9, reserve_gb: float = 2.0) -> bool:
    """Whether the weights plus `kv_tokens` tokens of KV fit on `tp` GPUs (see max_kv_tokens).
    mem_util 0.9 mirrors vLLM's default gpu_memory_utilization."""
    g, m = gpu_spec(gpu), model_spec(model)
    if _free_bytes_per_gpu(g, m, tp, dtype, mem_util, reserve_gb) <= 0:
        return False
    return kv_tokens <= max_kv_tokens(g, m, tp, dtype=dtype, mem_util=mem_util, reserve_gb=reserve_gb)


def preset(gpu: str | GpuSpec, model: str | ModelSpec, tp: int = 1, *, dtype: str = "bf16",
           link: str | LinkSpec = "rdma-400g", efficiency: Efficiency = DEFAULT_EFFICIENCY,
           check_memory: bool = True) -> PerfModel:
    """Roofline PerfModel of `model` on `tp` x `gpu` (formulas in docs/perf_model.md).

    dtype "fp8" runs the linear layers at the FP8 peak with 1-byte weights; attention,
    lm_head and the KV cache stay BF16. Raises ValueError when the weights do not fit
    (`fits_in_memory`), unless check_memory=False."""
    g, m, lk, e = gpu_spec(gpu), model_spec(model), link_spec(link), efficiency
    _check(g, tp, dtype)
    if check_memory and not fits_in_memory(g, m, tp, 0, dtype=dtype):
        raise ValueError(f"{m.name} ({dtype}) does not fit on {tp} x {g.name}; use a larger tp "
                         "(see fits_in_memory) or check_memory=False")
    peak_lin = (g.fp8_tflops if dtype == "fp8" else g.bf16_tflops) * 1e12 * tp
    peak_bf16 = g.bf16_tflops * 1e12 * tp
    hbm = g.mem_bw_gbs * GB * tp
    lin_flops = 2.0 * m.linear_params  # per token
    head_flops = 2.0 * m.vocab_params  # per token that gets logits
    pair_flops = float(m.attn_flops_per_pair)
    w_read = _weight_bytes(m, dtype)[0]
    kv_read = m.kv_bytes_per_token() * max(m.kv_heads / tp, 1) / m.kv_heads * tp  # all GPUs

    ar0 = ar_tok = 0.0
    if tp > 1:  # two ring all-reduces of tokens x hidden BF16 per layer
        bw, lat = ((g.nvlink_gbs, e.allreduce_latency_nvlink_s) if g.nvlink_gbs
                   else (g.pcie_gbs, e.allreduce_latency_pcie_s))
        n_ar = 2 * m.layers
        ar0 = n_ar * lat
        ar_tok = n_ar * 2 * (tp - 1) / tp * m.hidden * 2 / (bw * GB * e.collective)
    t0 = e.step_overhead_s + ar0

    every_token_logits = m.kind == "diffusion"
    pc, pcb, pm = peak_lin * e.prefill_mfu, peak_bf16 * e.prefill_mfu, hbm * e.prefill_bw
    prefill = PrefillCoeffs(
        c0=t0 + (0.0 if every_token_logits else head_flops / pcb),
        c_tok=lin_flops / pc + (head_flops / pcb if every_token_logits else 0.0) + ar_tok,
        c_attn=pair_flops / pcb,
        m0=t0 + w_read / pm,
        m_tok=kv_read / pm + ar_tok,
        m_hist=kv_read / pm,
    )
    dc, dcb, dm = peak_lin * e.decode_mfu, peak_bf16 * e.decode_mfu, hbm * e.decode_bw
    decode = DecodeCoeffs(
        c0=t0,
        c_seq=lin_flops / dc + head_flops / dcb + ar_tok + e.per_seq_overhead_s,
        c_ctx=pair_flops / dcb,
        m0=t0 + w_read / dm,
        m_seq=kv_read / dm + ar_tok + e.per_seq_overhead_s,
        m_ctx=kv_read / dm,
    )

    link_bw = {"nvlink": g.nvlink_gbs, "pcie": g.pcie_gbs}.get(lk.gpu_link or "", lk.bandwidth_gbs)
    if link_bw <= 0:
        raise ValueError(f"{g.name} has no {lk.name} link")
    n_links = tp if lk.per_gpu else 1
    kv_tok = m.kv_bytes_per_token()
    transfer = TransferCoeffs(lk.latency_s, kv_tok / (n_links * link_bw * GB * lk.efficiency))
    return PerfModel(prefill=prefill, decode=decode, transfer=transfer, kv_bytes_per_token=kv_tok,
                     label=f"preset:{g.name}/{m.name}/tp{tp}/{dtype}/{lk.name}",
                     diffusion=m.kind == "diffusion")
