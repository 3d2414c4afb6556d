"""Which model times GPU steps: `perf_model_for(gpu, model, tp, backend=...)`, the one way every
simulator, emulated worker and planner gets its `PerfModel` (docs/perf_model.md).

* `aiconfigurator`: NVIDIA's per-op timings measured on real GPUs, tabulated
  (`splitserve.perf.aiconfigurator`); an uncovered GPU x model x framework is a `ValueError`
  naming what is covered;
* `roofline`: the kernel-class roofline fitted to that database (`splitserve.perf.roofline`),
  for GPUs and models it lacks (H20, RTX 4090);
* `datasheet`: the whole-step roofline at datasheet peaks (`splitserve.perf.presets.preset`),
  which timed every result before issue 34 and stays reachable to reproduce them;
* `auto` (the default): measured where covered, else the kernel-class roofline with a warning
  saying why (never a silent guess).

`aiconfigurator`, `roofline` and `auto` time a step as the framework runs it: the kernels plus
the framework's own per-step cost fitted to end-to-end measurements (`splitserve.perf.framework`;
vLLM's). Their `-kernels` forms (`auto-kernels`, ...) are the sum of the kernels alone, what
every measured result before that fit used.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from splitserve.perf.aiconfigurator import tabulate
from splitserve.perf.framework import with_framework_overhead
from splitserve.perf.model import PerfModel
from splitserve.perf.presets import preset
from splitserve.perf.roofline import roofline_model

__all__ = ["BACKENDS", "PERF_BACKEND_HELP", "PERF_DATABASE_VERSION_HELP", "PERF_FRAMEWORK_HELP", "perf_model_for"]

log = logging.getLogger(__name__)

KERNELS_ONLY = "-kernels"
BACKENDS = ("auto", "aiconfigurator", "roofline", "datasheet",
            "auto" + KERNELS_ONLY, "aiconfigurator" + KERNELS_ONLY, "roofline" + KERNELS_ONLY)


def perf_model_for(gpu: str, model: str, tp: int = 1, *, backend: str = "auto", framework: str = "vllm",
                   database_version: str | None = None, dtype: str = "bf16", link: str = "rdma-400g",
                   check_memory: bool = True) -> PerfModel:
    """The step-time model every simulator, emulated worker and planner uses (`-kernels`: without
    the framework's per-step cost, see the module docstring):

    * `aiconfigurator`: the measured tables (ValueError where not covered);
    * `roofline`: the kernel-class roofline (`splitserve.perf.roofline.roofline_model`: a step is
      the sum of its kernel classes, with constants fitted to the measured database per GPU
      generation);
    * `datasheet`: the whole-step datasheet roofline (`splitserve.perf.presets.preset`);
    * `auto`: measured where covered, else the kernel-class roofline with a warning.

    A diffusion LM (LLaDA) is timed by the datasheet preset under `roofline` and `auto` (its
    denoising steps use `PerfModel.diffusion_step_time` and `splitserve.core.diffusion_perf`)."""
    if backend not in BACKENDS:
        raise ValueError(f"perf backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend.endswith(KERNELS_ONLY):
        return _kernel_model(gpu, model, tp, backend.removesuffix(KERNELS_ONLY), framework, database_version,
                             dtype, link, check_memory)
    found = _kernel_model(gpu, model, tp, backend, framework, database_version, dtype, link, check_memory)
    return with_framework_overhead(found, framework) if found.backend != "datasheet" else found


def _kernel_model(gpu: str, model: str, tp: int, backend: str, framework: str, database_version: str | None,
                  dtype: str, link: str, check_memory: bool) -> PerfModel:
    datasheet = preset(gpu, model, tp, dtype=dtype, link=link, check_memory=check_memory)
    if backend == "datasheet":
        return datasheet

    def roofline() -> PerfModel:
        return roofline_model(gpu, model, tp, dtype=dtype, link=link, check_memory=check_memory)

    if backend == "roofline":
        return roofline()
    if dtype != "bf16":
        reason = f"the measured backend tabulates bf16 only, not {dtype}"
        if backend == "aiconfigurator":
            raise ValueError(reason)
        fallback = roofline()
        _warn_fallback(gpu, model, reason, fallback.label)
        return fallback
    try:
        return tabulate(gpu, model, tp, framework=framework, database_version=database_version, link=link)
    except ValueError as exc:
        if backend == "aiconfigurator":
            raise
        fallback = roofline()
        _warn_fallback(gpu, model, str(exc), fallback.label)
        return fallback


# The three options every command that times GPU steps takes (simulate, plan, emulated workers'
# `WorkerConfig`), as (default, flags..., help=, envvar=) for typer.Option.
PERF_BACKEND_HELP = ("Step times: aiconfigurator (NVIDIA's per-op timings measured on real GPUs, tabulated) | "
                     "roofline (a sum of kernel classes, each max(compute, memory), with constants fitted to the "
                     "measured database per GPU generation) | datasheet (the whole-step roofline at datasheet peaks "
                     "that timed results before issue 34) | auto (measured where the GPU x model x framework is "
                     "covered, else the roofline with a warning). These three add the framework's per-step cost "
                     "fitted to end-to-end measurements (vLLM's); their -kernels forms (auto-kernels, ...) time the "
                     "kernels alone.")
PERF_FRAMEWORK_HELP = "The serving framework whose measured kernels time the steps: vllm | sglang | trtllm."
PERF_DATABASE_VERSION_HELP = ("aiconfigurator database version of --perf-framework (default: the one it serves "
                              "as current for the GPU).")


@lru_cache(maxsize=64)
def _warn_fallback(gpu: str, model: str, reason: str, label: str = "") -> None:
    what = ("the datasheet roofline" if label.startswith("preset:") else "the kernel-class roofline")
    log.warning("perf backend auto: %s times %s on %s (%s): %s", what, model, gpu, reason, label)
