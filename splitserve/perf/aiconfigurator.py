"""GPU step times from measured data: NVIDIA aiconfigurator's per-op database, tabulated.

`aiconfigurator-core` (PyPI, Apache-2.0) ships per-op timings measured on A100, H100, H200,
L40S, B200, ... with vLLM, SGLang and TensorRT-LLM (GEMMs, context attention, generation
attention, all-reduce), and a compiled estimator over them. One of its calls costs a few
microseconds to ~0.1 ms, far too slow per simulated step, so a model is tabulated once at
start (`tabulate`): each kernel class of `splitserve.perf.tables` on a grid, about 3,500
op evaluations, ~0.5 s plus loading the database. Tables are cached in memory and on disk
(`$SPLITSERVE_PERF_CACHE`, else `~/.cache/splitserve/perf`), keyed by everything that
changes them; a cached file is a plain `PerfModel` JSON and loads without aiconfigurator.

Which backend times a run (measured, fitted roofline, datasheet, or `auto`) is chosen by
`splitserve.perf.backends.perf_model_for`. Either way the model's `backend` and `label` say which timed it, and every report prints
them. The coefficients of a measured model are the datasheet preset's: they serve only the
closed forms the tables do not (regimes, KV transfer).

Models the database lacks (Qwen2.5) are compiled from the presets' own config fields
(`splitserve.perf.presets.ModelSpec`), written as a Hugging Face config.json.

Mixture-of-experts models (Mixtral-8x7B) compile as aiconfigurator's `MOE` family with the
experts split tensor-parallel like the attention (`moe_tp_size = tp`, no expert parallelism,
as vLLM serves Mixtral by default); their `linear` tables then hold the measured fused-MoE
kernel (vLLM's Triton `fused_moe` for BF16) at each token count, routed with aiconfigurator's
default skew (power law, alpha 1.2), so the experts a step touches are in the measurement.
A shape the MoE table lacks is a `ValueError` with the database's own words.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from splitserve.perf.model import PerfModel
from splitserve.perf.presets import ModelSpec, gpu_spec, model_spec, preset
from splitserve.perf.tables import (BATCH_GRID, CHUNK_GRID, LOGITS_GRID, TOKEN_GRID, StepTables, context_grid,
                                    history_grid)

__all__ = ["FRAMEWORKS", "SYSTEMS", "Coverage", "coverage", "tabulate"]

log = logging.getLogger(__name__)

FRAMEWORKS = ("vllm", "sglang", "trtllm")
# Our GPU presets (splitserve.perf.presets.GPU_SPECS) -> aiconfigurator's system names.
SYSTEMS = {"A100-SXM4-80GB": "a100_sxm", "H100-SXM5-80GB": "h100_sxm", "H200-SXM-141GB": "h200_sxm",
           "L40S-48GB": "l40s"}
SCHEMA = 3  # bump when the grids or the composition change: old cache files are ignored

_ATTENTION = 3  # index of context_attention / generation_attention in aiconfigurator's dense op lists


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What the installed aiconfigurator database covers."""

    version: str | None  # aiconfigurator-core's version; None when it is not installed
    systems: dict[str, tuple[str, ...]]  # system -> frameworks with GEMM and attention data
    moe: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # system -> frameworks with MoE data

    def describe(self) -> str:
        if self.version is None:
            return "aiconfigurator-core is not installed (pip install aiconfigurator-core)"
        ours = {name: sys for name, sys in SYSTEMS.items()}
        parts = [f"{name} ({sys}): {', '.join(self.systems.get(sys, ())) or 'no data'}"
                 + (f" (MoE: {', '.join(self.moe[sys])})" if self.moe.get(sys) else "") for name, sys in ours.items()]
        return f"aiconfigurator-core {self.version} covers " + "; ".join(parts)


@lru_cache(maxsize=1)
def coverage() -> Coverage:
    try:
        import aiconfigurator_core
        from importlib.metadata import version
    except ImportError:
        return Coverage(None, {})
    data = Path(aiconfigurator_core.__file__).parent / "systems" / "data"
    systems, moe = {}, {}
    for sys_dir in sorted(p for p in data.iterdir() if p.is_dir()):
        frameworks = tuple(f for f in FRAMEWORKS
                           if (sys_dir / "gemm" / f).is_dir() and (sys_dir / "attention" / f).is_dir())
        if frameworks:
            systems[sys_dir.name] = frameworks
            moe_frameworks = tuple(f for f in frameworks if (sys_dir / "moe" / f).is_dir())
            if moe_frameworks:
                moe[sys_dir.name] = moe_frameworks
    return Coverage(version("aiconfigurator-core"), systems, moe)


