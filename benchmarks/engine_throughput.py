"""Engine throughput vs Hugging Face `generate`, side by side in one run.

Workload: N requests whose prompt/output lengths come from the Azure 2023 conversation
trace scaled by --length-scale, all arriving at once. Reports (a) this engine's and
(b) HF static-batch (left-padded) throughput, batch-1 decode time per token for both,
and decode bandwidth against a measured weights-sized GEMV on the same machine.

    .venv/bin/python benchmarks/engine_throughput.py --out bench-results/engine_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from common import REPO  # noqa: E402

from loadgen.traces import read_trace, scale_lengths  # noqa: E402
from splitserve.cli.demo_model import bench_model_spec, build_demo_model  # noqa: E402
from workers.engine import Engine, EngineConfig, SamplingParams, StageSpec  # noqa: E402

console = Console()


def workload(trace: Path, n: int, scale: float, vocab: int, seed: int):
    reqs = scale_lengths(read_trace(trace)[:n], scale, min_prompt=4, min_output=2)
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, r.prompt_len).tolist(), r.output_len) for r in reqs]


def run_engine(model_dir: Path, dtype: str, requests, threads: int) -> dict:
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, num_threads=threads,
                                 max_num_seqs=len(requests), max_num_batched_tokens=2048))
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_stage(StageSpec.whole("warmup", requests[0][0], warm))
    while engine.has_unfinished():
        engine.step()
    started = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_stage(StageSpec.whole(f"r{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0.0,
                                                                               ignore_eos=True)))
    produced = steps = 0
    while engine.has_unfinished():
        produced += len(engine.step())
        steps += 1
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "output_tokens": produced, "steps": steps,
            "output_tokens_per_s": produced / elapsed,
            "total_tokens_per_s": (produced + sum(len(p) for p, _ in requests)) / elapsed}


def run_hf(model_dir: Path, dtype: str, requests, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    pad = model.config.pad_token_id
    useful = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch):
            group = requests[b : b + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
            new = max(o for _, o in group)  # a static batch runs until its longest request is done
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
            useful += sum(o for _, o in group)
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "output_tokens": useful, "output_tokens_per_s": useful / elapsed,
            "total_tokens_per_s": (useful + sum(len(p) for p, _ in requests)) / elapsed}


def engine_decode_ms(model_dir: Path, dtype: str, threads: int, prompt_len: int, tokens: int) -> float:
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, num_threads=threads, max_num_seqs=1))
    engine.add_stage(StageSpec.whole("d", list(range(1, prompt_len + 1)),
                                     SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def hf_decode_ms(model_dir: Path, dtype: str, prompt_len: int, tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    ids = torch.arange(1, prompt_len + 1)[None]
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=model.config.pad_token_id)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        one = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        many = time.perf_counter() - t
    return (many - one) / (tokens - 1) * 1e3


def memory_bandwidth_gbs(weight_bytes: int, dtype: torch.dtype, hidden: int, repeats: int = 20) -> dict:
    """Measured ceilings: a GEMV over a weights-sized matrix, and a weights-sized copy (read + write)."""
    elem = torch.empty((), dtype=dtype).element_size()
    rows = weight_bytes // (elem * hidden)
    w = torch.randn(rows, hidden, dtype=dtype)
    x = torch.randn(1, hidden, dtype=dtype)
    dst = torch.empty_like(w)

    def best_seconds(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    nbytes = rows * hidden * elem
    gemv = nbytes / best_seconds(lambda: torch.nn.functional.linear(x, w)) / 1e9
    copy = 2 * nbytes / best_seconds(lambda: dst.copy_(w)) / 1e9
    return {"gemv_gbs": gemv, "copy_gbs": copy, "limit_gbs": max(gemv, copy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "bench-llama")
    ap.add_argument("--trace", type=Path, default=REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--length-scale", type=float, default=0.125)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="median over repeats of the throughput runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "engine_throughput.json")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    spec = bench_model_spec()
    model_dir = build_demo_model(spec, args.model_dir)
    requests = workload(args.trace, args.num_requests, args.length_scale, spec.vocab_size, seed=0)
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "torch": torch.__version__, "threads": args.threads},
               "workload": {"trace": args.trace.name, "num_requests": len(requests), "length_scale": args.length_scale,
                            "mean_prompt": statistics.mean(len(p) for p, _ in requests),
                            "mean_output": statistics.mean(o for _, o in requests),
                            "max_prompt": max(len(p) for p, _ in requests), "max_output": max(o for _, o in requests)},
               "runs": {}}
    for dtype in args.dtypes.split(","):
        eng = [run_engine(model_dir, dtype, requests, args.threads) for _ in range(args.repeats)]
        hf = [run_hf(model_dir, dtype, requests, args.hf_batch) for _ in range(args.repeats)]
        e_tps = statistics.median(r["output_tokens_per_s"] for r in eng)
        h_tps = statistics.median(r["output_tokens_per_s"] for r in hf)
        e_ms = engine_decode_ms(model_dir, dtype, args.threads, args.decode_prompt, args.decode_tokens)
        h_ms = hf_decode_ms(model_dir, dtype, args.decode_prompt, args.decode_tokens)
        tdtype = getattr(torch, dtype)
        weight_bytes = _weight_bytes(model_dir, tdtype)
        ceilings = memory_bandwidth_gbs(weight_bytes, tdtype, spec.hidden_size)
        achieved = weight_bytes / (e_ms / 1e3) / 1e9
        results["runs"][dtype] = {
            "engine": eng, "hf": hf, "engine_output_tokens_per_s": e_tps, "hf_output_tokens_per_s": h_tps,
            "throughput_ratio": e_tps / h_tps, "engine_decode_ms_per_token": e_ms, "hf_decode_ms_per_token": h_ms,
            "weight_bytes": weight_bytes, **ceilings, "engine_decode_bandwidth_gbs": achieved,
            "hf_decode_bandwidth_gbs": weight_bytes / (h_ms / 1e3) / 1e9,
            "decode_bandwidth_fraction": achieved / ceilings["limit_gbs"],
        }
    _report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {args.out}")


def _weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    from safetensors import safe_open

    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                total += int(np.prod(st.get_slice(name).get_shape()))
    return total * elem


def _report(results: dict) -> None:
    w = results["workload"]
    console.print(f"workload: {w['num_requests']} requests from {w['trace']} × {w['length_scale']} "
                  f"(mean prompt {w['mean_prompt']:.0f}, mean output {w['mean_output']:.0f})")
    table = Table("dtype", "engine tok/s", "HF tok/s", "ratio", "engine decode ms/tok", "HF decode ms/tok",
                  "decode GB/s", "GEMV GB/s", "copy GB/s", "of limit")
    for dtype, r in results["runs"].items():
        table.add_row(dtype, f"{r['engine_output_tokens_per_s']:.1f}", f"{r['hf_output_tokens_per_s']:.1f}",
                      f"{r['throughput_ratio']:.2f}x", f"{r['engine_decode_ms_per_token']:.2f}",
                      f"{r['hf_decode_ms_per_token']:.2f}", f"{r['engine_decode_bandwidth_gbs']:.2f}",
                      f"{r['gemv_gbs']:.2f}", f"{r['copy_gbs']:.2f}", f"{r['decode_bandwidth_fraction']:.0%}")
    console.print(table)


if __name__ == "__main__":
    main()
