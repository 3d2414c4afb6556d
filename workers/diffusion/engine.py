"""The diffusion engine: the core's `DiffusionScheduler` driving a `DiffusionRunner` (dLLM-Serve).

The second engine kind beside the autoregressive `workers.engine.Engine`, with the same
shape: `add_request`, `step() -> [TokenEvent]`, `abort`, `has_unfinished`. A request's
output is streamed a block at a time, when the block is final (its last denoising step
ran); a final block holding an end-of-sequence token ends the request there (the
reference's later blocks cannot change the tokens before it, so the output up to EOS is
the same and the rest is not computed).

The mask token is never emitted. A model may predict it; LLaDA's reference then keeps the
position masked and decides it again at later steps, later blocks' included
(`reference.py`), so a final block's output stops at its first position still masked and the
rest follows once that is filled. Positions still masked after the last step are dropped, as
LLaDA's decode (`skip_special_tokens=True`) drops them: the request then has fewer than
`max_tokens` output tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from splitserve.core import InvalidInput, SamplingParams, StageKey, StageSpec, TokenEvent
from splitserve.core.session_pins import SessionPinStats
from splitserve.core.diffusion import (DiffusionParamError, DiffusionParams, DiffusionScheduler,
                                       DiffusionSchedulerConfig, DiffusionSequence, profile_batch)
from splitserve.core.diffusion import diffusion_params as core_diffusion_params
from splitserve.model_kind import is_diffusion_model  # noqa: F401 (re-exported: LLM and the worker ask here)
from splitserve.core.records import PrefillTask, WorkerLoad
from workers.diffusion.runner import DiffusionRunner
from workers.engine.config import EngineConfig, parse_dtype
from workers.engine.model_runner import _CPU_DEFAULT_KV_BYTES_CAP, _resolve_device
from workers.engine.models.llada import LladaConfig, load_llada

__all__ = ["DiffusionEngine", "ENGINE_KIND", "StepOutput", "diffusion_params", "is_diffusion_model",
           "kv_pool_bytes"]

ENGINE_KIND = "llada"  # what a diffusion worker registers: one of state_records.DIFFUSION_ENGINE_KINDS


@dataclass(frozen=True)
class StepOutput:
    """What the worker's loop reads of the latest step (the autoregressive SchedulerOutput's shape)."""

    num_tokens: int = 0  # query tokens computed
    hold_until: float | None = None  # diffusion batching never holds work back

def diffusion_params(params: SamplingParams) -> DiffusionParams:
    """The request's denoising knobs from its sampling parameters (`core.diffusion.diffusion_params`
    fills the defaults); a ValueError names the field."""
    if params.top_k or params.top_p != 1.0:
        raise DiffusionParamError("top_k" if params.top_k else "top_p",
                                  "top_k and top_p are not supported by diffusion models (use temperature)")
    return core_diffusion_params(params.max_tokens, steps=params.steps, block_length=params.block_length,
                                 temperature=params.temperature, remasking=params.remasking,
                                 retention_ratio=params.retention_ratio, cfg_scale=params.cfg_scale)


class DiffusionEngine:
    """Continuous (phase-multiplexed) batching of diffusion requests over one LLaDA model."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic, tokenizer=None, *,
                 model_config: LladaConfig | None = None, runner=None, eos_token_ids: frozenset[int] = frozenset(),
                 kv_bytes_per_token: int | None = None):
        """`model_config` and `runner` may be injected (an emulated runner timed by a
        performance model): then no model directory is read, `eos_token_ids` and
        `kv_bytes_per_token` (the KV pool's sizing) are taken as given."""
        config.validate()
        self.config = config
        self.clock = clock
        injected = runner is not None
        if injected and model_config is None:
            raise ValueError("an injected runner needs its model_config")
        self.model_config = model_config if model_config is not None else LladaConfig.from_dir(config.model)
        dtype = torch.float32 if config.dtype == "auto" else parse_dtype(config.dtype)
        if injected:
            self.device = torch.device("cpu")
            self.tokenizer = tokenizer
            self.eos_token_ids = frozenset(eos_token_ids)
        else:
            self.device = _resolve_device(config.device)
            if self.device.type == "cpu" and config.num_threads:
                torch.set_num_threads(config.num_threads)
            self.model = load_llada(config.model, dtype, self.device)
            self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(Path(config.model))
            raw = json.loads((Path(config.model) / "config.json").read_text())
            eos = raw.get("eos_token_id")
            self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
        self.max_model_len = min(config.max_model_len or self.model_config.max_sequence_length,
                                 self.model_config.max_sequence_length)
        if kv_bytes_per_token is None:
            elem = torch.empty((), dtype=dtype).element_size()
            kv_bytes_per_token = 2 * self.model_config.n_layers * self.model_config.n_kv_heads * \
                self.model_config.head_dim * elem
        self.kv_bytes_per_token = kv_bytes_per_token
        self.runner = runner if injected else DiffusionRunner(
            self.model, cache=config.dllm_cache, max_num_logits=config.max_num_logits,
            sparse_kv=config.sparse_kv, device=self.device)
        budget = config.kv_cache_memory_bytes
        if not budget:
            budget = self._profile_kv_budget() if self.device.type == "cuda" else _CPU_DEFAULT_KV_BYTES_CAP
        if budget < self.kv_bytes_per_token:
            raise ValueError(f"the KV pool ({budget} bytes) holds no token of KV ({self.kv_bytes_per_token} bytes "
                             "each): lower max_num_batched_tokens or max_num_logits, or raise gpu_memory_utilization")
        self.scheduler = DiffusionScheduler(DiffusionSchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            kv_capacity_tokens=max(1, budget // self.kv_bytes_per_token), cache=config.dllm_cache,
            policy=config.diffusion_policy, static_batch_size=config.static_batch_size))
        self._requests: dict[str, tuple[StageKey, list[int], SamplingParams]] = {}
        self._emitted: dict[str, int] = {}  # output tokens sent
        self._decided: dict[str, int] = {}  # output positions sent or dropped (>= _emitted)
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self.last_output = StepOutput()

    # ---- memory (dLLM-Serve §4.2) ---------------------------------------------------------------
    def run_profile_step(self) -> None:
        """The profiler's dummy workload: the worst step the scheduler can build (`profile_batch`),
        run through the runner with its logits decomposed by max_num_logits, then released."""
        batch = profile_batch(self.config.max_num_batched_tokens, self.max_model_len, self.config.max_num_logits)
        for work in batch.entries:
            self.runner.start(work.seq, [0] * work.seq.prompt_len, None)
        # No cache stored: the KV a Refresh caches is the pool's (sized from what is left), not activations.
        cache, self.runner.cache = self.runner.cache, "none"
        try:
            self.runner.execute(batch)
        finally:
            self.runner.cache = cache
            for work in batch.entries:
                self.runner.release(work.seq.key)

    def _profile_kv_budget(self) -> int:
        """CUDA: the bytes left for the KV pool once the weights, other processes and the measured
        activation peak of `run_profile_step` are set aside (written to the CUDA allocator's
        statistics; not run here, where there is no GPU)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)  # the weights
        self.run_profile_step()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - resident
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        return kv_pool_bytes(total, self.config.gpu_memory_utilization, used_by_others, resident, activations)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, key: StageKey, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; a ValueError names the field and the limit it breaks."""
        params.validate(self.model_config.vocab_size)
        knobs = diffusion_params(params)
        if knobs.cfg_scale > 0 and self.config.dllm_cache != "none":
            # The dual cache would need a second cache per request for the unconditional pass,
            # which Fast-dLLM's caching does not define (nor does the reference).
            raise DiffusionParamError("cfg_scale", "cfg_scale: classifier-free guidance runs on workers with "
                                      f"dllm_cache none; this one has dllm_cache {self.config.dllm_cache}")
        if not prompt_ids:
            raise InvalidInput("prompt must hold at least one token", param="prompt")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_ids):
            raise InvalidInput(f"prompt token ids must be in [0, {self.model_config.vocab_size})", param="prompt")
        if self.model_config.mask_token_id in prompt_ids:
            raise InvalidInput(f"prompt contains the mask token (id {self.model_config.mask_token_id})", param="prompt")
        length = len(prompt_ids) + knobs.gen_length
        if length > self.max_model_len:
            raise InvalidInput(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({knobs.gen_length}) exceeds "
                               f"max_model_len ({self.max_model_len})", param="max_tokens")
        if str(key) in self._requests:
            raise ValueError(f"stage {key} is already running here")
        seq = DiffusionSequence(str(key), len(prompt_ids), knobs, self.clock())
        self.scheduler.add(seq)  # raises when it could never run (names the limit)
        if params.seed is None and knobs.uses_randomness:
            params.seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self._requests[seq.key] = (key, list(prompt_ids), params)
        self._emitted[seq.key] = 0
        self._decided[seq.key] = 0

    def abort(self, key: StageKey) -> bool:
        name = str(key)
        found = self.scheduler.abort(name)
        self.runner.release(name)
        self._forget(name)
        return found

    def _forget(self, name: str) -> None:
        self._requests.pop(name, None)
        self._emitted.pop(name, None)
        self._decided.pop(name, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- what the worker service needs (the autoregressive Engine's interface) -----------------
    engine_kind = ENGINE_KIND

    def add_stage(self, spec: StageSpec) -> None:
        """A whole request as one stage: a diffusion request is never split, disaggregated, fed
        KV from elsewhere or kept for a session (its cache lives for one block); InvalidInput
        naming the field otherwise."""
        total = len(spec.prompt_ids) + spec.sampling.max_tokens
        for field, refused in (("kv_sources", spec.kv is not None), ("kv_sink", spec.sink is not None),
                               ("generated_token_ids", bool(spec.output_ids)), ("keep_kv", spec.keep_kv),
                               ("session", spec.session is not None),
                               ("end", spec.end is not None and spec.end != total)):
            if refused:
                raise InvalidInput(f"{field}: a diffusion model runs each request whole on one worker "
                                   "(no split, KV transfer or session)", param=field)
        structured = spec.sampling.structured_output
        if structured is not None:  # the gateway refuses it first; a direct caller meets it here
            raise InvalidInput(f"{structured.param}: structured output is not supported on a diffusion model (it "
                               "unmasks every position of a block at once)", param=structured.param)
        self.add_request(spec.key, list(spec.prompt_ids), spec.sampling)

    def abort_all(self) -> list[TokenEvent]:
        """Abort every request (after a failed step); their final events."""
        events = []
        for name, (key, prompt, _) in list(self._requests.items()):
            events.append(TokenEvent(key, [], "", "abort", len(prompt), self._emitted.get(name, 0)))
            self.abort(key)
        return events

    @property
    def last_step_tokens(self) -> int:
        """Query tokens the latest step computed (0: it found nothing it could run)."""
        return self.last_output.num_tokens

    def stage_keys(self, request_id: str) -> list[StageKey]:
        return [key for key, _, _ in self._requests.values() if key.request_id == request_id]

    def progress(self, key: StageKey) -> None:
        return None  # no KV is pushed from a diffusion worker

    def kv_blocks(self, key: StageKey) -> tuple[list[int], int]:
        return [], 0

    def release_reserved(self, block_ids: list[int]) -> None:
        pass  # nothing is ever reserved for incoming KV

    def release_session(self, session_id: str) -> bool:
        return False  # no session history is pinned

    def session_stats(self) -> SessionPinStats:
        return SessionPinStats()

    def prefill_queue(self) -> list[PrefillTask]:
        return []

    def load(self) -> WorkerLoad:
        """The KV pool as blocks of one token (what a request reserves at admission)."""
        s = self.scheduler
        capacity = s.config.kv_capacity_tokens
        return WorkerLoad(engine_kind=self.engine_kind, free_blocks=capacity - s.kv_used_tokens,
                          total_blocks=capacity, block_size=1, running=len(s.running), waiting=len(s.waiting))

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One denoising step of every scheduled request; events for the blocks that became final."""
        batch = self.scheduler.schedule()
        self.last_output = StepOutput(batch.num_query_tokens)
        if not batch.entries:
            return []
        for work in batch.entries:
            if work.admitted:
                _, prompt, params = self._requests[work.seq.key]
                self.runner.start(work.seq, prompt, params.seed)
        self.runner.execute(batch)
        final_blocks, _ = self.scheduler.finish_step(batch)
        events = []
        for seq in final_blocks:
            event = self._block_event(seq)
            if event.token_ids or event.finish_reason is not None:  # nothing new: a masked position holds it back
                events.append(event)
        return events

    def _block_event(self, seq: DiffusionSequence) -> TokenEvent:
        key, prompt, params = self._requests[seq.key]
        done, decided = self._emitted[seq.key], self._decided[seq.key]
        end = seq.prompt_len + (seq.params.num_blocks if seq.finished else seq.block) * seq.params.block_length
        window = self.runner.tokens(seq.key, seq.prompt_len + decided, end)
        mask = self.model_config.mask_token_id
        if seq.finished:  # what is still masked stays so: dropped, as LLaDA's decode drops it
            tokens = [t for t in window if t != mask]
            decided += len(window)
        else:  # up to the first position still masked: a later step may fill it
            tokens = window[: window.index(mask)] if mask in window else window
            decided += len(tokens)
        reason = "length" if seq.finished else None
        if not params.ignore_eos:
            stops = self.eos_token_ids | set(params.stop_token_ids)
            cut = next((i for i, t in enumerate(tokens) if t in stops), None)
            if cut is not None:
                tokens, reason = tokens[: cut + 1], "stop"
        self._emitted[seq.key] = done + len(tokens)
        self._decided[seq.key] = decided
        if reason is not None:
            if not seq.finished:
                self.scheduler.stop_early(seq.key)
            self.runner.release(seq.key)
            self._forget(seq.key)
        text = ""
        if self.tokenizer is not None and self.config.detokenize:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return TokenEvent(key, tokens, text, reason, len(prompt), done + len(tokens))


PROFILE_GUARD_FRACTION = 0.05  # §4.2's guard band: allocator fragmentation, kernel selection


def kv_pool_bytes(total: int, utilization: float, used_by_others: int, resident: int, activation_peak: int,
                  guard_fraction: float = PROFILE_GUARD_FRACTION) -> int:
    """The KV pool of the logit-aware profiler (dLLM-Serve §4.2): the device's share
    (`utilization` of `total`) minus what other processes hold, this process's resident
    tensors (the weights) and the activation peak of the profile step (its logits bounded by
    max_num_logits rows, not vocab x every token), grown by a guard band; never negative."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return max(0, int(total * utilization - used_by_others - resident - activation_peak * (1 + guard_fraction)))


def _load_tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").is_file():
        return None
    # Not AutoTokenizer: it reads config.json for a model class, and transformers has none for llada.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
