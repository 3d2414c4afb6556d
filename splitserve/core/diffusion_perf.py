"""Performance and memory model of diffusion-LM steps (LLaDA) from datasheet numbers (dLLM-Serve).

**Time.** One denoising step runs a packed batch (`core.diffusion.DiffusionBatch`) of
requests, each in its phase (dLLM-Serve §2.3):

* **Refresh** — the request's whole sequence (L positions) is computed: L query tokens
  through every linear layer, L x L bidirectional attention pairs, and (dual cache) its keys
  and values written to the KV pool;
* **Reuse** — only the current block (`block_length` positions) is computed, attending to
  the cached context (prefix + suffix, L - block positions; r of them with the sparse cache
  of §4.5) and to its own fresh keys/values: block query tokens, block x (context + block)
  pairs, the context's KV read from the pool.

Then the LM head: 2 x vocab x hidden FLOPs per **logit row**. dLLM-Serve's runner computes
only the rows of each request's current block (`DiffusionBatch.num_logit_rows`); Fast-dLLM's
dual cache (the baseline; `generate_with_dual_cache`) runs its Refresh as a plain full forward,
so it computes logits for every position of the sequence (`full_sequence_logits`). A static
batch is one rectangular (B, L) tensor, padded to its longest sequence (`pad_to_longest`).

The step time is a roofline with the conventions of `perf_presets.preset` (its `Efficiency`
factors; a diffusion forward is prefill-like, so the prefill ones):

    seconds = step_overhead + entries x per_seq_overhead
              + max(FLOPs / (peak_bf16 x prefill_mfu), HBM bytes / (bandwidth x prefill_bw))

with FLOPs = 2 x linear params x query tokens + attention FLOPs per pair x pairs
+ 2 x vocab x hidden x logit rows, and HBM bytes = the weights read once per step + KV read
(Reuse) + KV written (Refresh).

**Memory** (§4.2-§4.3). The device's share (`memory_utilization` of its datasheet capacity)
holds the weights, an activation reserve and the KV pool. The reserve is what the worst step
needs at once: the transformer's activations for its query tokens, plus the **logit peak** —
the step's logit rows x vocab, held in fp32 (see `LOGIT_BYTES_PER_ELEMENT`). Without logit
decomposition a profiler must reserve a logit row for every token a step may compute (Figure 2
of the paper: vocab x all tokens); with it (§4.3) at most `max_num_logits` rows exist at once,
so the logit-aware profiler (§4.2) reserves only those and gives the rest to the KV pool. The
static baseline (Fast-dLLM, no decomposition) runs at the largest batch whose Refresh step —
every request's full-sequence logits, its activations and the batch's KV — fits
(`largest_static_batch`), the paper's "maximum static batch size that fits in memory" (§6.1).

**Decoding methods** (`method`): what each entry computes depends on the decoding loop being
served, not only on the scheduler's phase. `dual` is the above (Fast-dLLM's dual cache and
dLLM-Serve's runner). The two other baselines of dLLM-Serve's Table 4 are modelled from their
public code (docs/dllm_measured.md):

* `sparse_dllm` — Sparse-dLLM's delayed bidirectional sparse caching (its LLaDA `generate`):
  in every block, step 0 is a full forward with no cache, step 1 a second full forward that
  caches the keys/values and evicts all but `retention_ratio` of the context (top-k of the
  block queries' pooled scores, one set shared by all heads), steps 2.. compute the block
  against the retained context;
* `dllm_cache` — dLLM-Cache's adaptive feature caching (`DllmCacheIntervals`): a full forward
  at the request's step 0; the response's features (all `gen_length` positions) recomputed
  every `gen_interval` steps and the prompt's every `prompt_interval` steps; in between the
  value projection of the whole response and, for the `transfer_ratio` of its positions whose
  values moved most, the whole layer. Its cache holds keys, values, attention and MLP outputs
  per token (`feature_cache_bytes_per_token`). Its LM head runs on every position every step.

**Two step-time backends** with the same interface: `DiffusionPerfModel` (`backend`
"datasheet": the roofline above) and `MeasuredDiffusionPerfModel` ("aiconfigurator": kernel
by kernel from NVIDIA aiconfigurator's per-op timings measured on real GPUs, tabulated for an
autoregressive twin of the model's shape; see its docstring for the mapping of bidirectional
attention onto causal tables). `diffusion_perf_model(gpu, model, backend=...)` picks one;
`auto` falls back to the datasheet roofline, with a warning and a `note` every report prints,
where the GPU is not covered (RTX 4090). The memory model is the same for both.

Pure arithmetic: no torch, no clock; `diffusion_perf_model` reads (and writes) the measured
tables' cache through `splitserve.perf.aiconfigurator`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from splitserve.core.diffusion import DiffusionBatch, DiffusionWork, Phase, retained_tokens
from splitserve.perf.presets import (DEFAULT_EFFICIENCY, GB, Efficiency, GpuSpec, ModelSpec, gpu_spec,
                                     model_spec)

if TYPE_CHECKING:
    from splitserve.perf.tables import StepTables

__all__ = ["ACTIVATION_DTYPE_BYTES", "DEFAULT_MEMORY_UTILIZATION", "DIFFUSION_PERF_BACKENDS", "DiffusionPerfModel",
           "DllmCacheIntervals", "EntryShape", "LOGIT_BYTES_PER_ELEMENT", "METHODS", "MeasuredDiffusionPerfModel",
           "MemoryPlan", "ONE_QUERY_TILE", "PROFILE_GUARD_FRACTION", "REUSE_ATTENTION_MAPPINGS", "StepCost",
           "diffusion_perf_model"]

log = logging.getLogger(__name__)

# The weights, activations and KV cache are bf16 (LLaDA-8B ships in bf16; the presets' convention).
ACTIVATION_DTYPE_BYTES = 2
# The logit peak per (row, vocab entry). LLaDA's decoding needs the softmax of each logit row
# (the candidate's confidence for `low_confidence` remasking): the runner here upcasts the
# LM head's output to fp32 and takes its softmax, so an fp32 logit and an fp32 probability
# exist together: 4 + 4 bytes (the bf16 head output is freed by the upcast). Fast-dLLM's
# `get_transfer_index` upcasts to float64 instead (8 + 8 bytes, plus the bf16 logits it keeps),
# so this is the smaller, conservative reading for the baseline: its batch fits more easily.
LOGIT_BYTES_PER_ELEMENT = 8
# dLLM-Serve §4.2's guard band over the profiled activation peak (allocator fragmentation,
# kernel selection): the same 5% as workers/diffusion/engine.PROFILE_GUARD_FRACTION.
PROFILE_GUARD_FRACTION = 0.05
# The device's share a worker may use (vLLM's and EngineConfig's gpu_memory_utilization default):
# the other 10% is the CUDA context, cuBLAS/FlashAttention workspaces and what other processes hold.
DEFAULT_MEMORY_UTILIZATION = 0.90
# The decoding loops whose steps are modelled (module docstring).
METHODS = ("dual", "sparse_dllm", "dllm_cache")
# `datasheet`: the roofline (`DiffusionPerfModel.preset`); `aiconfigurator`: measured kernel
# tables (`MeasuredDiffusionPerfModel`); `auto`: measured where covered, else the datasheet.
DIFFUSION_PERF_BACKENDS = ("auto", "aiconfigurator", "datasheet")
# How the measured model times attention of a few queries over a long context (a Reuse):
# `decode` (default) the measured batched decode-attention table, `prefill` the per-request
# prefill-attention table (MeasuredDiffusionPerfModel's docstring compares them).
REUSE_ATTENTION_MAPPINGS = ("decode", "prefill")
# FlashAttention-2's query tile for head_dim 128 (kBlockM): up to this many queries of one
# request occupy one tile, as a single decode query does, so the kernel's grid and work match.
ONE_QUERY_TILE = 128


@dataclass(frozen=True)
class DllmCacheIntervals:
    """dLLM-Cache's knobs (Liu et al. 2025; `dLLMCacheConfig`): the prompt's features recomputed
    every `prompt_interval` steps, the response's every `gen_interval` (dLLM-Serve Table 3: 100
    and 7), and between those, the `transfer_ratio` of the response positions whose value
    vectors changed most (lowest cosine similarity) recomputed (its LLaDA demo's 0.25; Table 3
    does not give it)."""

    prompt_interval: int = 100
    gen_interval: int = 7
    transfer_ratio: float = 0.25

    def __post_init__(self) -> None:
        for name in ("prompt_interval", "gen_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.transfer_ratio <= 1:
            raise ValueError(f"transfer_ratio must be in [0, 1], got {self.transfer_ratio!r}")


@dataclass(frozen=True)
class EntryShape:
    """What one request computes in one step (one forward pass; classifier-free guidance makes two).

    `query_tokens` go through every linear layer; `extra_linear_tokens` are token-equivalents of
    partial projections (dLLM-Cache's value projection of the whole response); attention is
    `query_tokens` queries over `context` other keys plus their own (`query_tokens x (context +
    query_tokens)` pairs, bidirectional); `logit_rows` through the LM head; `kv_read` /
    `kv_write` tokens of cache read / written; `full`: the whole sequence was computed."""

    query_tokens: int
    context: int
    logit_rows: int
    kv_read: int = 0
    kv_write: int = 0
    extra_linear_tokens: float = 0.0
    full: bool = False

    @property
    def keys(self) -> int:
        return self.context + self.query_tokens

    @property
    def attention_pairs(self) -> int:
        return self.query_tokens * self.keys


@dataclass(frozen=True)
class StepCost:
    """What one step computes and moves, and its roofline time (seconds)."""

    entries: int
    refresh_entries: int
    query_tokens: int  # rows through the linear layers (padding included)
    attention_pairs: int  # (query, key) pairs, all heads counted in the model's FLOPs per pair
    logit_rows: int  # rows through the LM head
    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    overhead_s: float
    # The measured backend: the step's kernel time (linear + attention + logits, seconds) and its
    # parts; None on the datasheet roofline, whose time is max(compute_s, memory_s).
    measured_s: float | None = None
    kernels: tuple[tuple[str, float], ...] = ()

    @property
    def seconds(self) -> float:
        if not self.entries:
            return 0.0
        if self.measured_s is not None:
            return self.overhead_s + self.measured_s
        return self.overhead_s + max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        """Which resource the step waits on at the datasheet's peaks: "compute" (tensor cores) or
        "memory" (HBM); the roofline's classification of the step's work, for either backend."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class MemoryPlan:
    """How the device's share splits (bytes): weights, the activation reserve (activations +
    logit peak, with the guard band) and the KV pool; `static_batch_size` for a static plan."""

    usable_bytes: int  # memory_utilization x the datasheet capacity
    weight_bytes: int
    activation_bytes: int  # transformer activations of the reserved step's query tokens
    logit_bytes: int  # the reserved logit peak
    guard_bytes: int
    kv_pool_bytes: int  # what is left (never negative)
    kv_bytes_per_token: int
    reserved_query_tokens: int
    reserved_logit_rows: int
    static_batch_size: int | None = None

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_pool_bytes // self.kv_bytes_per_token

    @property
    def unused_bytes(self) -> int:
        """What no part claims (a static batch cannot use the remainder below one more request)."""
        return max(0, self.usable_bytes - self.weight_bytes - self.activation_bytes - self.logit_bytes
                   - self.guard_bytes - self.kv_pool_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "kv_capacity_tokens": self.kv_capacity_tokens, "unused_bytes": self.unused_bytes}


@dataclass(frozen=True)
class DiffusionPerfModel:
    """Roofline step times and memory plans of `model` (a diffusion LM) on one `gpu`."""

    gpu: GpuSpec
    model: ModelSpec
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    logit_bytes_per_element: int = LOGIT_BYTES_PER_ELEMENT
    # Bytes a request's cache holds per token, when not the model's KV (dLLM-Cache's feature cache).
    cache_bytes_per_token: int | None = None
    # Why this backend times the steps when another was asked for (`diffusion_perf_model`'s
    # fallback); printed by `describe`.
    note: str = field(default="", compare=False)

    backend = "datasheet"

    @classmethod
    def preset(cls, gpu: str | GpuSpec, model: str | ModelSpec, *,
               efficiency: Efficiency = DEFAULT_EFFICIENCY) -> DiffusionPerfModel:
        """From the datasheet tables (`perf_presets.GPU_SPECS`, `MODEL_SPECS`); ValueError for an
        autoregressive model (its steps are not denoising steps)."""
        m = model_spec(model)
        if m.kind != "diffusion":
            raise ValueError(f"{m.name} is an autoregressive model; the diffusion model needs a diffusion LM")
        return cls(gpu_spec(gpu), m, efficiency)

    @property
    def label(self) -> str:
        return f"{self.gpu.name}/{self.model.name}"

    def describe(self) -> str:
        """One line for a report: what timed the steps, on which data."""
        text = (f"step times: virtual time on the datasheet roofline (not measured): {self.label} "
                f"({self.gpu.bf16_tflops:g} TFLOPS x {self.efficiency.prefill_mfu:g}, "
                f"{self.gpu.mem_bw_gbs:g} GB/s x {self.efficiency.prefill_bw:g})")
        return f"{text}; WARNING: {self.note}" if self.note else text

    # ---- shapes --------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of a request's cache per token: the model's keys and values (all layers), or
        `cache_bytes_per_token` when set."""
        if self.cache_bytes_per_token is not None:
            return self.cache_bytes_per_token
        return self.model.kv_bytes_per_token(ACTIVATION_DTYPE_BYTES)

    @property
    def feature_cache_bytes_per_token(self) -> int:
        """dLLM-Cache's cache per token (its Table 1 "sizeof(KV + Attn + FFN)"): keys and values,
        and the attention and MLP outputs (hidden each), every layer, bf16. LLaDA-8B (MHA): twice
        its KV."""
        m = self.model
        return ACTIVATION_DTYPE_BYTES * m.layers * (2 * m.kv_heads * m.head_dim + 2 * m.hidden)

    @property
    def value_projection_fraction(self) -> float:
        """The value projection's share of a token's linear FLOPs (dLLM-Cache computes it for the
        whole response every step)."""
        m = self.model
        return m.layers * m.hidden * m.kv_heads * m.head_dim / m.linear_params

    @property
    def weight_bytes(self) -> int:
        """Resident weights: the layers, the input embedding and (untied) the LM head."""
        vocab_matrices = 1 if self.model.tied_embeddings else 2
        return ACTIVATION_DTYPE_BYTES * (self.model.linear_params + vocab_matrices * self.model.vocab_params)

    @property
    def weight_read_bytes(self) -> int:
        """Weights streamed from HBM per step: every layer and the LM head; the embedding is
        only gathered at the batch's token ids (negligible), as `perf_presets` counts it."""
        return ACTIVATION_DTYPE_BYTES * (self.model.linear_params + self.model.vocab_params)

    @property
    def activation_bytes_per_token(self) -> int:
        """Peak transformer activations per query token, at the gated MLP of a layer: the
        residual stream and its normed copy (2 x hidden), and SiLU(gate), up and their product
        (3 x intermediate; the raw gate is freed by the SiLU), bf16. Attention runs as
        FlashAttention (no L x L score matrix), so it is below this peak."""
        m = self.model
        return ACTIVATION_DTYPE_BYTES * (2 * m.hidden + 3 * m.intermediate)

    @property
    def logit_row_bytes(self) -> int:
        return self.model.vocab * self.logit_bytes_per_element

    # ---- time ----------------------------------------------------------------------------------
    def entry_shapes(self, work: DiffusionWork, *, cache: str = "dual", full_sequence_logits: bool = False,
                     padded_length: int = 0, method: str = "dual",
                     dllm_cache: DllmCacheIntervals = DllmCacheIntervals()) -> list[EntryShape]:
        """What `work` computes this step under `method` (module docstring), one shape per forward
        pass. `full_sequence_logits`: a full forward computes logits for all its positions (the
        baselines) instead of its block's (dLLM-Serve's runner); `padded_length`: the sequence
        counts as at least this long (a static batch is one rectangular tensor)."""
        seq = work.seq
        p = seq.params
        length = max(seq.length, padded_length)
        block = p.block_length
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")

        def full_rows() -> int:
            return length if full_sequence_logits else block

        if method == "dual" or cache == "none":
            if work.phase is Phase.REFRESH:
                passes = 2 if p.cfg_scale > 0 else 1  # guidance: a second, unconditional pass
                write = 0
                if cache == "dual":  # the whole sequence's KV (or the retained context) is cached
                    write = length if p.retention_ratio >= 1 else retained_tokens(length - block, p.retention_ratio)
                return [EntryShape(length, 0, full_rows(), kv_write=write if i == 0 else 0, full=True)
                        for i in range(passes)]
            context = length - block
            if p.retention_ratio < 1:
                context = retained_tokens(context, p.retention_ratio)
            return [EntryShape(block, context, block, kv_read=context)]
        if method == "sparse_dllm":
            if seq.step_in_block == 0:  # a full forward, no cache
                return [EntryShape(length, 0, full_rows(), full=True)]
            if seq.step_in_block == 1:  # a full forward that caches K/V, then evicts to the retained set
                return [EntryShape(length, 0, full_rows(), kv_write=length, full=True)]
            context = retained_tokens(length - block, p.retention_ratio) if p.retention_ratio < 1 else length - block
            return [EntryShape(block, context, block, kv_read=context)]
        # dllm_cache: the request's global step decides what is recomputed.
        step = seq.steps_done
        gen = p.gen_length
        prompt = length - gen
        rows = length if full_sequence_logits else block
        prompt_due = step % dllm_cache.prompt_interval == 0
        gen_due = step % dllm_cache.gen_interval == 0
        if prompt_due and gen_due:
            return [EntryShape(length, 0, rows, kv_write=length, full=True)]
        if gen_due:  # the response's q/k/v, attention over the cached prompt and itself, MLP
            return [EntryShape(gen, prompt, rows, kv_read=prompt, kv_write=gen)]
        chosen = int(gen * dllm_cache.transfer_ratio)  # its refresh_index: int(gen_len * transfer_ratio)
        v_all = self.value_projection_fraction * gen  # the value projection of the whole response
        if prompt_due:
            query = prompt + chosen
            return [EntryShape(query, length - query, rows, kv_read=length - query, kv_write=query,
                               extra_linear_tokens=v_all)]
        return [EntryShape(chosen, length - chosen, rows, kv_read=length, kv_write=chosen, extra_linear_tokens=v_all)]

    def batch_shapes(self, batch: DiffusionBatch, *, cache: str = "dual", full_sequence_logits: bool = False,
                     pad_to_longest: bool = False, method: str = "dual",
                     dllm_cache: DllmCacheIntervals = DllmCacheIntervals()) -> list[list[EntryShape]]:
        """`entry_shapes` of every entry of the batch (one list per entry)."""
        padded = max(w.seq.length for w in batch.entries) if pad_to_longest and batch.entries else 0
        return [self.entry_shapes(work, cache=cache, full_sequence_logits=full_sequence_logits, padded_length=padded,
                                  method=method, dllm_cache=dllm_cache) for work in batch.entries]

    def step_cost(self, batch: DiffusionBatch, *, cache: str = "dual", full_sequence_logits: bool = False,
                  pad_to_longest: bool = False, method: str = "dual",
                  dllm_cache: DllmCacheIntervals = DllmCacheIntervals(),
                  max_num_logits: int | None = None) -> StepCost:
        """The cost of one step (module docstring). `full_sequence_logits`: a full forward computes
        logits for all its positions (Fast-dLLM) instead of its block's (dLLM-Serve's runner).
        `pad_to_longest`: every request costs the batch's longest sequence (a static batch is
        one rectangular tensor). `method`: the decoding loop (`METHODS`). `max_num_logits`: the
        LM head runs in chunks of at most this many rows (logit decomposition; None: one GEMM)
        — the roofline's FLOPs do not depend on it, the measured backend's time does."""
        if not batch.entries:
            return StepCost(0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
        shapes = self.batch_shapes(batch, cache=cache, full_sequence_logits=full_sequence_logits,
                                   pad_to_longest=pad_to_longest, method=method, dllm_cache=dllm_cache)
        return self._cost(shapes, max_num_logits)

    def _cost(self, per_entry: list[list[EntryShape]], max_num_logits: int | None) -> StepCost:
        """The datasheet roofline of the shapes (the measured model adds its kernel times)."""
        m, e = self.model, self.efficiency
        shapes = [s for entry in per_entry for s in entry]
        query = sum(s.query_tokens for s in shapes)
        linear_tokens = query + sum(s.extra_linear_tokens for s in shapes)
        pairs = sum(s.attention_pairs for s in shapes)
        rows = sum(s.logit_rows for s in shapes)
        kv = sum(s.kv_read + s.kv_write for s in shapes)
        refreshes = sum(1 for entry in per_entry if any(s.full for s in entry))
        entries = len(per_entry)
        flops = (2.0 * m.linear_params * linear_tokens + float(m.attn_flops_per_pair) * pairs
                 + 2.0 * m.vocab_params * rows)
        hbm = float(self.weight_read_bytes) + self.kv_bytes_per_token * float(kv)
        compute_s = flops / (self.gpu.bf16_tflops * 1e12 * e.prefill_mfu)
        memory_s = hbm / (self.gpu.mem_bw_gbs * GB * e.prefill_bw)
        overhead_s = e.step_overhead_s + e.per_seq_overhead_s * entries
        return StepCost(entries, refreshes, query, pairs, rows, flops, hbm, compute_s, memory_s, overhead_s)

    def step_time(self, batch: DiffusionBatch, **options) -> float:
        """Seconds of one step (`step_cost(...).seconds`; 0 for an empty batch)."""
        return self.step_cost(batch, **options).seconds

    # ---- memory --------------------------------------------------------------------------------
    def usable_bytes(self, memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> int:
        if not 0 < memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
        return int(self.gpu.mem_gb * GB * memory_utilization)

    def activation_bytes(self, query_tokens: int) -> int:
        _check_count("query_tokens", query_tokens)
        return query_tokens * self.activation_bytes_per_token

    def logit_peak_bytes(self, logit_rows: int, max_num_logits: int | None = None) -> int:
        """Bytes of logits a step holds at once: all its rows x vocab without decomposition
        (`max_num_logits` None), at most `max_num_logits` rows with it (§4.3)."""
        _check_count("logit_rows", logit_rows)
        if max_num_logits is not None:
            _check_count("max_num_logits", max_num_logits, minimum=1)
            logit_rows = min(logit_rows, max_num_logits)
        return logit_rows * self.logit_row_bytes

    def plan(self, query_tokens: int, logit_rows: int, *, memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
             static_batch_size: int | None = None) -> MemoryPlan:
        """The split when the reserve covers a step of `query_tokens` query tokens holding
        `logit_rows` logit rows at once (§4.2: device share - weights - reserve x (1 + guard))."""
        usable = self.usable_bytes(memory_utilization)
        activations = self.activation_bytes(query_tokens)
        logits = self.logit_peak_bytes(logit_rows)
        guard = math.ceil((activations + logits) * PROFILE_GUARD_FRACTION)
        pool = max(0, usable - self.weight_bytes - activations - logits - guard)
        return MemoryPlan(usable, self.weight_bytes, activations, logits, guard, pool, self.kv_bytes_per_token,
                          query_tokens, logit_rows, static_batch_size)

    def logit_aware_plan(self, max_num_batched_tokens: int, max_num_logits: int, *,
                         memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> MemoryPlan:
        """dLLM-Serve's profiler (§4.2): the worst step (max_num_batched_tokens query tokens)
        with its logits decomposed, so at most max_num_logits rows at once."""
        _check_count("max_num_logits", max_num_logits, minimum=1)
        return self.plan(max_num_batched_tokens, max_num_logits, memory_utilization=memory_utilization)

    def monolithic_plan(self, max_num_batched_tokens: int, *,
                        memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> MemoryPlan:
        """A profiler unaware of logits (Figure 2's standard profiling): a step may materialise
        a logit row for every one of its query tokens (a Refresh with full-sequence logits)."""
        return self.plan(max_num_batched_tokens, max_num_batched_tokens, memory_utilization=memory_utilization)

    def static_plan(self, batch_size: int, seq_len: int, *, logit_rows_per_request: int | None = None,
                    max_num_logits: int | None = None, kv_tokens_per_request: int | None = None,
                    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> MemoryPlan:
        """A static batch of `batch_size` requests padded to `seq_len`, provisioned for its Refresh
        step: batch x seq_len query tokens, `logit_rows_per_request` rows each (default the whole
        sequence: Fast-dLLM), capped at `max_num_logits` with decomposition. (`kv_tokens_per_request`
        is `static_fits`' option; it does not change the reserve.)"""
        _check_count("batch_size", batch_size, minimum=1)
        _check_count("seq_len", seq_len, minimum=1)
        per_request = seq_len if logit_rows_per_request is None else logit_rows_per_request
        rows = batch_size * per_request
        if max_num_logits is not None:
            rows = min(rows, max_num_logits)
        return self.plan(batch_size * seq_len, rows, memory_utilization=memory_utilization,
                         static_batch_size=batch_size)

    def static_fits(self, batch_size: int, seq_len: int, *, kv_tokens_per_request: int | None = None,
                    **options) -> bool:
        """Whether the batch's cache (batch x `kv_tokens_per_request` tokens, default seq_len: a
        sparse cache keeps fewer) fits beside its Refresh reserve."""
        kv = seq_len if kv_tokens_per_request is None else kv_tokens_per_request
        return self.static_plan(batch_size, seq_len, **options).kv_capacity_tokens >= batch_size * kv

    def largest_static_batch(self, seq_len: int, **options) -> MemoryPlan:
        """The plan of the largest static batch that fits (`static_fits`); its KV pool is exactly
        that batch's cache. ValueError when not even one request fits."""
        if not self.static_fits(1, seq_len, **options):
            raise ValueError(f"{self.label}: not even one request of {seq_len} tokens fits beside its Refresh "
                             "reserve")
        lo, hi = 1, 2
        while self.static_fits(hi, seq_len, **options):
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # fits(lo), not fits(hi): the footprint grows with the batch
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.static_fits(mid, seq_len, **options) else (lo, mid)
        plan = self.static_plan(lo, seq_len, **options)
        per_request = options.get("kv_tokens_per_request")
        kv = lo * (seq_len if per_request is None else per_request) * self.kv_bytes_per_token
        return MemoryPlan(plan.usable_bytes, plan.weight_bytes, plan.activation_bytes, plan.logit_bytes,
                          plan.guard_bytes, kv, plan.kv_bytes_per_token, plan.reserved_query_tokens,
                          plan.reserved_logit_rows, lo)


@dataclass(frozen=True)
class MeasuredDiffusionPerfModel(DiffusionPerfModel):
    """Step times from measured kernel tables (`backend` "aiconfigurator"); memory as the roofline's.

    `tables` are `splitserve.perf.aiconfigurator.tabulate`'s for an autoregressive twin of the
    diffusion model's shape (`dataclasses.replace(spec, kind="ar")`: aiconfigurator times kernels
    by shape and refuses diffusion models only because it models AR serving): per-kernel times
    NVIDIA measured on the GPU with vLLM's kernels. A step is, kernel by kernel (the kernels of
    one forward run one after another, so their times add):

        seconds = overhead + linear(T) + attention + logits(R)

    * **linear(T)**: the context-phase linear kernels (GEMMs, norms, activation) over the T
      tokens every entry computes (plus dLLM-Cache's partial projections in token-equivalents);
    * **attention**, per entry of q queries over c other keys and their own (q x (c + q) pairs,
      bidirectional), mapped onto the causal tables:
      - q > `ONE_QUERY_TILE` (a Refresh: q = n, c = 0; dLLM-Cache's response/prompt refresh):
        `prefill_attention(L = q, H = c + q/2)`: a causal chunk of q new tokens on H cached ones
        has q x H + q^2/2 pairs, so H = c + q/2 gives exactly q x (c + q) — for a Refresh n^2,
        twice the causal n(n+1)/2 pairs, i.e. "full bidirectional attention ~ 2 x causal" — with
        the same q query rows in one kernel launch (2 x `prefill_attention(n, 0)`, the measured
        causal rows only, agrees within 12% from n = 4,096 up and counts a second launch floor
        below: 1.2-2x this at 256-1,280 tokens, 1-4% of a Refresh step on the L40S and A100,
        5-10% on the H100);
      - q <= `ONE_QUERY_TILE` (a Reuse block of 32 over the cached context; dLLM-Cache's 64
        transferred positions): `reuse_attention` "decode" (default): all such entries together,
        read off the measured batched decode-attention table t(B, keys). vLLM's FlashAttention-2
        runs decode as the same varlen kernel; with <= 128 queries per sequence a Reuse occupies
        the one query tile a decode query does, so the grid (B x heads), the tile FLOPs and the
        KV bytes read are the same, in one launch for the batch (dLLM-Serve §5.3: "a single
        variable-length FlashAttention dispatch"). The entries' contexts differ; `reuse_group_s`
        reads the table so that equal contexts give it exactly and more work never less time.
        "prefill": each entry as `prefill_attention(q, c + q/2)` (the causal-chunk mapping above,
        one launch per request), the sensitivity: aiconfigurator's prefix rows are estimates
        scaled from measured full causal runs (its database has no prefix axis); on the L40S
        they give every request the same ~0.7 ms (32 layers) from 32 to ~1,300 keys, a launch
        floor for short contexts and less than streaming the context's KV at the datasheet's
        864 GB/s for long ones;
    * **logits(R)**: the LM head over the R rows that need logits, one GEMM (beyond the table's
      2,048 rows: that GEMM's per-row time, the compute-bound rate) or, with logit decomposition,
      chunks of at most `max_num_logits` rows (each re-reads the vocabulary matrix);
    * **overhead**: the roofline's per-step and per-request framework costs (`Efficiency`), the
      only part not measured.

    Not timed: the KV cache writes of a Refresh (< 1% of its linear time) and sparse-cache
    selection (a block's queries scored against the context once per block)."""

    tables: StepTables | None = None
    tables_label: str = ""
    reuse_attention: str = "decode"

    backend = "aiconfigurator"

    def __post_init__(self) -> None:
        if self.tables is None:
            raise ValueError("a measured diffusion perf model needs its tables")
        if self.reuse_attention not in REUSE_ATTENTION_MAPPINGS:
            raise ValueError(f"reuse_attention must be one of {', '.join(REUSE_ATTENTION_MAPPINGS)}, "
                             f"got {self.reuse_attention!r}")

    @property
    def label(self) -> str:
        return self.tables_label or f"aiconfigurator:{self.gpu.name}/{self.model.name}"

    def describe(self) -> str:
        src = self.tables.source
        text = (f"step times: virtual time on measured kernel tables ({self.label}: aiconfigurator "
                f"{src.get('system')}/{src.get('framework')} {src.get('database_version')}, an autoregressive twin of "
                f"{self.model.name}'s shape; Reuse attention: {self.reuse_attention} table)")
        return f"{text}; WARNING: {self.note}" if self.note else text

    def attention_s(self, shapes: list[EntryShape]) -> float:
        """The attention kernels of the shapes (the class docstring's mapping)."""
        t = self.tables
        total, small_keys = 0.0, []
        for s in shapes:
            if s.query_tokens <= 0:
                continue
            if s.query_tokens <= ONE_QUERY_TILE and self.reuse_attention == "decode":
                small_keys.append(s.keys)
            else:
                total += t.prefill_attention_s(s.query_tokens, s.context + s.query_tokens / 2)
        if small_keys:
            total += self.reuse_group_s(small_keys)
        return total

    def reuse_group_s(self, keys: list[float]) -> float:
        """One launch of B requests of few queries each, over `keys[i]` keys each, read off the
        measured decode-attention table t(B, c):

            max( max_j t(j, k_(j)),  sum_i rho(B, k_i) )

        with k_(j) the j-th longest: the j longest requests alone take at least t(j, k_(j)) (the
        longest one's tiles stream its whole context: a latency floor), and each request streams
        its context at rho(B, k) = min over B' >= B of t(B', k) / B', the table's per-request time
        at this batch or any larger one. Equal contexts give t(B, k) exactly; adding a request
        or lengthening one never lowers it (rho does not fall with B, the table not with c); on
        the L40S it lies within 7% of t(B, mean context) for dLLM-Serve's mixes of 12-200 Reuse
        steps (prompts of 64-1,024 tokens)."""
        t = self.tables
        ordered = sorted(keys, reverse=True)
        floor = max(t.decode_attention_s(j + 1, k) for j, k in enumerate(ordered))
        rates = _suffix_rates(t)
        b = len(keys)
        i, _ = _locate(t.decode_batch, b)
        stream = 0.0
        for k in keys:
            j, w = _locate(t.decode_context, k)
            above = rates[i + 1][j] + w * (rates[i + 1][j + 1] - rates[i + 1][j])
            stream += min(t.decode_attention_s(b, k) / b, above)
        return max(floor, stream)

    def logits_s(self, rows: int, max_num_logits: int | None = None) -> float:
        """The LM head over `rows` rows: one GEMM (None), or chunks of at most `max_num_logits`."""
        if rows <= 0:
            return 0.0
        t = self.tables
        if max_num_logits is not None and rows > max_num_logits:
            full, rest = divmod(rows, max_num_logits)
            return full * self.logits_s(max_num_logits) + self.logits_s(rest)
        top = t.logits_rows[-1]
        return t.logits_s(rows) if rows <= top else t.logits_s(top) * rows / top

    def _cost(self, per_entry: list[list[EntryShape]], max_num_logits: int | None) -> StepCost:
        roof = super()._cost(per_entry, max_num_logits)
        shapes = [s for entry in per_entry for s in entry]
        tokens = roof.query_tokens + sum(s.extra_linear_tokens for s in shapes)
        linear = self.tables.linear_s(tokens, True) if tokens > 0 else 0.0
        attention = self.attention_s(shapes)
        logits = self.logits_s(roof.logit_rows, max_num_logits)
        return dataclasses.replace(roof, measured_s=linear + attention + logits,
                                   kernels=(("linear", linear), ("attention", attention), ("logits", logits)))


_SUFFIX_RATES: dict[str, list[list[float]]] = {}


def _suffix_rates(t: StepTables) -> list[list[float]]:
    """[i][c]: min over decode-batch grid points j >= i of t(b_j, c_c) / b_j (made once per tables)."""
    rates = _SUFFIX_RATES.get(t.digest)
    if rates is None:
        rows: list[list[float]] = [[] for _ in t.decode_batch]
        running = [math.inf] * len(t.decode_context)
        for i in range(len(t.decode_batch) - 1, -1, -1):
            running = [min(r, v / t.decode_batch[i]) for r, v in zip(running, t.decode_attention[i])]
            rows[i] = running
        rates = _SUFFIX_RATES[t.digest] = rows
    return rates


def _locate(grid: tuple[float, ...], x: float) -> tuple[int, float]:
    """(i, w): x at grid[i] + w (grid[i+1] - grid[i]) (w > 1 past the end; the first point below it)."""
    if x <= grid[0]:
        return 0, 0.0
    i = len(grid) - 2 if x >= grid[-1] else bisect_right(grid, x) - 1
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def diffusion_perf_model(gpu: str | GpuSpec, model: str | ModelSpec = "LLaDA-8B", *, backend: str = "auto",
                         framework: str = "vllm", database_version: str | None = None,
                         reuse_attention: str = "decode",
                         efficiency: Efficiency = DEFAULT_EFFICIENCY) -> DiffusionPerfModel:
    """The step-time model of a diffusion LM on one GPU (`DIFFUSION_PERF_BACKENDS`):

    * `datasheet`: the roofline (`DiffusionPerfModel.preset`);
    * `aiconfigurator`: `MeasuredDiffusionPerfModel` on the measured tables of the model's
      autoregressive twin (ValueError where the GPU is not covered: RTX 4090);
    * `auto`: measured where covered, else the datasheet roofline with a warning (logged, and in
      the model's `note`, which `describe` prints).

    Either way `backend` and `describe()` say what timed the steps."""
    if backend not in DIFFUSION_PERF_BACKENDS:
        raise ValueError(f"diffusion perf backend must be one of {', '.join(DIFFUSION_PERF_BACKENDS)}, "
                         f"got {backend!r}")
    roofline = DiffusionPerfModel.preset(gpu, model, efficiency=efficiency)
    if backend == "datasheet":
        return roofline
    try:
        tables, label = _measured_tables(roofline.gpu.name, roofline.model, framework, database_version)
    except ValueError as exc:
        if backend == "aiconfigurator":
            raise
        reason = f"{exc}; timed by the datasheet roofline instead (not measured)"
        _warn_fallback(roofline.label, reason)
        return dataclasses.replace(roofline, note=reason)
    return MeasuredDiffusionPerfModel(roofline.gpu, roofline.model, efficiency, tables=tables, tables_label=label,
                                      reuse_attention=reuse_attention)


def _measured_tables(gpu_name: str, model: ModelSpec, framework: str,
                     database_version: str | None) -> tuple[StepTables, str]:
    """aiconfigurator's tables for the autoregressive twin of `model` (same shape, kind "ar")."""
    from splitserve.perf.aiconfigurator import SYSTEMS, tabulate

    gpu_key = next((name for name in SYSTEMS if name == gpu_name), None)
    if gpu_key is None:
        raise ValueError(f"aiconfigurator has no {gpu_name} (covered: {', '.join(SYSTEMS)})")
    twin = dataclasses.replace(model, kind="ar")
    measured = tabulate(_preset_name(gpu_name), twin, framework=framework, database_version=database_version)
    assert measured.tables is not None
    return measured.tables, measured.label + "/ar-twin"


def _preset_name(gpu_name: str) -> str:
    """The `perf_presets.GPU_SPECS` key of a datasheet GPU name."""
    from splitserve.perf.presets import GPU_SPECS

    return next(key for key, spec in GPU_SPECS.items() if spec.name == gpu_name)


@lru_cache(maxsize=64)
def _warn_fallback(label: str, reason: str) -> None:
    log.warning("diffusion perf backend auto: %s: %s", label, reason)


def _check_count(name: str, value, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
