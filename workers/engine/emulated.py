"""The emulated backend (ARCHITECTURE principle 5b, like Dynamo's mocker).

The real `Engine`, `Scheduler`, `BlockManager` and batch policy run unchanged; only the
forward pass is replaced: `EmulatedRunner.execute` sleeps the performance model's time
for that exact batch (prefill chunks with their history, decodes with their context) and
returns deterministic tokens. No weights, no KV tensor, no torch: a worker stays a light
Python process, so dozens fit on one machine with GPU-like timings.

Pacing. A step "cycle" is the wall time from one emulated forward pass ending to the next
one ending; the control-plane work in it (the previous step's post-processing, the engine
loop, scheduling) runs *while the emulated GPU computes*, so it is subtracted from the
sleep: a cycle lasts max(model time, overhead). When the engine goes straight from one
step to the next the cycle starts where the previous pass ended: at its deadline, so a
small oversleep is absorbed by the next step instead of accumulating (at most
`max_catch_up_s`: a long stall is lost time, as it would be for a real GPU); after idling
it starts at the top of `step`. Every step's control-plane time, model time and lateness
(cycle end past the model's deadline) are exported as Prometheus metrics
(`splitserve_emulated_*`), which `benchmarks/emulated_cluster.py` reads to report
control-plane overhead as a fraction of the emulated step time.

Tokens. The token at sequence position `p` is splitmix64(key, p) over the vocabulary
without the special (eos/bos/pad) ids, so outputs are reproducible, run to `max_tokens`
(or a stop token id), and are the same however a request is batched, split or migrated:
key = the request seed when sampling (position-determined, principle 3), the previous
token when greedy (context-determined, as a real model's argmax is).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from prometheus_client import Counter, Histogram

from splitserve.perf.model import PerfModel
from splitserve.perf.backends import perf_model_for
from splitserve.perf.presets import gpu_spec, max_kv_tokens, model_spec
from splitserve.core import SamplingParams, SchedulerOutput, StageKey, StageSpec, TokenEvent, step_time
from splitserve.core.sampling import mix_seed
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine

log = logging.getLogger(__name__)

_STEP_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2,
                 5e-2, 0.1, 0.5)
STEPS = Counter("splitserve_emulated_steps_total", "Emulated forward passes")
MODEL_SECONDS = Counter("splitserve_emulated_model_seconds_total", "Sum of the performance model's step times")
OVERHEAD_SECONDS = Counter("splitserve_emulated_overhead_seconds_total",
                           "Sum of control-plane wall time per step cycle (subtracted from the sleep)")
OVERHEAD_CPU_SECONDS = Counter("splitserve_emulated_overhead_cpu_seconds_total",
                               "Engine-thread CPU time of the same (wall minus this: GIL and CPU contention)")
LATE_SECONDS = Counter("splitserve_emulated_late_seconds_total",
                       "Sum of how late the engine thread woke past the model's deadline (or overran it)")
LOST_SECONDS = Counter("splitserve_emulated_lost_seconds_total",
                       "Time steps ran past the model's timeline and did not make up: the emulated slowdown")
OVERRUN_STEPS = Counter("splitserve_emulated_overrun_steps_total", "Steps whose overhead exceeded the model time")
DECODE_TOKENS = Counter("splitserve_emulated_decode_tokens_total", "Decode tokens of emulated steps")
DECODE_MODEL_SECONDS = Counter("splitserve_emulated_decode_model_seconds_total",
                               "Sum over decode tokens of their step's model time (/ decode tokens = the model's ITL)")
OVERHEAD = Histogram("splitserve_emulated_step_overhead_seconds", "Control-plane wall time of one step cycle",
                     buckets=_STEP_BUCKETS)
LATE = Histogram("splitserve_emulated_step_late_seconds", "Engine-thread wake-up past the model's deadline",
                 buckets=_STEP_BUCKETS)



@dataclass(frozen=True)
class Emulation:
    """Which hardware and model the emulated worker pretends to be."""

    gpu: str = "H100"
    model_preset: str = "llama-3-8b"
    tp: int = 1
    link: str = "rdma-400g"  # KV-transfer link of the preset (splitserve.perf.presets.LINK_SPECS)
    # A fitted model's JSON (`splitserve profile --out`) for the step and transfer times
    # instead of the preset's; KV memory and model shape stay the preset's.
    perf_model_path: str = ""
    # Without a fitted model: what times the steps (splitserve.perf.backends.perf_model_for).
    perf_backend: str = "auto"
    perf_framework: str = "vllm"
    perf_database_version: str = ""

    def perf_model(self) -> PerfModel:
        if self.perf_model_path:
            return PerfModel.load(self.perf_model_path)
        return perf_model_for(self.gpu, self.model_preset, self.tp, backend=self.perf_backend,
                              framework=self.perf_framework, database_version=self.perf_database_version or None,
                              link=self.link)

    @property
    def label(self) -> str:
        return f"{gpu_spec(self.gpu).name}x{self.tp}/{model_spec(self.model_preset).name}"


@dataclass
class EmulatedSpec:
    """The part of `workers.engine.config.ModelSpec` the engine reads, without a checkpoint."""

    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    special_token_ids: list[int]  # never emitted: eos, bos, pad
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_dir: Path | None = None


def emulated_spec(emulation: Emulation, model_dir: str | Path | None = None) -> EmulatedSpec:
    """Shape and max length (the model's context) from the preset; vocabulary and EOS from
    `model_dir`'s config.json when given (the directory whose tokenizer the gateway uses), else
    from the preset. The directory's max_position_embeddings is not the emulated model's: a
    small tokenizer model's 2,048 would refuse the long prompts the preset serves."""
    m = model_spec(emulation.model_preset)
    vocab, max_len, eos, special = m.vocab, m.context_len, [], []
    path = Path(model_dir) if model_dir else None
    if path is not None:
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
        cfg = json.loads(cfg_file.read_text())
        vocab = int(cfg.get("vocab_size") or vocab)
        eos_raw = cfg.get("eos_token_id")
        gen = path / "generation_config.json"
        if gen.is_file():  # generation_config.json wins, as in load_model_spec
            eos_raw = json.loads(gen.read_text()).get("eos_token_id", eos_raw)
        eos = [] if eos_raw is None else [eos_raw] if isinstance(eos_raw, int) else list(eos_raw)
        special = [t for t in (cfg.get("bos_token_id"), cfg.get("pad_token_id")) if isinstance(t, int)]
    special = sorted({t for t in eos + special if 0 <= t < vocab})
    if len(special) >= vocab:
        raise ValueError(f"vocabulary of {vocab} ids leaves nothing to emit besides the special ids")
    return EmulatedSpec("emulated", vocab, max_len, eos, special, m.layers, m.kv_heads, m.head_dim, path)


@dataclass
class PacerStats:
    """Sums over the paced steps (seconds), as the `splitserve_emulated_*` metrics export them."""

    steps: int = 0
    model_s: float = 0.0  # the performance model's step times
    overhead_s: float = 0.0  # control-plane wall time inside the cycles
    overhead_cpu_s: float = 0.0  # ... of which engine-thread CPU time
    late_s: float = 0.0  # wake-ups past the model's deadline
    lost_s: float = 0.0  # time the emulated timeline fell behind and did not make up
    overruns: int = 0  # steps whose control-plane time exceeded the model time


@dataclass
class StepPacer:
    """Makes each step cycle last the model time: sleeps what the control plane did not use."""

    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep
    cpu_clock: Callable[[], float] = time.thread_time
    stats: PacerStats = field(default_factory=PacerStats)
    max_catch_up_s: float = 2e-3  # lateness the next step may make up for (oversleep, GIL hand-over)
    _gpu_free_at: float | None = None  # when the previous emulated pass ended (on the model's timeline)
    _woke_at: float = float("-inf")  # when the previous sleep actually returned
    _cpu_mark: float = 0.0  # engine-thread CPU time at the start of this cycle's control-plane work
    _cycle_start: float | None = None

    def begin_step(self, continuous: bool) -> None:
        """Top of an engine step; `continuous`: the engine came straight from the previous step."""
        now = self.clock()
        if continuous and self._gpu_free_at is not None:
            self._cycle_start = self._gpu_free_at
        else:
            self._cycle_start = now
            self._cpu_mark = self.cpu_clock()

    def run(self, model_s: float) -> None:
        """The emulated forward pass: sleep until the cycle has lasted `model_s`."""
        now = self.clock()
        cpu = self.cpu_clock() - self._cpu_mark
        start = self._cycle_start if self._cycle_start is not None else now
        self._cycle_start = None
        overhead = max(0.0, now - max(start, self._woke_at))  # control-plane time only, not the lateness
        deadline = start + model_s
        if deadline > now:
            self.sleep(deadline - now)
        self._woke_at = self.clock()
        self._cpu_mark = self.cpu_clock()
        late = max(0.0, self._woke_at - deadline)
        # The next cycle starts when this pass "ended": at the deadline (lateness becomes the
        # next cycle's overhead, up to max_catch_up_s), or now if the control plane overran.
        self._gpu_free_at = max(deadline, now, self._woke_at - self.max_catch_up_s)
        lost = self._gpu_free_at - deadline
        s = self.stats
        s.steps += 1
        s.model_s += model_s
        s.overhead_s += overhead
        s.overhead_cpu_s += cpu
        s.late_s += late
        s.lost_s += lost
        s.overruns += overhead > model_s
        STEPS.inc()
        MODEL_SECONDS.inc(model_s)
        OVERHEAD_SECONDS.inc(overhead)
        OVERHEAD_CPU_SECONDS.inc(cpu)
        LATE_SECONDS.inc(late)
        LOST_SECONDS.inc(lost)
        OVERHEAD.observe(overhead)
        LATE.observe(late)
        if overhead > model_s:
            OVERRUN_STEPS.inc()


class EmulatedRunner:
    """Stands in for `ModelRunner`: KV capacity from the preset, timing from the perf model."""

    def __init__(self, config: EngineConfig, emulation: Emulation, spec: EmulatedSpec,
                 pacer: StepPacer | None = None):
        self.config = config
        self.emulation = emulation
        self.spec = spec
        self.perf = emulation.perf_model()
        log.info("emulated %s: %s", emulation.label, self.perf.timing_note)
        self.pacer = pacer or StepPacer()
        self.block_size = config.block_size
        self.device = f"emulated:{emulation.label}"
        self.dtype = "bfloat16"
        self.use_flash = False
        self.kv_cache = None  # no KV values are held: transfers move metadata only
        m = model_spec(emulation.model_preset)
        per_gpu_token = m.kv_bytes_per_token() * max(m.kv_heads / emulation.tp, 1) / m.kv_heads
        self.bytes_per_block = int(per_gpu_token * emulation.tp * self.block_size)  # the whole instance
        if config.kv_cache_memory_bytes is not None:
            self.num_blocks = config.kv_cache_memory_bytes // self.bytes_per_block
        else:
            tokens = max_kv_tokens(emulation.gpu, emulation.model_preset, emulation.tp,
                                   mem_util=config.gpu_memory_utilization)
            self.num_blocks = tokens // self.block_size
        if self.num_blocks < 1:
            raise ValueError(f"{emulation.label}: no KV block fits (one block is {self.bytes_per_block} bytes)")
        self._vocab_emitted = spec.vocab_size - len(spec.special_token_ids)
        self.last_model_s = 0.0

    def execute(self, out: SchedulerOutput) -> dict[StageKey, int]:
        sampled = {e.seq.key: self.token_for(e.seq.token_ids, e.seq.params, e.seq.seed)
                   for e in out.entries if e.samples}
        self.last_model_s = step_time(self.perf, out.shape)
        self.pacer.run(self.last_model_s)
        decodes = out.shape.num_decodes
        if decodes:
            DECODE_TOKENS.inc(decodes)
            DECODE_MODEL_SECONDS.inc(decodes * self.last_model_s)
        return sampled

    def token_for(self, token_ids: list[int], params: SamplingParams, seed: int) -> int:
        """The token at position len(token_ids): see the module docstring."""
        key = token_ids[-1] if params.greedy else seed
        token = mix_seed(key, len(token_ids)) % self._vocab_emitted
        for special in self.spec.special_token_ids:  # sorted: skip over each special id
            if token >= special:
                token += 1
        return token

    def export_kv(self, block_table: list[int], start: int, end: int):
        raise NotImplementedError("the emulated backend holds no KV values to export")

    def import_kv(self, block_table: list[int], start: int, kv) -> None:
        raise NotImplementedError("the emulated backend holds no KV values to import")


class EmulatedEngine(Engine):
    """The real engine over an `EmulatedRunner`; paces steps and ignores stop strings (no
    tokenizer here: the gateway applies them to the text and cancels the request)."""

    def __init__(self, config: EngineConfig, emulation: Emulation = Emulation(),
                 clock: Callable[[], float] = time.monotonic, pacer: StepPacer | None = None):
        spec = emulated_spec(emulation, config.model or None)
        super().__init__(config, clock, spec=spec, runner=EmulatedRunner(config, emulation, spec, pacer))
        self.emulation = emulation
        self._continuous = False
        log.info("emulated engine: %s (%s), %d KV blocks of %d tokens, vocab %d, max_model_len %d",
                 emulation.label, self.runner.perf.label, self.runner.num_blocks, config.block_size,
                 spec.vocab_size, self.max_model_len)

    @property
    def perf_model(self) -> PerfModel:
        """The model whose step and transfer times this engine emulates."""
        return self.runner.perf

    def policy_perf_model(self) -> PerfModel:
        """`config.perf_model` if given, else the emulated model itself (the preset's or
        `emulation.perf_model_path`'s): slo_aware's table starts from the emulated times."""
        return super().policy_perf_model() or self.runner.perf

    def add_stage(self, spec: StageSpec) -> None:
        if spec.sampling.stop:
            spec = dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, stop=[]))
        super().add_stage(spec)

    def has_unfinished(self) -> bool:
        busy = super().has_unfinished()
        if not busy:  # the engine loop idles now: the next step starts a fresh cycle
            self._continuous = False
        return busy

    def step(self) -> list[TokenEvent]:
        self.runner.pacer.begin_step(self._continuous)
        events = super().step()
        # The engine loop steps again at once iff work is left and this step ran something.
        self._continuous = self.last_step_tokens > 0 and self.scheduler.has_unfinished()
        return events


