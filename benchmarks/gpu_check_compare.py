"""Measured mixed-step latencies (the GPU check's grid) against aiconfigurator and the perf model.

Reads the `grid.json` that `scripts/gpu_check.sh` writes (sub-check `grid`: records
{chunk_tokens, chunk_history, decode_batch, decode_context, seconds_median, repeats}) and,
for every measured point, estimates the same step with

* aiconfigurator (`aiconfigurator_core`, installed in this project's .venv): its H100 vLLM
  per-op tables for Llama-3.1-8B. A mixed step of one chunk of L new tokens on H cached
  ones plus B decodes at context C is taken as
      non-attention context ops at T = L + B tokens            (GEMMs, norms, embedding, logits)
    + context attention of L tokens on a prefix of H            (when L > 0)
    + generation attention of B sequences at context C          (when B > 0)
  (`EngineHandle.evaluate_context_ops` / `evaluate_generation_ops`, batch 1 for the context part);
* the project's performance model, `splitserve.perf.presets.preset("H100", "Llama-3-8B")`,
  `step_time(prefills=[(H, L)], decode_batch=B, decode_ctx=C)`.

It prints a table (ms, and each estimate over the measurement) and writes it as JSON and
Markdown beside the input (or to --out). It runs on the CPU; without aiconfigurator_core the
aiconfigurator column is left empty, saying why.

    .venv/bin/python benchmarks/gpu_check_compare.py gpu_check_out/grid.json
    .venv/bin/python benchmarks/gpu_check_compare.py gpu_check_out            # the folder works too
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)

LLAMA3_8B_SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256}


class AiconfiguratorSteps:
    """Mixed-step estimates (ms) from aiconfigurator's per-op tables, parts kept apart."""

    def __init__(self, model: str, system: str, backend: str):
        from aiconfigurator_core.sdk.engine import EngineHandle

        self.label = f"aiconfigurator {model} on {system} ({backend}, tp 1)"
        self.handle = EngineHandle.compile(model, system, backend, tp_size=1)
        context, generation = self.handle.run_static_per_op(batch_size=1, isl=512, osl=2)
        context_names = [op[0] for op in context]
        generation_names = [op[0] for op in generation]
        self.context_attention = context_names.index("context_attention")
        self.generation_attention = generation_names.index("generation_attention")
        self.non_attention = [i for i in range(len(context_names)) if i != self.context_attention]
        # The indices name the ops that evaluate_* computes (checked: the folded list could reorder).
        got = self.handle.evaluate_context_ops([self.context_attention], batch_size=1, s=16)[0][0]
        if got != "context_attention":
            raise RuntimeError(f"context op {self.context_attention} is {got!r}, not context_attention")
        self.non_attention_names = [context_names[i] for i in self.non_attention]

    def step_ms(self, chunk: int, history: int, batch: int, context: int) -> dict:
        tokens = chunk + batch
        parts = {"non_attention_ms": sum(op[1] for op in self.handle.evaluate_context_ops(
            self.non_attention, batch_size=1, s=tokens, prefix=0))}
        parts["context_attention_ms"] = (self.handle.evaluate_context_ops(
            [self.context_attention], batch_size=1, s=chunk, prefix=history)[0][1] if chunk else 0.0)
        parts["decode_attention_ms"] = (self.handle.evaluate_generation_ops(
            [self.generation_attention], batch_size=batch, s=context)[0][1] if batch else 0.0)
        parts["total_ms"] = sum(parts.values())
        return parts


def load_grid(path: Path) -> dict:
    if path.is_dir():
        path = path / "grid.json"
    data = json.loads(path.read_text())
    if "records" not in data and "subchecks" in data:  # gpu_check.json: the grid inside it
        data = data["subchecks"].get("grid", {})
    if not data.get("records"):
        raise SystemExit(f"{path}: no measured records (status {data.get('status')!r}: {data.get('reason', '')})")
    data["_path"] = str(path)
    return data


def compare(grid: dict, aic: AiconfiguratorSteps | None, perf_model) -> list[dict]:
    rows = []
    for rec in sorted(grid["records"], key=lambda r: (r["chunk_history"], r["chunk_tokens"], r["decode_batch"],
                                                      r["decode_context"])):
        chunk, history, batch, context = (rec["chunk_tokens"], rec["chunk_history"], rec["decode_batch"],
                                          rec["decode_context"])
        measured_ms = rec["seconds_median"] * 1e3
        row = {"chunk_tokens": chunk, "chunk_history": history, "decode_batch": batch, "decode_context": context,
               "measured_ms": measured_ms, "repeats": rec.get("repeats")}
        if aic is not None:
            parts = aic.step_ms(chunk, history, batch, context)
            row.update({f"aic_{k}": v for k, v in parts.items()})
            row["aic_over_measured"] = parts["total_ms"] / measured_ms
        if perf_model is not None:
            prefills = [(history, chunk)] if chunk else []
            model_ms = perf_model.step_time(prefills=prefills, decode_batch=batch, decode_ctx=context) * 1e3
            row["perf_model_ms"] = model_ms
            row["perf_model_over_measured"] = model_ms / measured_ms
        rows.append(row)
    return rows


