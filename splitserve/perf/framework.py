"""The serving framework's own cost per step, on top of the measured kernels (issue 34).

aiconfigurator's database times each kernel alone on a real GPU; a serving engine also pays,
every step, for its scheduler, the batch's input preparation, sampling and output
processing (CPU work, some of it per sequence), and its kernels run back to back with launch
gaps and shared caches that an isolated timing does not show. So the sum of the measured
kernels under-predicts what users of the framework see: against aiconfigurator's own
end-to-end measurements of vLLM serving (`systems/silicon_sample.csv`: mean TPOT of closed-loop
runs at concurrency c), the simulator on the kernel tables alone put vLLM's TPOT a median 19%
low (up to 36%), most at high tensor parallelism, where the kernels are shortest.

`FrameworkOverhead` is that difference as three constants:

    step seconds = overhead_s + per_seq_s * sequences in the step + kernel_scale * (kernel sum)

fitted by `benchmarks/framework_overhead.py` to those end-to-end runs (which run is where, and
how far the fitted model lands from each, is docs/perf_model.md, "Framework overhead"). Only
vLLM has bf16 end-to-end runs of a model this project tabulates, so only vLLM has constants;
other frameworks keep the kernel sum and their reports say so. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from splitserve.perf.model import PerfModel
from splitserve.perf.tables import check_step_cost

__all__ = ["FRAMEWORK_OVERHEADS", "FrameworkOverhead", "with_framework_overhead"]


@dataclass(frozen=True)
class FrameworkOverhead:
    """What one framework adds to each step beyond its measured kernels."""

    overhead_s: float  # every step
    per_seq_s: float  # per sequence in the step (a decode or a prefill chunk)
    kernel_scale: float  # end-to-end kernel time / the sum of isolated kernel timings (>= 1)
    source: str  # what it was fitted to

    def __post_init__(self) -> None:
        check_step_cost(self, "FrameworkOverhead", ("overhead_s", "per_seq_s"), "kernel_scale")

    def describe(self) -> dict[str, Any]:
        return {"overhead_ms": round(self.overhead_s * 1e3, 4), "per_seq_ms": round(self.per_seq_s * 1e3, 5),
                "kernel_scale": round(self.kernel_scale, 4), "fitted_to": self.source}


# Fitted by `benchmarks/framework_overhead.py` (least squares of the TPOT residual on the
# concurrency and the kernel-only TPOT; its output, docs/perf_model.md "Framework overhead").
FRAMEWORK_OVERHEADS: Mapping[str, FrameworkOverhead] = {
    "vllm": FrameworkOverhead(
        overhead_s=0.0185e-3, per_seq_s=0.03181e-3, kernel_scale=1.1583,
        source="aiconfigurator-core silicon_sample.csv: vllm 0.12.0 agg, Qwen3-32B bf16, H100-SXM5-80GB TP2/4/8 (85 runs)"),
}


def with_framework_overhead(model: PerfModel, framework: str, overhead: FrameworkOverhead | None = None) -> PerfModel:
    """`model` with `framework`'s per-step cost (`overhead`, default its fitted constants) added
    to its step tables, and its label saying so; unchanged (its label saying *kernels only*)
    where the framework has no constants, and unchanged where the model has no tables (the
    datasheet roofline keeps its own overheads)."""
    if model.tables is None:
        return model
    if overhead is None:
        return _with_fitted(model, framework)
    return _apply(model, framework, overhead)


@lru_cache(maxsize=128)  # one object per model: simulators compare and cache by it, and a digest costs ms
def _with_fitted(model: PerfModel, framework: str) -> PerfModel:
    return _apply(model, framework, FRAMEWORK_OVERHEADS.get(framework))


def _apply(model: PerfModel, framework: str, fo: FrameworkOverhead | None) -> PerfModel:
    if fo is None:
        return dataclasses.replace(model, label=f"{model.label}+kernels-only({framework}: no end-to-end fit)")
    tables = dataclasses.replace(
        model.tables, overhead_s=model.tables.overhead_s + fo.overhead_s, per_seq_overhead_s=fo.per_seq_s,
        kernel_scale=fo.kernel_scale, source={**model.tables.source, "framework_overhead": {framework: fo.describe()}})
    return dataclasses.replace(model, tables=tables, label=f"{model.label}+{framework}-overhead")
