"""The engine loop: add requests, step, stream token events, abort; KV export/import."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig, load_model_spec
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import FinishReason, Sequence
from workers.policies import make_batch_policy

if TYPE_CHECKING:  # torch and the model runner load on use: the emulated backend has neither
    import torch

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """New output of one request after a step; `finish_reason` set on its last event."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """Load figures a worker publishes."""

    total_blocks: int
    free_blocks: int
    block_size: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    num_preemptions: int
    prefix_hit_rate: float


class KvCapacityError(RuntimeError):
    """Not enough free KV blocks to import a request's prefix KV right now."""


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
            tokenizer = _load_tokenizer(self.spec.model_dir)  # for a .gguf model, its dequantized directory
        self.tokenizer = tokenizer
        if runner is None:
            from workers.engine.model_runner import ModelRunner

            runner = ModelRunner(config, self.spec, self.max_model_len)
        self.runner = runner
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            make_batch_policy(config.batch_policy),
            config.max_num_batched_tokens,
            config.max_num_seqs,
            clock,
        )
        self._seed_rng = random.Random(config.seed)
        self.last_step_tokens = 0  # 0 after a step that found nothing it could run
        log.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens (%.1f MiB), attention=%s",
            self.spec.architecture, self.runner.device, self.runner.dtype, self.runner.num_blocks,
            config.block_size, self.runner.num_blocks * self.runner.bytes_per_block / 2**20,
            "flash" if self.runner.use_flash else "sdpa",
        )

    # ---- requests ----------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        output_token_ids: list[int] | None = None,
        prefix_kv: torch.Tensor | None = None,
        prefix_blocks: list[int] | None = None,
        prefix_len: int = 0,
        stop_at: int | None = None,
        keep_kv: bool = False,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raise ValueError naming the field for bad input.

        `output_token_ids` continues a request whose first outputs were generated
        elsewhere. Its first tokens' KV may be supplied instead of computed: as a tensor
        `prefix_kv` ([layers, 2, n, kv_heads, head_dim]), or as `prefix_blocks` reserved
        with `reserve_kv` and filled by a transfer, holding tokens [0, prefix_len).
        `stop_at` makes this a non-final stage: it finishes with "stage_end" once KV
        covers [0, stop_at).
        """
        params = params or SamplingParams()
        prompt_ids = self._tokenize(prompt)
        outputs = list(output_token_ids or [])
        self._validate(prompt_ids, outputs, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(
            request_id=request_id,
            token_ids=prompt_ids + outputs,
            prompt_len=len(prompt_ids),
            params=params,
            seed=seed,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            keep_kv=keep_kv,
            stop_at=stop_at if stop_at is not None and stop_at < len(prompt_ids) + params.max_tokens else None,
        )
        if self.tokenizer is not None and (self.config.detokenize or params.stop):
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
            if outputs:
                seq.detokenizer.push(outputs)  # text of earlier stages is not re-emitted
        if request_id in self.scheduler.sequences:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        known = seq.num_tokens
        supplied = prefix_kv.shape[2] if prefix_kv is not None else prefix_len
        if seq.stop_at is not None and seq.stop_at <= supplied:
            raise ValueError(f"stop_at ({seq.stop_at}) must be beyond the supplied KV ({supplied} tokens)")
        if prefix_kv is not None:
            self._import_prefix(seq, prefix_kv)
        elif prefix_blocks is not None:
            if not 0 < prefix_len < known:
                raise ValueError(f"prefix_len ({prefix_len}) must be in [1, {known - 1}] for {known} known tokens")
            self.block_manager.adopt(seq, prefix_blocks, prefix_len)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV at once; False if it is unknown."""
        seq = self.scheduler.sequences.get(request_id)
        if seq is None:
            return False
        if not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.ABORT)
        self.scheduler.release(request_id)
        return True

    def release(self, request_id: str) -> None:
        """Free the KV a finished `keep_kv` request still holds."""
        self.scheduler.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reserve_kv(self, num_tokens: int) -> list[int]:
        """Reserve blocks for `num_tokens` tokens of KV that another worker will write."""
        n = self.block_manager.blocks_for_tokens(num_tokens)
        if n > self.block_manager.num_free_blocks:
            raise KvCapacityError(f"need {n} free KV blocks for {num_tokens} tokens, have {self.block_manager.num_free_blocks}")
        return self.block_manager.reserve(n)

    def release_reserved(self, block_ids: list[int]) -> None:
        self.block_manager.release_reserved(block_ids)

    def kv_blocks(self, request_id: str) -> tuple[list[int], int]:
        """The request's block table and how many tokens of it hold computed KV."""
        seq = self.scheduler.sequences.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not in the engine")
        return list(seq.block_table), seq.num_computed_tokens

    # ---- the loop -----------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Schedule, run one forward pass, sample, and report what each request produced."""
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_tokens
        if not out.entries:
            return []
        started = time.perf_counter()
        sampled = self.runner.execute(out.entries)
        self.scheduler.on_step_done(out, time.perf_counter() - started)
        events = []
        for entry in out.entries:
            seq = entry.seq
            token = sampled.get(seq.request_id)
            if token is not None:
                events.append(self._append_token(seq, token))
            elif seq.reached_stage_end:  # a prefill-only stage: KV done, nothing sampled
                self.scheduler.finish(seq, FinishReason.STAGE_END)
                events.append(TokenEvent(seq.request_id, [], "", FinishReason.STAGE_END.value,
                                         seq.prompt_len, seq.num_output_tokens))
        return events

    def stats(self) -> EngineStats:
        bm = self.block_manager
        queued = sum(s.num_uncomputed_tokens for s in self.scheduler.waiting)
        queued += sum(s.num_uncomputed_tokens for s in self.scheduler.running if s.in_prefill)
        return EngineStats(
            total_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            queued_prefill_tokens=queued,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_hit_rate=bm.prefix_hits_tokens / bm.prefix_queries_tokens if bm.prefix_queries_tokens else 0.0,
        )

    # ---- KV export ---------------------------------------------------------------
    def export_kv(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """KV of positions [start, end) of a live or kept request: [layers, 2, n, kv_heads, head_dim]."""
        seq = self.scheduler.sequences.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not in the engine (finished without keep_kv?)")
        if not 0 <= start <= end <= seq.num_computed_tokens:
            raise ValueError(
                f"KV range [{start}, {end}) is outside the computed tokens [0, {seq.num_computed_tokens})"
            )
        return self.runner.export_kv(seq, start, end)

    # ---- internals ----------------------------------------------------------------
    def _append_token(self, seq: Sequence, token: int) -> TokenEvent:
        seq.token_ids.append(token)
        params = seq.params
        reason = None
        if not params.ignore_eos and token in self.spec.eos_token_ids:
            reason = FinishReason.STOP
        elif token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens:
            reason = FinishReason.LENGTH
        elif seq.reached_stage_end:
            reason = FinishReason.STAGE_END
        text = ""
        if seq.detokenizer is not None:
            text = seq.detokenizer.push([token], final=reason is not None)
            if seq.detokenizer.stopped:
                reason = FinishReason.STOP
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return TokenEvent(
            request_id=seq.request_id,
            token_ids=[token],
            text=text,
            finish_reason=reason.value if reason else None,
            num_prompt_tokens=seq.prompt_len,
            num_output_tokens=seq.num_output_tokens,
        )

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model directory has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _validate(self, prompt_ids: list[int], outputs: list[int], params: SamplingParams) -> None:
        vocab = self.spec.vocab_size
        if not prompt_ids:
            raise ValueError("prompt must contain at least 1 token")
        for name, ids in (("prompt", prompt_ids), ("output_token_ids", outputs)):
            bad = next((i for i, t in enumerate(ids) if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name} token id {ids[bad]!r} at index {bad} is outside the vocabulary [0, {vocab})")
        params.validate(vocab)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the model directory has none (use stop_token_ids)")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        if len(outputs) >= params.max_tokens:
            raise ValueError(f"output_token_ids ({len(outputs)}) must be fewer than max_tokens ({params.max_tokens})")
        if total > self.kv_capacity_tokens:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens exceeds the KV cache capacity ({self.kv_capacity_tokens} tokens)"
            )

    def _import_prefix(self, seq: Sequence, kv: torch.Tensor) -> None:
        n = kv.shape[2]
        expected = (self.spec.num_layers, 2, n, self.spec.num_kv_heads, self.spec.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"prefix_kv has shape {tuple(kv.shape)}, expected {expected}")
        if not 0 < n < seq.num_tokens:
            raise ValueError(f"prefix_kv covers {n} tokens; it must cover 1..{seq.num_tokens - 1} of {seq.num_tokens}")
        bm = self.block_manager
        if bm.blocks_for_tokens(n) > bm.num_free_blocks:
            raise KvCapacityError(f"need {bm.blocks_for_tokens(n)} free KV blocks for {n} imported tokens, have {bm.num_free_blocks}")
        bm.admit(seq, [], n)
        self.runner.import_kv(seq, 0, kv)
        seq.num_computed_tokens = n
        bm.commit_computed(seq)


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