def summarize(rows: list[dict], key: str) -> dict | None:
    ratios = [r[key] for r in rows if key in r and r[key] > 0]
    if not ratios:
        return None
    return {"points": len(ratios), "median": statistics.median(ratios),
            "geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)), "min": min(ratios), "max": max(ratios)}


def table(rows: list[dict]) -> list[str]:
    has_aic = any("aic_total_ms" in r for r in rows)
    has_model = any("perf_model_ms" in r for r in rows)
    head = ["chunk", "hist", "B", "C", "measured ms"]
    if has_aic:
        head += ["aic ms", "(non-attn", "ctx-attn", "dec-attn)", "aic/meas"]
    if has_model:
        head += ["model ms", "model/meas"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r in rows:
        cells = [str(r["chunk_tokens"]), str(r["chunk_history"]), str(r["decode_batch"]), str(r["decode_context"]),
                 f"{r['measured_ms']:.3f}"]
        if has_aic:
            cells += [f"{r['aic_total_ms']:.3f}", f"{r['aic_non_attention_ms']:.3f}",
                      f"{r['aic_context_attention_ms']:.3f}", f"{r['aic_decode_attention_ms']:.3f}",
                      f"{r['aic_over_measured']:.2f}"]
        if has_model:
            cells += [f"{r['perf_model_ms']:.3f}", f"{r['perf_model_over_measured']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid", type=Path, help="grid.json from scripts/gpu_check.sh (or its output folder)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write the comparison (.json; a .md beside it); default: beside the input")
    ap.add_argument("--aic-model", default="meta-llama/Meta-Llama-3.1-8B")
    ap.add_argument("--aic-system", default="h100_sxm")
    ap.add_argument("--aic-backend", default="vllm")
    ap.add_argument("--preset-gpu", default="H100")
    ap.add_argument("--preset-model", default="Llama-3-8B")
    ap.add_argument("--no-aiconfigurator", action="store_true", help="leave the aiconfigurator column out")
    ap.add_argument("--verbose", action="store_true", help="keep aiconfigurator's log messages")
    args = ap.parse_args()
    if not args.verbose:
        logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)

    grid = load_grid(args.grid)
    notes = []
    model = grid.get("model", {})
    if model.get("shape") and model["shape"] != LLAMA3_8B_SHAPE:
        notes.append(f"the measured model is not Llama-3-8B-shaped ({model.get('name')}: {model['shape']}); "
                     "the estimates are for Llama-3-8B on an H100, so the ratios only show the comparison runs")
    if model.get("attention"):
        notes.append(f"engine attention backend during the measurement: {model['attention']}; "
                     f"device: {model.get('gpu') or model.get('device')}; dtype {model.get('dtype')}")
    aic = None
    if args.no_aiconfigurator:
        notes.append("aiconfigurator left out (--no-aiconfigurator)")
    else:
        try:
            aic = AiconfiguratorSteps(args.aic_model, args.aic_system, args.aic_backend)
            notes.append(f"{aic.label}: step = non-attention context ops at T = chunk + B tokens "
                         f"({', '.join(aic.non_attention_names)}) + context_attention(chunk, prefix=history) "
                         "+ generation_attention(B, s=C)")
        except Exception as err:  # not installed here, or another API
            notes.append(f"aiconfigurator unavailable: {err!r}")
    perf_model = None
    try:
        from splitserve.perf.presets import preset

        perf_model = preset(args.preset_gpu, args.preset_model)
        notes.append(f"perf model: {perf_model.label}")
    except Exception as err:
        notes.append(f"perf model unavailable: {err!r}")

    rows = compare(grid, aic, perf_model)
    summary = {key: summarize(rows, key) for key in ("aic_over_measured", "perf_model_over_measured")}
    lines = table(rows)
    print(f"GPU check grid {grid['_path']}: {len(rows)} points (status {grid.get('status')})")
    for note in notes:
        print(f"  note: {note}")
    print("\n".join(lines))
    for key, s in summary.items():
        if s:
            print(f"{key}: median {s['median']:.2f}, geomean {s['geomean']:.2f}, range {s['min']:.2f}-{s['max']:.2f} "
                  f"over {s['points']} points")
    out = args.out or Path(grid["_path"]).with_name("grid_compare.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"input": grid["_path"], "notes": notes, "summary": summary, "rows": rows,
                               "code_path": grid.get("code_path"), "model": model}, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join([f"# GPU check grid vs estimates ({grid['_path']})", "",
                                                 *[f"* {n}" for n in notes], "", *lines, ""]))
    print(f"written: {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