def _architecture(m: ModelSpec) -> tuple[str, str]:
    hf = m.hf_id.lower()
    if m.is_moe:  # aiconfigurator's MOE family: routed experts, no shared expert (Mixtral's layout)
        return "MixtralForCausalLM", "mixtral"
    if hf.startswith("qwen/qwen3"):
        return "Qwen3ForCausalLM", "qwen3"
    if hf.startswith("qwen/qwen2"):
        return "Qwen2ForCausalLM", "qwen2"
    return "LlamaForCausalLM", "llama"


def hf_config(m: ModelSpec) -> dict[str, Any]:
    """A Hugging Face config.json of the preset's shape (what aiconfigurator compiles)."""
    arch, kind = _architecture(m)
    config = {"architectures": [arch], "model_type": kind, "hidden_size": m.hidden,
              "intermediate_size": m.intermediate, "num_attention_heads": m.heads,
              "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "num_hidden_layers": m.layers,
              "vocab_size": m.vocab, "max_position_embeddings": m.context_len,
              "tie_word_embeddings": m.tied_embeddings, "torch_dtype": "bfloat16", "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 1e6}
    if m.is_moe:  # dense configs stay exactly as they were (their cache keys hash this dict)
        config.update(num_local_experts=m.experts, num_experts_per_tok=m.experts_per_token,
                      moe_intermediate_size=m.expert_intermediate)
    return config


def _check_covered(gpu_name: str, m: ModelSpec, framework: str) -> str:
    """aiconfigurator's system name for the GPU; ValueError naming what is covered if not."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"perf framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    cov = coverage()
    if cov.version is None:
        raise ValueError(cov.describe())
    system = SYSTEMS.get(gpu_name)
    if system is None or framework not in cov.systems.get(system, ()):
        raise ValueError(f"no measured {framework} data for {gpu_name}: {cov.describe()}")
    if m.kind != "ar":
        raise ValueError(f"{m.name} is a diffusion LM: aiconfigurator measures autoregressive serving only "
                         "(dLLM-Serve's steps use splitserve.core.diffusion_perf)")
    if m.is_moe and framework not in cov.moe.get(system, ()):
        raise ValueError(f"no measured {framework} MoE data for {gpu_name} ({m.name} is a mixture of experts): "
                         f"{cov.describe()}")
    return system


_LOCK = threading.Lock()


def tabulate(gpu: str, model: str, tp: int = 1, *, framework: str = "vllm", database_version: str | None = None,
             link: str = "rdma-400g", cache_dir: str | Path | None = None) -> PerfModel:
    """The measured-data `PerfModel` of `model` on `tp` x `gpu` under `framework`'s kernels
    (aiconfigurator database `database_version`, default its current one). Cached."""
    g, m = gpu_spec(gpu), model_spec(model)
    system = _check_covered(g.name, m, framework)
    key = _cache_key(system, m, tp, framework, database_version)
    with _LOCK:
        memory_key = f"{key}|{link}|{cache_dir or ''}"  # a cache_dir asked for is written even if in memory
        cached = _MEMORY.get(memory_key)
        if cached is not None:
            return cached
        base = preset(g, m, tp, link=link, check_memory=False)
        tables = _read_cache(key, cache_dir)
        if tables is None:
            tables = _measure(system, m, tp, framework, database_version)
            _write_cache(key, tables, cache_dir)
        src = tables.source
        model_obj = dataclasses.replace(
            base, tables=tables,
            label=f"aiconfigurator:{g.name}/{m.name}/tp{tp}/{src['framework']}-{src['database_version']}")
        _MEMORY[memory_key] = model_obj
        return model_obj


_MEMORY: dict[str, PerfModel] = {}


def _cache_key(system: str, m: ModelSpec, tp: int, framework: str, version: str | None) -> str:
    cov = coverage()
    shape = json.dumps(hf_config(m), sort_keys=True)
    raw = f"{SCHEMA}|{cov.version}|{system}|{framework}|{version or 'current'}|tp{tp}|{shape}"
    return f"{system}-{m.name}-tp{tp}-{framework}-" + hashlib.sha256(raw.encode()).hexdigest()[:12]


def _cache_path(key: str, cache_dir: str | Path | None) -> Path:
    root = cache_dir or os.environ.get("SPLITSERVE_PERF_CACHE") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitserve" / "perf"
    return Path(root) / f"{key}.json"


def _read_cache(key: str, cache_dir: str | Path | None) -> StepTables | None:
    path = _cache_path(key, cache_dir)
    try:
        return StepTables.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None  # absent or unreadable: measure again


def _write_cache(key: str, tables: StepTables, cache_dir: str | Path | None) -> None:
    path = _cache_path(key, cache_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(tables.to_dict(), tmp)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, path)  # atomic: concurrent simulators never read half a file
    except OSError as exc:
        log.warning("could not cache the measured perf tables at %s: %s", path, exc)


def _measure(system: str, m: ModelSpec, tp: int, framework: str, version: str | None) -> StepTables:
    """Evaluate aiconfigurator's ops on the grids (the slow part: ~1-2 s with the database load)."""
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)  # its fallback-row notices
    from aiconfigurator_core.sdk.engine import EngineHandle

    # An MoE model's experts are tensor-parallel like its attention (aiconfigurator requires
    # tp = moe_tp x moe_ep; vLLM's default for Mixtral is expert TP, no expert parallelism).
    parallel = {"moe_tp_size": tp} if m.is_moe else {}
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(hf_config(m)))
        try:
            handle = EngineHandle.compile(model_dir, system, framework, tp_size=tp, backend_version=version,
                                          **parallel)
            # The first evaluation is where a missing table shows (an MoE shape the database lacks).
            context_ops, generation_ops = handle.run_static_per_op(batch_size=1, isl=16, osl=2)
        except Exception as exc:  # the database's own words: which version, which op lacks data
            raise ValueError(f"aiconfigurator cannot model {m.name} tp{tp} on {system}/{framework}"
                             f"{'/' + version if version else ''}: {exc}") from exc
    ctx_names, gen_names = [op[0] for op in context_ops], [op[0] for op in generation_ops]
    # Dense and MoE op lists alike keep attention at index 3 (embedding, add-norm, qkv, attention,
    # ...); an MoE list has router, dispatch and moe ops where a dense one has its MLP GEMMs, all
    # of them linear in the tokens, and no context logits.
    if ctx_names[_ATTENTION] != "context_attention" or gen_names[_ATTENTION] != "generation_attention":
        raise ValueError(f"aiconfigurator's op list for {m.name} is not the layout this backend reads: "
                         f"{ctx_names}")
    if m.is_moe and not any(n.endswith("_moe") for n in gen_names):
        raise ValueError(f"aiconfigurator's op list for {m.name} has no MoE op: {gen_names}")
    ctx_linear = [i for i, n in enumerate(ctx_names) if i != _ATTENTION and not n.endswith("logits_gemm")]
    gen_linear = [i for i, n in enumerate(gen_names) if i != _ATTENTION and not n.endswith("logits_gemm")]
    logits = gen_names.index(next(n for n in gen_names if n.endswith("logits_gemm")))

    def ms(values: list) -> float:
        return sum(v[1] for v in values) / 1e3

    max_len = m.context_len
    contexts, histories = context_grid(max_len), history_grid(max_len)
    raw = dict(
        tokens=TOKEN_GRID,
        context_linear=[ms(handle.evaluate_context_ops(ctx_linear, batch_size=1, s=t, x=t)) for t in TOKEN_GRID],
        generation_linear=[ms(handle.evaluate_generation_ops(gen_linear, batch_size=t, s=1)) for t in TOKEN_GRID],
        logits_rows=LOGITS_GRID,
        logits=[ms(handle.evaluate_generation_ops([logits], batch_size=r, s=1)) for r in LOGITS_GRID],
        chunk_tokens=CHUNK_GRID, chunk_history=histories,
        prefill_attention=[[ms(handle.evaluate_context_ops([_ATTENTION], batch_size=1, s=n, prefix=h))
                            for h in histories] for n in CHUNK_GRID],
        decode_batch=BATCH_GRID, decode_context=contexts,
        decode_attention=[[ms(handle.evaluate_generation_ops([_ATTENTION], batch_size=b, s=c))
                           for c in contexts] for b in BATCH_GRID],
    )
    from importlib.metadata import version as dist_version

    resolved = version or _current_version(system, framework)
    source = {"backend": "aiconfigurator", "system": system, "framework": framework,
              "database_version": resolved, "aiconfigurator_core": dist_version("aiconfigurator-core"),
              "model": m.name, "tp": tp}
    if m.is_moe:
        source.update(moe_tp=tp, moe_ep=1, moe_distribution="power_law_1.2")
    tables, fixes = StepTables.from_raw(**raw, source=source)
    return dataclasses.replace(tables, source={**source, "monotone_fix": {k: round(v, 4) for k, v in fixes.items()}})


def _current_version(system: str, framework: str) -> str:
    """The database version aiconfigurator serves as `current` for (system, framework)."""
    try:
        import aiconfigurator_core
        import yaml

        path = Path(aiconfigurator_core.__file__).parent / "systems" / "query_versions.yaml"
        doc = yaml.safe_load(path.read_text())
        slot = (doc.get("overrides", {}).get(system, {}) or {}).get(framework) or doc["defaults"][framework]
        return str(slot["current"])
    except Exception:  # the label only: never fail a model over it
        return "current"
