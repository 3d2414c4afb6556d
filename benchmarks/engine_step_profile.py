"""Where an engine step's time goes: scheduling, batch preparation, the forward pass, sampling
and the core's bookkeeping, per step, on the same workload as benchmarks/engine_vs_vllm.py.

Times each phase of `Engine.step` by wrapping the runner's and scheduler's methods (the
engine's own code is unchanged), over the whole offline run, and splits steps into
decode-only and mixed. "Overhead" is a step's time outside the model forward. With
--torch-profile, also writes a torch profiler table of one decode step's operators.

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/engine_step_profile.py \\
        --model models/smollm2-135m-instruct --out bench-results/engine_step_profile.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from common import REPO

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from workers.engine import Engine, EngineConfig, SamplingParams, StageSpec  # noqa: E402
from workers.engine import model_runner as runner_module  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "sample", "update")
# Inside the forward: the compiled decode-attention kernel's own time (when it serves).
SUB_PHASES = ("decode_attention",)


class PhaseTimer:
    """Wraps callables so that each call's wall time is added to its phase for the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - started
        return timed

    def take(self) -> dict[str, float]:
        taken, self.current = dict(self.current), defaultdict(float)
        return taken


def instrument(engine: Engine, timer: PhaseTimer) -> None:
    runner, scheduler = engine.runner, engine.scheduler
    scheduler.schedule = timer.wrap("schedule", scheduler.schedule)
    scheduler.update_from_output = timer.wrap("update", scheduler.update_from_output)
    runner.prepare = timer.wrap("prepare", runner.prepare)
    if runner.decode_kernel is not None:
        runner.decode_kernel = timer.wrap("decode_attention", runner.decode_kernel)
    runner.model = _TimedModule(runner.model, timer.wrap)
    runner_module.sampler.sample = timer.wrap("sample", runner_module.sampler.sample)


class _TimedModule:
    def __init__(self, module, wrap):
        self._module = module
        self._call = wrap("forward", module.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-backend", default="auto", help="auto | sdpa | cpu_kernel (the engine's option)")
    ap.add_argument("--cpu-linear", default="auto", help="auto | onednn | torch (the engine's option)")
    ap.add_argument("--elementwise", default="auto", choices=["auto", "torch"],
                    help="auto: the compiled fused RMSNorm/rotary/SiLU·mul where they built | torch: torch ops")
    ap.add_argument("--torch-profile", action="store_true", help="also profile one decode step's operators")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results/engine_step_profile.json")
    args = ap.parse_args()
    console = Console()

    engine = Engine(EngineConfig(model=args.model, dtype="float32", num_threads=args.threads,
                                 max_num_seqs=args.requests, max_num_batched_tokens=2048, detokenize=False,
                                 attention_backend=args.attention_backend, cpu_linear=args.cpu_linear))
    if args.elementwise == "torch":
        engine.runner.set_fused_ops(False)
    vocab = engine.spec.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.add_stage(StageSpec.whole("warmup", prompts[0], params))
    while engine.has_unfinished():
        engine.step()

    timer = PhaseTimer()
    instrument(engine, timer)
    for i, prompt in enumerate(prompts):
        engine.add_stage(StageSpec.whole(f"r{i}", prompt, params))
    steps = []
    started = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        phases = timer.take()
        out = engine.last_output
        steps.append({"total": total, **phases, "tokens": out.num_tokens, "decodes": out.shape.num_decodes,
                      "prefill_tokens": out.shape.num_prefill_tokens})
    elapsed = time.perf_counter() - started
    produced = args.requests * args.output_len

    table = Table(title=f"{Path(args.model).name}: {len(steps)} steps, {produced / elapsed:.0f} output tok/s, "
                        f"ms per step (median)")
    for col in ("steps", "n", "total", *PHASES, *SUB_PHASES, "other", "overhead (not forward)", "overhead share"):
        table.add_column(col, justify="right")
    summary = {}
    for label, chosen in (("decode-only", [s for s in steps if not s["prefill_tokens"]]),
                          ("with prefill", [s for s in steps if s["prefill_tokens"]]), ("all", steps)):
        if not chosen:
            continue
        med = {k: statistics.median(s.get(k, 0.0) for s in chosen) * 1e3 for k in ("total", *PHASES, *SUB_PHASES)}
        other = statistics.median(s["total"] - sum(s.get(p, 0.0) for p in PHASES) for s in chosen) * 1e3
        overhead = statistics.median(s["total"] - s.get("forward", 0.0) for s in chosen) * 1e3
        summary[label] = {**med, "other": other, "overhead": overhead, "steps": len(chosen),
                          "overhead_share": overhead / med["total"]}
        table.add_row(label, str(len(chosen)), *(f"{med[k]:.2f}" for k in ("total", *PHASES, *SUB_PHASES)),
                      f"{other:.2f}", f"{overhead:.2f}", f"{overhead / med['total']:.0%}")
    console.print(table)

    profile = None
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        engine.add_stage(StageSpec.whole("p", prompts[0], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True)))
        for i in range(1, 16):
            engine.add_stage(StageSpec.whole(f"p{i}", prompts[i], SamplingParams(max_tokens=4, temperature=0.0,
                                                                                  ignore_eos=True)))
        engine.step()  # the prefills
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()  # a decode step of 16
        profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        console.print(profile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "model": args.model, "summary": summary,
                                    "output_tok_s": produced / elapsed, "steps": steps,
                                    "torch_profile": profile}, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
