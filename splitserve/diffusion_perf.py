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

Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from splitserve.core.diffusion import DiffusionBatch, Phase, retained_tokens
from splitserve.perf_presets import (DEFAULT_EFFICIENCY, GB, Efficiency, GpuSpec, ModelSpec, gpu_spec,
                                     model_spec)

__all__ = ["ACTIVATION_DTYPE_BYTES", "DEFAULT_MEMORY_UTILIZATION", "DiffusionPerfModel", "LOGIT_BYTES_PER_ELEMENT",
           "MemoryPlan", "PROFILE_GUARD_FRACTION", "StepCost"]

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

    @property
    def seconds(self) -> float:
        return 0.0 if not self.entries else self.overhead_s + max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        """Which resource the step waits on: "compute" (tensor cores) or "memory" (HBM)."""
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

    # ---- shapes --------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(ACTIVATION_DTYPE_BYTES)

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
    def step_cost(self, batch: DiffusionBatch, *, cache: str = "dual", full_sequence_logits: bool = False,
                  pad_to_longest: bool = False) -> StepCost:
        """The roofline of one step (module docstring). `full_sequence_logits`: a Refresh computes
        logits for all its positions (Fast-dLLM) instead of its block's (dLLM-Serve's runner).
        `pad_to_longest`: every request costs the batch's longest sequence (a static batch is
        one rectangular tensor)."""
        m, e = self.model, self.efficiency
        if not batch.entries:
            return StepCost(0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
        padded = max(w.seq.length for w in batch.entries) if pad_to_longest else 0
        query = pairs = rows = kv_read = kv_write = refreshes = 0
        for work in batch.entries:
            seq = work.seq
            length = max(seq.length, padded)
            block = seq.params.block_length
            passes = 2 if seq.params.cfg_scale > 0 else 1  # guidance: a second, unconditional pass
            if work.phase is Phase.REFRESH:
                refreshes += 1
                query += passes * length
                pairs += passes * length * length  # bidirectional: every query sees every key
                rows += passes * (length if full_sequence_logits else block)
                if cache == "dual":  # the whole sequence's KV (or the retained context) is cached
                    kv_write += length if seq.params.retention_ratio >= 1 else \
                        retained_tokens(length - block, seq.params.retention_ratio)
            else:
                context = length - block
                if seq.params.retention_ratio < 1:
                    context = retained_tokens(context, seq.params.retention_ratio)
                query += block
                pairs += block * (context + block)  # the cached context and the block's own fresh KV
                rows += block
                kv_read += context
        flops = (2.0 * m.linear_params * query + float(m.attn_flops_per_pair) * pairs
                 + 2.0 * m.vocab_params * rows)
        hbm = float(self.weight_read_bytes) + self.kv_bytes_per_token * float(kv_read + kv_write)
        compute_s = flops / (self.gpu.bf16_tflops * 1e12 * e.prefill_mfu)
        memory_s = hbm / (self.gpu.mem_bw_gbs * GB * e.prefill_bw)
        overhead_s = e.step_overhead_s + e.per_seq_overhead_s * len(batch.entries)
        return StepCost(len(batch.entries), refreshes, query, pairs, rows, flops, hbm, compute_s, memory_s, overhead_s)

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
                    max_num_logits: int | None = None,
                    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> MemoryPlan:
        """A static batch of `batch_size` requests padded to `seq_len`, provisioned for its Refresh
        step: batch x seq_len query tokens, `logit_rows_per_request` rows each (default the whole
        sequence: Fast-dLLM), capped at `max_num_logits` with decomposition."""
        _check_count("batch_size", batch_size, minimum=1)
        _check_count("seq_len", seq_len, minimum=1)
        per_request = seq_len if logit_rows_per_request is None else logit_rows_per_request
        rows = batch_size * per_request
        if max_num_logits is not None:
            rows = min(rows, max_num_logits)
        return self.plan(batch_size * seq_len, rows, memory_utilization=memory_utilization,
                         static_batch_size=batch_size)

    def static_fits(self, batch_size: int, seq_len: int, **options) -> bool:
        """Whether the batch's KV (batch x seq_len tokens) fits beside its Refresh reserve."""
        return self.static_plan(batch_size, seq_len, **options).kv_capacity_tokens >= batch_size * seq_len

    def largest_static_batch(self, seq_len: int, **options) -> MemoryPlan:
        """The plan of the largest static batch that fits (`static_fits`); its KV pool is exactly
        that batch's KV. ValueError when not even one request fits."""
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
        kv = lo * seq_len * self.kv_bytes_per_token
        return MemoryPlan(plan.usable_bytes, plan.weight_bytes, plan.activation_bytes, plan.logit_bytes,
                          plan.guard_bytes, kv, plan.kv_bytes_per_token, plan.reserved_query_tokens,
                          plan.reserved_logit_rows, lo)


def _check_count(name: str, value, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
