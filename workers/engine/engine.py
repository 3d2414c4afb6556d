"""The real engine: a driver of the serving core over a model runner.

`Scheduler` (splitserve.core) decides every step; this class only turns stage specs into
the core's terms (tokenizer text, KV carried as a tensor), runs the forward pass of what
the core scheduled and hands the sampled tokens back:

    out = scheduler.schedule()
    sampled = runner.execute(out)
    events = scheduler.update_from_output(out, sampled, latency)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

from splitserve.core.session_pins import SessionPinStats
from splitserve.core import (BlockManager, InvalidInput, KvCapacityError, KvInBlocks, KvPayload, Scheduler,
                             SchedulerConfig, SchedulerOutput, StageKey, StageSpec, TokenEvent, build_batch_policy)
from splitserve.detokenizer import IncrementalDetokenizer
from splitserve.core.records import PrefillTask, WorkerLoad
from workers.engine.config import EngineConfig, load_model_spec

log = logging.getLogger(__name__)

__all__ = ["Engine", "KvCapacityError", "TokenEvent"]


class Engine:
    """Continuous-batching inference engine over one model.

    `spec` and `runner` may be injected (the emulated backend, workers/engine/emulated.py):
    then no model directory is read and no tokenizer is loaded unless one is passed.
    """

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic, tokenizer=None, *,
                 spec=None, runner=None):
        config.validate()
        self.config = config
        self.clock = clock
        self.spec = spec if spec is not None else load_model_spec(config.model)
        limit = self.spec.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        if tokenizer is None and spec is None:
            tokenizer = _load_tokenizer(Path(self.spec.model_dir))  # for a .gguf model, its dequantized directory
        self.tokenizer = tokenizer
        if runner is None:
            from workers.engine.model_runner import ModelRunner

            runner = ModelRunner(config, self.spec, self.max_model_len)
        self.runner = runner
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,
                            self.spec.vocab_size, frozenset(self.spec.eos_token_ids), config.seed),
            BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching),
            build_batch_policy(config.batch_policy, config.batch_policy_options, perf_model=self.policy_perf_model()),
            clock)
        self.last_output = SchedulerOutput()  # the latest step's (empty after a step that found nothing to run)
        self._grammar = None  # structured output's compiler (xgrammar), made for the first request asking for it
        # Stages whose last step pushes its KV layer by layer: key -> (stop_at, callback(layer, block_table)).
        # Set and cleared from another thread (the worker's event loop); read once per step.
        self.layer_watchers: dict[StageKey, tuple[int, Callable[[int, list[int]], None]]] = {}
        log.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens (%.1f MiB), attention=%s, linears=%s, "
            "elementwise=%s",
            self.spec.architecture, runner.device, runner.dtype, runner.num_blocks, config.block_size,
            runner.num_blocks * runner.bytes_per_block / 2**20,
            "flash" if runner.use_flash else ("sdpa, decode: " + runner.decode_kernel_name)
            if getattr(runner, "decode_kernel", None) else "sdpa",
            "onednn" if getattr(runner, "onednn_linears", 0) else "torch",
            "fused" if getattr(runner, "fused_ops", False) else "torch",
        )

    def policy_perf_model(self):
        """The performance model a latency-predicting batch policy (slo_aware) starts from: the
        fitted one of `config.perf_model`, else none (the policy learns from scratch)."""
        if not self.config.perf_model:
            return None
        from splitserve.perf.store import load_perf_model

        return load_perf_model(self.config.perf_model)

    # ---- what the worker around it needs to know ------------------------------------------
    @property
    def engine_kind(self) -> str:
        """What the worker registers as (the model's architecture; "emulated" for the emulated backend)."""
        return self.spec.architecture

    @property
    def kv_capacity_tokens(self) -> int:
        return self.scheduler.kv_capacity_tokens

    @property
    def kv_short(self) -> bool:
        """The last step had too few free KV blocks for a stage already here (`Scheduler.kv_short`)."""
        return self.scheduler.kv_short

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.block_manager.num_blocks

    @property
    def kv_cache(self):
        """The KV cache tensor KV transfers read and write (None where no values are held)."""
        return self.runner.kv_cache

    @property
    def device(self):
        return self.runner.device

    # ---- stages --------------------------------------------------------------------------
    def add_stage(self, spec: StageSpec) -> None:
        """Queue a stage; ValueError naming the field for bad input, KvCapacityError when KV
        carried in memory (`KvPayload`) finds no free blocks now."""
        text = None
        params = spec.sampling
        if params.logprobs is not None and not hasattr(self.runner, "step_logprobs"):
            raise InvalidInput("logprobs: this engine computes no logits to take them from (the emulated backend)",
                               param="logprobs")
        if params.prompt_logprobs is not None and not hasattr(self.runner, "step_prompt_logprobs"):
            raise InvalidInput("prompt_logprobs: this engine computes no logits to take them from (the emulated "
                               "backend)", param="prompt_logprobs")
        if self.tokenizer is not None and (self.config.detokenize or params.stop):
            text = IncrementalDetokenizer(self.tokenizer, list(spec.prompt_ids), params.stop, params.min_tokens)
            if spec.output_ids:
                text.push(list(spec.output_ids))  # text of earlier stages is not re-emitted
        if isinstance(spec.kv, KvPayload):
            constraint = self._output_constraint(spec)
            spec = dataclasses.replace(spec, kv=self._write_payload(spec))
            try:
                self.scheduler.add_stage(spec, text, constraint)
            except ValueError:
                self.scheduler.release_reserved(list(spec.kv.block_ids))
                raise
            return
        self.scheduler.add_stage(spec, text, self._output_constraint(spec))

    def _output_constraint(self, spec: StageSpec):
        """The stage's grammar matcher (structured output), at the state after the earlier
        stages' output; None for free output. InvalidInput naming the request's field when it
        cannot be had (no logits here, no tokenizer, no xgrammar, a constraint that does not compile)."""
        structured = spec.sampling.structured_output
        if structured is None:
            return None
        if not hasattr(self.runner, "step_logprobs"):
            raise InvalidInput(f"{structured.param}: structured output needs logits to mask; this engine computes "
                               "none (the emulated backend)", param=structured.param)
        if self._grammar is None:
            from workers.engine.structured import load_backend

            self._grammar = load_backend(self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids,
                                         self.config.structured_output_cache_size, structured.param)
        return self._grammar.constraint(structured, spec.output_ids)

    def abort(self, key: StageKey) -> bool:
        """Drop a stage and free its KV at once; False if it is unknown."""
        return self.scheduler.abort(key)

    def abort_all(self) -> list[TokenEvent]:
        """Abort every queued and running stage (after a failed step); their final events."""
        events = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(seq.key)
            events.append(TokenEvent(seq.key, [], "", "abort", seq.prompt_len, seq.num_output_tokens))
        return events

    def release_session(self, session_id: str) -> bool:
        """A session closed or moved away: unpin its history here; whether it was pinned."""
        return self.scheduler.release_session(session_id)

    def session_stats(self) -> SessionPinStats:
        return self.scheduler.session_pins.stats()

    def release(self, key: StageKey) -> None:
        """Free the KV a finished stage still holds (a push or lazy pull is done reading it)."""
        self.scheduler.release(key)

    def stage_keys(self, request_id: str) -> list[StageKey]:
        """Every stage of a request held here, in flight or finished with kept KV."""
        return self.scheduler.keys_of(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- KV held for transfers ----------------------------------------------------------------
    def reserve_kv(self, num_tokens: int) -> list[int]:
        """Reserve blocks for `num_tokens` tokens of KV that another worker will write."""
        return self.scheduler.reserve_kv(num_tokens)

    def release_reserved(self, block_ids: list[int]) -> None:
        self.scheduler.release_reserved(block_ids)

    def lease_session_kv(self, session_id: str, max_tokens: int) -> list[int]:
        """Hold a pinned session history's blocks for another worker's lazy pull."""
        return self.scheduler.lease_session_kv(session_id, max_tokens)

    def release_lease(self, block_ids: list[int]) -> None:
        self.scheduler.release_lease(block_ids)

    def hold_cached_prefix(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Hold this worker's cached blocks of the longest cached prefix of `token_ids`."""
        return self.scheduler.hold_cached_prefix(token_ids, max_tokens)

    def kv_blocks(self, key: StageKey) -> tuple[list[int], int]:
        """The stage's block table and how many tokens of it hold computed KV."""
        return self.scheduler.kv_blocks(key)

    def export_kv(self, key: StageKey, start: int, end: int):
        """KV of positions [start, end) of a live or kept stage: [layers, 2, n, kv_heads, head_dim]."""
        table, computed = self.scheduler.kv_blocks(key)
        if not 0 <= start <= end <= computed:
            raise ValueError(f"KV range [{start}, {end}) is outside the computed tokens [0, {computed})")
        return self.runner.export_kv(table, start, end)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Schedule, run one forward pass, sample, and report what each stage produced."""
        out = self.scheduler.schedule()
        self.last_output = out
        if not out.entries:
            return []
        started = self.clock()  # the injected clock: an emulated pass on virtual time measures its model time
        on_layer_kv = self._layer_hook(out) if self.layer_watchers else None
        sampled = self.runner.execute(out) if on_layer_kv is None else self.runner.execute(out, on_layer_kv)
        return self.scheduler.update_from_output(out, sampled, self.clock() - started,
                                                 getattr(self.runner, "step_logprobs", None),
                                                 getattr(self.runner, "step_prompt_logprobs", None))

    @property
    def last_step_tokens(self) -> int:
        """Tokens the latest step computed (0: it found nothing it could run)."""
        return self.last_output.num_tokens

    def load(self) -> WorkerLoad:
        """Load figures for the worker to publish (it adds its identity)."""
        return dataclasses.replace(self.scheduler.load(), engine_kind=self.spec.architecture)

    def prefill_queue(self) -> list[PrefillTask]:
        return self.scheduler.prefill_queue()

    def progress(self, key: StageKey) -> tuple[int, list[int]] | None:
        """(computed tokens, block table) of a live stage, or None when it is gone."""
        seq = self.scheduler.sequences.get(key)
        return None if seq is None else (seq.num_computed_tokens, seq.block_table)

    # ---- internals -------------------------------------------------------------------------------
    def _layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        """The per-layer callback of this step: for each watched stage whose KV this step completes."""
        calls = []
        for entry in out.entries:
            watch = self.layer_watchers.get(entry.seq.key)
            if watch is not None and entry.start < watch[0] <= entry.start + entry.num_new_tokens:
                calls.append((watch[1], list(entry.seq.block_table)))
        if not calls:
            return None

        def on_layer_kv(layer: int) -> None:
            for callback, table in calls:
                try:
                    callback(layer, table)
                except Exception:  # never fail the step over it; the receiver times out and recomputes
                    log.exception("per-layer KV callback failed")
        return on_layer_kv

    def _write_payload(self, spec: StageSpec) -> KvInBlocks:
        kv = spec.kv.data
        n = kv.shape[2]
        expected = (self.spec.num_layers, 2, n, self.spec.num_kv_heads, self.spec.head_dim)
        if tuple(kv.shape) != expected:
            raise InvalidInput(f"kv has shape {tuple(kv.shape)}, expected {expected}", param="kv")
        known = len(spec.prompt_ids) + len(spec.output_ids)
        if not 0 < n < known or n != spec.kv.num_tokens:
            raise InvalidInput(f"kv covers {n} tokens; it must cover 1..{known - 1} of the {known} known tokens",
                               param="kv")
        blocks = self.scheduler.reserve_kv(n)
        self.runner.import_kv(blocks, 0, kv)
        return KvInBlocks(tuple(blocks), n)


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
