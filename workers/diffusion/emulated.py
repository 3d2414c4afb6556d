"""The emulated diffusion runner: LLaDA steps timed by a performance model, no weights (dLLM-Serve).

`EmulatedDiffusionRunner` implements the runner interface `DiffusionEngine` drives (`start`,
`execute`, `tokens`, `release`; the real one is `workers/diffusion/runner.py`): `execute`
computes the step's time with `splitserve.core.diffusion_perf.DiffusionPerfModel` — Refresh and
Reuse entries, logit rows, padding — and advances an injected `VirtualClock` by it, so a whole
serving run takes as long as the Python control plane needs, not the emulated GPU's time.
Tokens are unmasked on `DiffusionParams`' schedule (`transfer_token_schedule`: the step's
`num_transfer` masked positions of the current block, left to right) with deterministic ids
(splitmix64 of the request and the position) that are never a special token: the content does
not matter, and an emulated request never stops early at EOS, it runs its `max_tokens`.

`build_emulated_diffusion_engine` makes the real `DiffusionEngine` (its scheduler, block
events and admission unchanged) over this runner for a (GPU, model) preset, its KV pool sized
by the memory model: the logit-aware plan (§4.2) with logit decomposition, a monolithic
profile without. `dllm_serve_config` and `static_baseline_config` give the systems of the
evaluation (`benchmarks/dllm_emulated.py`) their engine options and memory split.

`DiffusionEmulation.perf_backend` picks what times the steps (`diffusion_perf.diffusion_perf_model`:
the datasheet roofline, the measured aiconfigurator kernel tables, or `auto`); `method` the
decoding loop whose steps are timed (`diffusion_perf.METHODS`: the dual cache of Fast-dLLM and
dLLM-Serve, Sparse-dLLM's two full forwards per block, dLLM-Cache's interval refreshes). The
engine's scheduler is the same for all: a baseline's batching is its `static` policy, its
cost is the runner's.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from functools import lru_cache

from splitserve.core.diffusion import DiffusionBatch, DiffusionSequence, retained_tokens
from splitserve.core.sampling import mix_seed
from splitserve.core.diffusion_perf import (DEFAULT_MEMORY_UTILIZATION, LOGIT_BYTES_PER_ELEMENT, METHODS,
                                      DiffusionPerfModel, DllmCacheIntervals, MemoryPlan, StepCost,
                                      diffusion_perf_model)
from workers.diffusion.engine import DiffusionEngine
from workers.engine.config import EngineConfig
from workers.engine.models.llada import LladaConfig

__all__ = ["DiffusionEmulation", "EmulatedDiffusionRunner", "LLADA_EOS_TOKEN_IDS", "LLADA_MASK_TOKEN_ID",
           "ORDINARY_TOKEN_LIMIT", "RunnerStats", "VirtualClock", "build_emulated_diffusion_engine",
           "dllm_serve_config", "emulated_llada_config", "static_baseline_config"]

# LLaDA-8B's tokenizer (GSAI-ML/LLaDA-8B-Instruct): the special tokens sit from id 126080 up —
# <|startoftext|> 126080, <|endoftext|> 126081 (EOS), the mask 126336 (LLaDA's `generate`
# mask_id), <|eot_id|> 126348 — so emitted ids are drawn below 126080: never EOS, never the mask.
LLADA_MASK_TOKEN_ID = 126336
LLADA_EOS_TOKEN_IDS = frozenset({126081, 126348})
ORDINARY_TOKEN_LIMIT = 126080
# LLaDA-8B's config.json: RoPE base and RMSNorm epsilon (only shape the config; nothing is computed).
LLADA_ROPE_THETA = 500000.0
LLADA_RMS_NORM_EPS = 1e-5



class VirtualClock:
    """Seconds of emulated time; only `advance` / `advance_to` move it (the engine's `clock`)."""

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back: advance({seconds})")
        self.now += seconds

    def advance_to(self, when: float) -> None:
        """Idle until `when` (no-op if it is already past)."""
        self.now = max(self.now, when)


@dataclass
class RunnerStats:
    """Sums over the executed steps."""

    steps: int = 0
    busy_s: float = 0.0  # the perf model's step times
    refresh_entries: int = 0
    reuse_entries: int = 0
    compute_bound_steps: int = 0
    memory_bound_steps: int = 0
    peak_query_tokens: int = 0
    peak_logit_rows: int = 0  # the most logit rows materialised at once (decomposition bounds it)


@dataclass
class _RequestState:
    seq: DiffusionSequence
    ids: list[int]
    token_key: int  # what the emitted ids are derived from
    masked: list[int] = field(default_factory=list)  # masked positions of the current block, in order


class EmulatedDiffusionRunner:
    """A `DiffusionRunner` stand-in: per-step time from `perf`, tokens from a hash."""

    def __init__(self, perf: DiffusionPerfModel, *, clock: VirtualClock | None = None, cache: str = "dual",
                 full_sequence_logits: bool = False, pad_to_longest: bool = False,
                 max_num_logits: int | None = None, mask_token_id: int = LLADA_MASK_TOKEN_ID,
                 ordinary_token_limit: int = ORDINARY_TOKEN_LIMIT, method: str = "dual",
                 dllm_cache: DllmCacheIntervals = DllmCacheIntervals()):
        if max_num_logits is not None and max_num_logits < 1:
            raise ValueError(f"max_num_logits must be >= 1, got {max_num_logits}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        self.perf = perf
        self.clock = clock
        self.cache = cache
        self.method = method
        self.dllm_cache = dllm_cache
        self.full_sequence_logits = full_sequence_logits
        self.pad_to_longest = pad_to_longest
        self.max_num_logits = max_num_logits  # None: no decomposition, every row at once
        self.mask_token_id = mask_token_id
        self.ordinary_token_limit = ordinary_token_limit
        self.states: dict[str, _RequestState] = {}
        self.stats = RunnerStats()
        self.last_cost: StepCost | None = None

    # ---- request state ------------------------------------------------------------------------
    def start(self, seq: DiffusionSequence, prompt_ids: list[int], seed: int | None) -> None:
        # The seed when the request has one, else a stable hash of its key (Python's hash() is salted).
        key = seed if seed is not None else zlib.crc32(seq.key.encode())
        self.states[seq.key] = _RequestState(seq, list(prompt_ids) + [self.mask_token_id] * seq.params.gen_length, key)

    def release(self, key: str) -> None:
        self.states.pop(key, None)

    def tokens(self, key: str, start: int, end: int) -> list[int]:
        return self.states[key].ids[start:end]

    # ---- one step -----------------------------------------------------------------------------
    def step_cost(self, batch: DiffusionBatch) -> StepCost:
        return self.perf.step_cost(batch, cache=self.cache, full_sequence_logits=self.full_sequence_logits,
                                   pad_to_longest=self.pad_to_longest, method=self.method,
                                   dllm_cache=self.dllm_cache, max_num_logits=self.max_num_logits)

    def execute(self, batch: DiffusionBatch) -> float:
        """Unmask every request's scheduled tokens, advance the clock by the step's modelled time;
        returns that time (seconds)."""
        if not batch.entries:
            return 0.0
        for work in batch.entries:
            self._unmask(self.states[work.seq.key])
        cost = self.step_cost(batch)
        seconds = cost.seconds
        s = self.stats
        s.steps += 1
        s.busy_s += seconds
        s.refresh_entries += cost.refresh_entries
        s.reuse_entries += cost.entries - cost.refresh_entries
        s.compute_bound_steps += cost.bound == "compute"
        s.memory_bound_steps += cost.bound == "memory"
        s.peak_query_tokens = max(s.peak_query_tokens, cost.query_tokens)
        at_once = cost.logit_rows if self.max_num_logits is None else min(cost.logit_rows, self.max_num_logits)
        s.peak_logit_rows = max(s.peak_logit_rows, at_once)
        self.last_cost = cost
        if self.clock is not None:
            self.clock.advance(seconds)
        return seconds

    def _unmask(self, state: _RequestState) -> None:
        seq = state.seq
        if seq.step_in_block == 0:  # a new block: all of its positions are masked
            state.masked = list(range(seq.block_start, seq.block_start + seq.params.block_length))
        count = seq.num_transfer
        for position in state.masked[:count]:
            state.ids[position] = mix_seed(state.token_key, position) % self.ordinary_token_limit
        del state.masked[:count]


# ---- the engine over it -------------------------------------------------------------------------
@dataclass(frozen=True)
class DiffusionEmulation:
    """Which hardware and model the emulated diffusion worker pretends to be, and how it runs."""

    gpu: str = "RTX4090"
    model: str = "LLaDA-8B"
    # dLLM-Serve §4.3: only the blocks' logit rows, at most max_num_logits at once, and the KV
    # pool of the logit-aware profile (§4.2). Off (Fast-dLLM): a Refresh computes every
    # position's logits at once, and the profile must reserve a logit row per query token.
    logit_decomposition: bool = True
    pad_to_longest: bool = False  # a static batch as one rectangular tensor (Fast-dLLM's generate)
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    # Bytes held per logit element at the logit peak (`diffusion_perf.LOGIT_BYTES_PER_ELEMENT`:
    # fp32 logits + fp32 softmax); 18 is Fast-dLLM's own decoding (bf16 logits kept, float64
    # copy, float64 softmax), a sensitivity of the baseline's memory.
    logit_bytes_per_element: int = LOGIT_BYTES_PER_ELEMENT
    # What times the steps (`diffusion_perf.DIFFUSION_PERF_BACKENDS`): the datasheet roofline (the
    # default, every result before issue 34), the measured kernel tables, or auto (measured where
    # covered: not on the RTX 4090).
    perf_backend: str = "datasheet"
    # The measured backend's mapping of a Reuse's attention (`diffusion_perf.REUSE_ATTENTION_MAPPINGS`).
    reuse_attention: str = "decode"
    # The decoding loop whose steps are timed (`diffusion_perf.METHODS`); `dllm_cache` its knobs.
    method: str = "dual"
    dllm_cache: DllmCacheIntervals = DllmCacheIntervals()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")

    def perf_model(self) -> DiffusionPerfModel:
        perf = _perf_model(self.gpu, self.model, self.perf_backend, self.reuse_attention)
        cache_bytes = perf.feature_cache_bytes_per_token if self.method == "dllm_cache" else None
        return dataclasses.replace(perf, logit_bytes_per_element=self.logit_bytes_per_element,
                                   cache_bytes_per_token=cache_bytes)

    def memory_plan(self, config: EngineConfig) -> MemoryPlan:
        """The split the engine's KV pool is sized by (when config.kv_cache_memory_bytes is unset)."""
        perf = self.perf_model()
        if self.logit_decomposition:
            return perf.logit_aware_plan(config.max_num_batched_tokens, config.max_num_logits,
                                         memory_utilization=self.memory_utilization)
        return perf.monolithic_plan(config.max_num_batched_tokens, memory_utilization=self.memory_utilization)


@lru_cache(maxsize=32)
def _perf_model(gpu: str, model: str, backend: str, reuse_attention: str) -> DiffusionPerfModel:
    """One model per (GPU, model, backend): measured tables are tabulated (or read) once."""
    return diffusion_perf_model(gpu, model, backend=backend, reuse_attention=reuse_attention)


def emulated_llada_config(perf: DiffusionPerfModel) -> LladaConfig:
    """The LladaConfig of the preset's shape (what the engine validates requests against)."""
    m = perf.model
    return LladaConfig(d_model=m.hidden, n_heads=m.heads, n_kv_heads=m.kv_heads, n_layers=m.layers,
                       mlp_hidden_size=m.intermediate, vocab_size=m.vocab, embedding_size=m.vocab,
                       rope_theta=LLADA_ROPE_THETA, rms_norm_eps=LLADA_RMS_NORM_EPS,
                       max_sequence_length=m.context_len, mask_token_id=LLADA_MASK_TOKEN_ID,
                       weight_tying=m.tied_embeddings)


def build_emulated_diffusion_engine(config: EngineConfig, emulation: DiffusionEmulation = DiffusionEmulation(),
                                    clock: VirtualClock | None = None) -> DiffusionEngine:
    """The real `DiffusionEngine` over an `EmulatedDiffusionRunner` on `clock` (a new one when
    None; the engine's `clock` is it). The KV pool is `config.kv_cache_memory_bytes`, or the
    emulation's memory plan when unset."""
    clock = clock if clock is not None else VirtualClock()
    perf = emulation.perf_model()
    if config.kv_cache_memory_bytes is None:
        config = dataclasses.replace(config, kv_cache_memory_bytes=emulation.memory_plan(config).kv_pool_bytes)
    runner = EmulatedDiffusionRunner(
        perf, clock=clock, cache=config.dllm_cache, full_sequence_logits=not emulation.logit_decomposition,
        pad_to_longest=emulation.pad_to_longest,
        max_num_logits=config.max_num_logits if emulation.logit_decomposition else None,
        method=emulation.method, dllm_cache=emulation.dllm_cache)
    return DiffusionEngine(config, clock, model_config=emulated_llada_config(perf), runner=runner,
                           eos_token_ids=LLADA_EOS_TOKEN_IDS, kv_bytes_per_token=perf.kv_bytes_per_token,
                           tokenizer=None)


def _engine_config(emulation: DiffusionEmulation, **options) -> EngineConfig:
    return EngineConfig(model=f"emulated:{emulation.gpu}/{emulation.model}", detokenize=False, **options)


def dllm_serve_config(emulation: DiffusionEmulation, *, max_num_batched_tokens: int, max_num_logits: int = 2048,
                      max_num_seqs: int = 1024) -> tuple[EngineConfig, MemoryPlan]:
    """dLLM-Serve: phase-multiplexed scheduling (§4.4) within max_num_batched_tokens query tokens
    per step, logits decomposed (§4.3), the KV pool of the logit-aware profile (§4.2).
    `max_num_seqs` is high: the KV pool and the token budget are the limits."""
    config = _engine_config(emulation, diffusion_policy="phase_multiplexed",
                            max_num_batched_tokens=max_num_batched_tokens, max_num_logits=max_num_logits,
                            max_num_seqs=max_num_seqs)
    plan = emulation.memory_plan(config)
    return dataclasses.replace(config, kv_cache_memory_bytes=plan.kv_pool_bytes), plan


def static_baseline_config(emulation: DiffusionEmulation, max_seq_len: int, *, block_length: int = 32,
                           max_num_logits: int = 2048, retention_ratio: float = 1.0,
                           batch_size: int | None = None) -> tuple[EngineConfig, MemoryPlan]:
    """A static request-level batch (the baselines, §6.1's "maximum static batch size that fits"):
    the largest batch of `max_seq_len`-token requests whose Refresh step fits — with the
    emulation's logits (every position's, monolithic, without decomposition; the blocks', at
    most max_num_logits at once, with it) and its cache (the KV, or dLLM-Cache's features, of
    the whole sequence; of `retention_ratio` of its context with a sparse cache: Sparse-dLLM).
    Its token budget is the whole batch's Refresh (one forward pass) and its KV pool exactly the
    batch's cache. `batch_size` fixes the batch instead (ValueError if it does not fit)."""
    perf = emulation.perf_model()
    logit_options = {} if not emulation.logit_decomposition else dict(logit_rows_per_request=block_length,
                                                                       max_num_logits=max_num_logits)
    if retention_ratio < 1:
        logit_options["kv_tokens_per_request"] = retained_tokens(max_seq_len - block_length, retention_ratio)
    plan = perf.largest_static_batch(max_seq_len, memory_utilization=emulation.memory_utilization, **logit_options)
    if batch_size is not None:
        if batch_size > plan.static_batch_size:
            raise ValueError(f"a static batch of {batch_size} does not fit ({plan.static_batch_size} does)")
        fixed = perf.static_plan(batch_size, max_seq_len, memory_utilization=emulation.memory_utilization,
                                 **logit_options)
        per_request = logit_options.get("kv_tokens_per_request", max_seq_len)
        plan = dataclasses.replace(fixed, kv_pool_bytes=batch_size * per_request * perf.kv_bytes_per_token)
    batch = plan.static_batch_size
    assert batch is not None
    config = _engine_config(emulation, diffusion_policy="static", static_batch_size=batch, max_num_seqs=batch,
                            max_num_batched_tokens=batch * max_seq_len, max_num_logits=max_num_logits,
                            kv_cache_memory_bytes=plan.kv_pool_bytes)
    return config, plan
