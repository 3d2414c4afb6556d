"""Owns the model and the paged KV cache; turns a scheduled step into one forward pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from workers.engine import sampler, structured
from workers.engine.attention import (
    FLASH_ATTN_BLOCK_MULTIPLE,
    HAVE_FLASH_ATTN,
    AttentionMetadata,
    PrefillChunk,
)
from splitserve.core.shapes import ShapeGrid
from workers.engine.captured_shapes import BucketRunner, build_bucket_step
from workers.engine.config import EngineConfig, ModelSpec, parse_dtype
from workers.engine.cpu_linear import onednn_available, pack_linears
from workers.engine.host_memory import zeros_on_huge_pages
from workers.engine.loader import load_model
from splitserve.core import ScheduledEntry, SchedulerOutput, Sequence, StageKey
from splitserve.core.sampling import TokenLogprobs

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES_CAP = 2 << 30


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_entries: list[ScheduledEntry]  # in the order of logits rows
    # Logits rows after the sampling ones: per entry asking for prompt logprobs, (entry, the
    # first prompt position scored, how many), the rows in that order.
    prompt_rows: list[tuple[ScheduledEntry, int, int]]


class ModelRunner:
    """Device-side half of the engine: weights, KV cache, forward and sampling."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, max_model_len: int):
        self.config = config
        self.spec = spec
        self.eos_token_ids = frozenset(spec.eos_token_ids)  # masked under min_tokens with stop_token_ids
        self.device = _resolve_device(config.device)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.dtype == "auto":
            self.dtype = spec.checkpoint_dtype if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = parse_dtype(config.dtype)
        self.block_size = config.block_size
        decode_graphs = config.decode_graphs == "on" or (config.decode_graphs == "auto" and self.device.type == "cuda")
        # Decode steps as buckets (1, B): see EngineConfig.decode_graphs. None keeps them unpadded.
        self.decode_grid = ShapeGrid((1,), config.decode_graph_batches) if decode_graphs else None
        self.use_flash = self._choose_flash()
        self.decode_kernel = self._choose_decode_kernel()
        self.model = load_model(spec, self.dtype, self.device, max_model_len, self.use_flash)
        self.onednn_linears = self._pack_linears()
        self.fused_ops = self.set_fused_ops(True)
        self.num_blocks = self._kv_capacity_blocks(max_model_len)
        # LAPS captured shapes: padded steps write their pad tokens' KV to one scratch block
        # past the ones the block manager owns (`num_blocks`).
        self.shapes = ShapeGrid(config.shape_tokens, config.shape_batches) if config.captured_shapes else None
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_padded_steps = 0
        # The latest step's sampled-token logprobs, of the stages whose requests asked for them
        # (SamplingParams.logprobs); the engine hands them to the scheduler with the tokens.
        self.step_logprobs: dict[StageKey, TokenLogprobs] = {}
        # ... and the prompt logprobs it scored (SamplingParams.prompt_logprobs): (first position, logprobs).
        self.step_prompt_logprobs: dict[StageKey, tuple[int, list[TokenLogprobs]]] = {}
        self.buckets: BucketRunner | None = None
        if self.shapes is not None or self.decode_grid is not None:
            executor = config.captured_shapes_executor
            if executor == "auto":
                executor = "cuda_graph" if self.device.type == "cuda" else "eager"
            self.buckets = BucketRunner(self._bucket_forward, self.block_size, self.device, executor,
                                        config.max_captured_buckets, self.decode_kernel)
        scratch = 1 if self.buckets is not None else 0
        # Block-major layout [blocks, layers, k/v, block_size, kv_heads, head_dim]: one
        # block's KV for every layer is contiguous, so moving a block list between
        # workers is one region per block.
        shape = (self.num_blocks + scratch, spec.num_layers, 2, self.block_size, spec.num_kv_heads, spec.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = zeros_on_huge_pages(shape, self.dtype)  # faster KV transfers between processes
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.layer_caches = [self.kv_cache[:, layer].unbind(1) for layer in range(spec.num_layers)]

    # ---- capacity ----------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        s = self.spec
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def _kv_capacity_blocks(self, max_model_len: int) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            budget = self.config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_cuda_memory()
        else:
            full = self.config.max_num_seqs * max_model_len * self.bytes_per_block // self.block_size
            budget = min(full, _CPU_DEFAULT_KV_BYTES_CAP)
        blocks = budget // self.bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no KV block (one block is {self.bytes_per_block} bytes)"
            )
        return int(blocks)

    def _profile_free_cuda_memory(self) -> int:
        # A dummy forward at the full token budget measures activation peak memory.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.max_num_batched_tokens
        self.kv_cache = torch.zeros(1, self.spec.num_layers, 2, self.block_size, self.spec.num_kv_heads,
                                    self.spec.head_dim, dtype=self.dtype, device=self.device)
        self.layer_caches = [self.kv_cache[:, layer].unbind(1) for layer in range(self.spec.num_layers)]
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            pos = torch.arange(n, device=self.device) % self.block_size
            meta = self._metadata_for_profile(n)
            self.model(ids, pos, self.layer_caches, meta, torch.tensor([n - 1], device=self.device))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        del self.kv_cache, self.layer_caches
        return int(total * self.config.gpu_memory_utilization - used_by_others - peak)

    def _metadata_for_profile(self, n: int) -> AttentionMetadata:
        zeros = torch.zeros(n, dtype=torch.long, device=self.device)
        offsets = torch.arange(n, device=self.device) % self.block_size
        return AttentionMetadata(
            slot_mapping=offsets, slot_blocks=zeros, slot_offsets=offsets, num_decode_tokens=n,
            decode_block_tables=torch.zeros(n, 1, dtype=torch.long, device=self.device),
            decode_context_lens=torch.ones(n, dtype=torch.long, device=self.device),
            prefills=[], block_size=self.block_size,
        )

    def _choose_flash(self) -> bool:
        backend = self.config.attention_backend
        ok = HAVE_FLASH_ATTN and self.device.type == "cuda" and self.block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
        if backend == "flash" and not ok:
            raise ValueError(
                "attention_backend=flash needs flash-attn installed, a CUDA device and "
                f"block_size a multiple of {FLASH_ATTN_BLOCK_MULTIPLE}"
            )
        return ok and backend != "sdpa"

    @property
    def decode_batches(self) -> tuple[int, ...]:
        """The decode batch sizes run as buckets; () when decode graphs are off."""
        return self.decode_grid.batches if self.decode_grid is not None else ()

    @property
    def decode_kernel_name(self) -> str:
        """Which paged decode kernel runs ("" when none: SDPA over gathered KV)."""
        if self.decode_kernel is None:
            return ""
        return "triton" if self.device.type == "cuda" else "cpu_kernel"

    def _buckets_compiled(self) -> bool:
        """Whether buckets (captured shapes, decode graphs) run torch.compile'd."""
        config = self.config
        return (config.captured_shapes or self.decode_grid is not None) and config.captured_shapes_executor == "compile"

    def _pack_linears(self) -> int:
        """oneDNN linears on the CPU (cpu_linear auto/onednn); how many layers were packed."""
        choice = self.config.cpu_linear
        if choice == "torch":
            return 0
        available = onednn_available(self.device, self.dtype)
        # A torch.compile'd bucket (captured shapes, executor compile) traces the model: keep
        # plain weights there rather than opaque oneDNN tensors.
        compiled = self._buckets_compiled()
        if choice == "onednn" and (not available or compiled):
            raise ValueError("cpu_linear=onednn needs a CPU device, float32 or bfloat16, torch with oneDNN, "
                             "and no compiled captured shapes")
        return pack_linears(self.model) if available and not compiled else 0

    def set_fused_ops(self, enabled: bool) -> bool:
        """Switch the fused elementwise ops (RMSNorm with its residual add, rotary) on or off;
        whether they now run. On the CPU the compiled kernels, when they built (they come with
        the decode kernel; SPLITSERVE_CPU_KERNELS=0 turns both off); on CUDA the Triton ones
        (`triton_elementwise.py`), where triton imports; never inside torch.compile'd captured
        shapes, which trace torch ops. The one place that sets both the model's modules and
        `fused_ops`."""
        compiled = self._buckets_compiled()
        use = getattr(self.model, "use_fused_ops", None)
        module = None
        if enabled and not compiled and use is not None:
            if self.device.type == "cpu":
                from workers.engine import kernels

                module = kernels.load()
            elif self.device.type == "cuda":
                try:
                    from workers.engine import triton_elementwise as module
                except ImportError:
                    module = None
        self.fused_ops = use is not None and use(module) > 0 and module is not None
        return self.fused_ops

    def _choose_decode_kernel(self):
        """The paged decode-attention kernel: on the CPU the compiled one (auto, cpu_kernel); on
        CUDA without flash-attn the Triton one (auto where triton imports, triton); else None."""
        backend = self.config.attention_backend
        if self.device.type == "cuda" and backend in ("auto", "triton") and not self.use_flash:
            try:
                from workers.engine import triton_attention

                why = triton_attention.unsupported(self.spec.head_dim)
            except ImportError as err:
                why = f"triton installed ({err})"
            if why is None:
                return triton_attention.paged_decode_attention
            if backend == "triton":
                raise ValueError(f"attention_backend=triton needs {why}")
            return None
        if backend == "triton":
            raise ValueError("attention_backend=triton runs on CUDA only (and not beside flash-attn)")
        if self.device.type != "cpu" or backend not in ("auto", "cpu_kernel"):
            if backend == "cpu_kernel":
                raise ValueError("attention_backend=cpu_kernel runs on the CPU only")
            return None
        from workers.engine import kernels

        module = kernels.load()
        if module is None and backend == "cpu_kernel":
            raise ValueError("attention_backend=cpu_kernel: the CPU kernel could not be built (see the log)")
        return None if module is None else module.paged_decode_attention

    # ---- one step ----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, on_layer_kv: Callable[[int], None] | None = None) -> dict[StageKey, int]:
        """Run the step the scheduler chose: one forward pass; its sampled tokens by stage.

        `on_layer_kv(layer)` is called on this thread as each decoder layer has written its
        KV of the step (the per-layer push of a stage's last step)."""
        self.step_prompt_logprobs = {}
        scoring_prompt = any(e.seq.params.prompt_logprobs is not None for e in out.entries)
        if self.buckets is not None and not scoring_prompt:  # a captured shape yields the sampled rows only
            sampled = self._execute_bucket(out)
            if sampled is not None:
                if on_layer_kv is not None:
                    # A graph cannot call back between layers: a bucket's KV is pushed once the
                    # whole (short) step has run, every layer in order.
                    for layer in range(self.spec.num_layers):
                        on_layer_kv(layer)
                return sampled
        batch = self.prepare(out.entries)
        if on_layer_kv is None:
            logits = self.model(batch.input_ids, batch.positions, self.layer_caches, batch.meta, batch.logits_indices)
        else:
            logits = self.model(batch.input_ids, batch.positions, self.layer_caches, batch.meta, batch.logits_indices,
                                on_layer_kv=on_layer_kv)
        sampling = len(batch.sampling_entries)
        if batch.prompt_rows:
            self._score_prompt(logits[sampling:], batch.prompt_rows)
        return self._sample(logits[:sampling], [e.seq for e in batch.sampling_entries])

    def _score_prompt(self, logits: torch.Tensor, prompt_rows: list[tuple[ScheduledEntry, int, int]]) -> None:
        """The prompt logprobs of this step's rows after the sampling ones: the logits at
        position p score the prompt token at p + 1."""
        row = 0
        for entry, first, count in prompt_rows:
            seq = entry.seq
            targets = seq.token_ids[first:first + count]
            self.step_prompt_logprobs[seq.key] = (first, sampler.prompt_token_logprobs(
                logits[row:row + count], targets, seq.params.prompt_logprobs))
            row += count

    def _execute_bucket(self, out: SchedulerOutput) -> dict[StageKey, int] | None:
        """The step run as its captured shape (LAPS §3.1; decode steps: `decode_grid`), or
        None when it has none."""
        step = build_bucket_step(out.entries, self.shapes, self.block_size, self.num_blocks, self.max_blocks_per_seq,
                                 self.decode_grid)
        if step is None:
            return None
        logits = self.buckets.run(step)
        if logits is None:
            return None
        self.num_padded_steps += 1
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=logits.device)
        logits = logits[rows]  # a copy: a graph's output buffer is rewritten by its next replay
        return self._sample(logits, [e.seq for e in out.entries if e.samples])

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[StageKey, int]:
        """One token per sequence; penalties read each one's whole history (a later stage's
        sequence holds the earlier stages' output too, so it samples what one worker would).
        A structured-output sequence samples among the tokens its grammar allows next."""
        constrained = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if constrained:  # before everything else, logprobs included (vLLM's order)
            allowed = structured.allowed_tokens([seqs[i].constraint for i in constrained], logits.shape[-1],
                                                logits.device)
            logits = sampler.mask_disallowed(logits, constrained, allowed)
        tokens = sampler.sample(
            logits, [s.params for s in seqs], [s.seed for s in seqs], [s.num_output_tokens for s in seqs],
            token_ids=[s.token_ids for s in seqs], prompt_lens=[s.prompt_len for s in seqs],
            eos_token_ids=self.eos_token_ids, grammar_rows=constrained,
        )
        # Of the raw logits (vLLM's raw_logprobs), for the rows that asked only.
        found = sampler.token_logprobs(logits, [s.params for s in seqs], tokens)
        self.step_logprobs = {seqs[i].key: lp for i, lp in found.items()}
        return {s.key: t for s, t in zip(seqs, tokens)}

    def _bucket_forward(self, input_ids, positions, meta, logits_indices) -> torch.Tensor:
        return self.model(input_ids, positions, self.layer_caches, meta, logits_indices)

    def prepare(self, entries: list[ScheduledEntry]) -> PreparedBatch:
        """Flatten the step: single-token entries first (batched decode path), then chunks."""
        ordered = sorted(entries, key=lambda e: e.num_new_tokens != 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logits_indices: list[int] = []
        sampling: list[ScheduledEntry] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        prompt_rows: list[tuple[ScheduledEntry, int, int]] = []
        starts: dict[StageKey, int] = {}  # each entry's first row in the flattened step
        offset = 0
        decode_positions: list[int] = []
        decode_slots: list[int] = []
        for e in ordered:
            seq, n = e.seq, e.num_new_tokens
            ctx = e.start + n
            starts[seq.key] = offset
            input_ids.extend(seq.token_ids[e.start : ctx])
            if n == 1:  # plain ints: per-decode tensor ops cost milliseconds of host time at batch 64
                decode_positions.append(e.start)
                decode_slots.append(seq.block_table[e.start // bs] * bs + e.start % bs)
                decode_tables.append(seq.block_table[: -(-ctx // bs)])
                decode_lens.append(ctx)
            else:
                pos = torch.arange(e.start, ctx)
                table = torch.tensor(seq.block_table[: -(-ctx // bs)], dtype=torch.long)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                prefills.append(PrefillChunk(offset, n, ctx, table.to(self.device)))
            offset += n
            if e.samples:
                logits_indices.append(offset - 1)
                sampling.append(e)
            if seq.params.prompt_logprobs is not None:
                # Positions p of this chunk followed by a prompt token score that token (p + 1).
                first, last = e.start + 1, min(ctx, seq.prompt_len - 1)
                if first <= last:
                    prompt_rows.append((e, first, last - first + 1))
        for e, first, count in prompt_rows:  # after the sampling rows: position p is row starts + p - e.start
            row = starts[e.seq.key] + first - 1 - e.start
            logits_indices.extend(range(row, row + count))
        dev = self.device
        if decode_positions:  # decodes come first in the flattened step
            positions.insert(0, torch.tensor(decode_positions, dtype=torch.long))
            slots.insert(0, torch.tensor(decode_slots, dtype=torch.long))
        slot_mapping = torch.cat(slots).to(dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            slot_blocks=slot_mapping // bs,
            slot_offsets=slot_mapping % bs,
            num_decode_tokens=len(decode_lens),
            decode_block_tables=_pad_tables(decode_tables, dev) if decode_tables else None,
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev) if decode_lens else None,
            prefills=prefills,
            block_size=bs,
            decode_kernel=self.decode_kernel,
        )
        if self.use_flash:
            _add_flash_fields(meta, ordered, dev, bs)
        return PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.cat(positions).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampling_entries=sampling,
            prompt_rows=prompt_rows,
        )

    # ---- KV export / import (the hook KV transfer builds on) ----------------------
    def token_slots(self, block_table: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size].to(self.device), (pos % self.block_size).to(self.device)

    def export_kv(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """KV of positions [start, end) held in these blocks, as [layers, 2, end - start, kv_heads, head_dim]."""
        blocks, offsets = self.token_slots(block_table, start, end)
        return self.kv_cache[blocks, :, :, offsets].permute(1, 2, 0, 3, 4).contiguous()

    def import_kv(self, block_table: list[int], start: int, kv: torch.Tensor) -> None:
        """Write KV for positions [start, start + n) into these blocks, given as [layers, 2, n, kv_heads, head_dim]."""
        blocks, offsets = self.token_slots(block_table, start, start + kv.shape[2])
        self.kv_cache[blocks, :, :, offsets] = kv.permute(2, 0, 1, 3, 4).to(self.kv_cache)


def _pad_tables(tables: list[list[int]], device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)


def _add_flash_fields(meta: AttentionMetadata, ordered: list[ScheduledEntry], device, bs: int) -> None:
    q_lens = [e.num_new_tokens for e in ordered]
    k_lens = [e.start + e.num_new_tokens for e in ordered]
    cu_q = torch.zeros(len(ordered) + 1, dtype=torch.int32)
    cu_k = torch.zeros(len(ordered) + 1, dtype=torch.int32)
    cu_q[1:] = torch.tensor(q_lens).cumsum(0)
    cu_k[1:] = torch.tensor(k_lens).cumsum(0)
    meta.cu_seqlens_q, meta.cu_seqlens_k = cu_q.to(device), cu_k.to(device)
    meta.max_query_len, meta.max_context_len = max(q_lens), max(k_lens)
    tables = [e.seq.block_table[: -(-k // bs)] for e, k in zip(ordered, k_lens)]
    meta.block_tables = _pad_tables(tables, device).to(torch.int32)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} requested but CUDA is not available")
    return device