PERF_MODEL_ENV = "SPLITSERVE_WORKER_PERF_MODEL"


def build_emulated_engine(config: EngineConfig, emulation: Emulation) -> EmulatedEngine:
    """An emulated engine; ValueError for an unknown GPU/model/tp or a model that does not fit.

    Without `emulation.perf_model_path`, a fitted model's JSON named by the environment
    variable SPLITSERVE_WORKER_PERF_MODEL (the worker option `--perf-model`, which the
    worker passes as `perf_model_path`) replaces the preset's times."""
    if not emulation.perf_model_path and os.environ.get(PERF_MODEL_ENV):
        emulation = dataclasses.replace(emulation, perf_model_path=os.environ[PERF_MODEL_ENV])
    if emulation.perf_model_path and not Path(emulation.perf_model_path).is_file():
        raise FileNotFoundError(f"perf model {emulation.perf_model_path!r} does not exist")
    if config.dtype != "auto":
        raise ValueError(f"dtype: the emulated backend models bfloat16 KV; leave dtype auto, got {config.dtype!r}")
    # The engine thread wakes from its sleep needing the GIL, which the worker's event loop may
    # otherwise hold for the default 5 ms switch interval: a late step. Hand it over sooner.
    sys.setswitchinterval(5e-4)  # measured: late steps 4.2% vs 5-11% of the model time at 5 ms
    return EmulatedEngine(config, emulation)
