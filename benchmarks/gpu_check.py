"""The prepared GPU check (issue 34, item 6): the CUDA paths of the engine, run once on a GPU.

Run it through `scripts/gpu_check.sh` (which documents how); `--cpu-smoke` runs the same code
on the CPU with tiny shapes in well under a minute (tests/integration/test_gpu_check.py).

Sub-checks, each in its own Python process with its own time limit (a crash, an
out-of-memory or a hang in one is recorded and the rest still run), in this order:

* `env`: torch / CUDA / GPU, and which optional modules this machine has.
* `token_exact`: the engine (`workers.engine.LLM`) on the device against transformers'
  greedy `generate` on the same device, float32, token for token: small random Llama and
  Qwen2 models built offline (`splitserve.cli.demo_model`), prompts one by one, all together
  (batched) and all together under a 16-token budget (chunked prefill).
* `kv_digest`: `workers.kv_transfer.base.device_digest` of the same bytes on the device and
  on the CPU (one digest, exact integer ops: it must be equal), `KvMemory.checksum` of a
  CUDA KV cache against a CPU copy of it, a corrupted byte, a read/write round trip, and
  the sampler's counter noise (`sampler.counter_uniform`) on both devices.
* `grid`: mixed-step latencies of a Llama-3-8B-shaped model (random bf16 weights built on
  the device) on the engine's own model runner: one prefill chunk of `chunk_tokens` new
  tokens on `chunk_history` cached ones plus `decode_batch` decodes at context
  `decode_context`, each step `ModelRunner.execute(SchedulerOutput.of(entries))` (what
  `Engine.step` runs after `Scheduler.schedule`, and what `workers/profiling.py` times),
  CUDA-synchronised, warm-up first, median of repeats; written to `grid.json`, which
  `benchmarks/gpu_check_compare.py` compares with aiconfigurator and the perf model.
* `profile`: where one step's time goes on the 8B-shaped model, for a few grid points: the
  step split into its phases (`ModelRunner.prepare`, the model's forward, sampling), each
  timed between syncs, and `torch.profiler` over whole steps: the kernels' summed device time
  against the wall time (how busy the GPU is), the number of kernels launched, and the ops
  that cost the most host and device time; decode-only points also timed with decode graphs
  off. The first GPU run (2026-11-29) found a decode step of batch 1 at 36 ms, ten times the
  weights' read time: launch-bound, 1,565 kernels for 6.6 ms of device work.
* `captured_shapes`: LAPS captured shapes with the CUDA-graph executor against the plain
  engine (same tokens, tiny float32 model), then on the 8B-shaped model the time of a
  short-prefill step replayed as a CUDA graph, run as the eager bucket and run unpadded,
  and the time of a decode step as a decode graph (`EngineConfig.decode_graphs`) and eagerly.

Everything goes to JSON under --out ($OUT): `gpu_check.json` (all of it), one
`<sub-check>.json` each (written as it goes: a sub-check killed at its time limit keeps
what it measured) and `logs/<sub-check>.log`. Imports: the standard library here; torch,
transformers (and what they bring: safetensors, tokenizers, numpy) and the project's own
modules from the repository root in the sub-checks. A sub-check whose import of a
third-party module fails is skipped, naming the module.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBCHECKS = ("env", "token_exact", "kv_digest", "grid", "captured_shapes", "profile")
PROJECT_PACKAGES = {"workers", "splitserve", "services", "gateway", "loadgen", "benchmarks"}

# Hard limits per sub-check (s), and the whole run's; later sub-checks keep `RESERVE_S` each.
TIMEOUT_S = {
    "full": {"env": 60, "token_exact": 100, "kv_digest": 60, "grid": 240, "captured_shapes": 150, "profile": 120},
    "smoke": {"env": 20, "token_exact": 45, "kv_digest": 25, "grid": 30, "captured_shapes": 40, "profile": 30},
}
RESERVE_S = {
    "full": {"env": 10, "token_exact": 30, "kv_digest": 15, "grid": 60, "captured_shapes": 60, "profile": 60},
    "smoke": {"env": 5, "token_exact": 10, "kv_digest": 5, "grid": 10, "captured_shapes": 10, "profile": 10},
}
TOTAL_S = {"full": 560, "smoke": 90}

# The Llama-3-8B shape (config.json of meta-llama/Meta-Llama-3-8B) and the CPU smoke's tiny one.
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=8192, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, rope_theta=500000.0, max_position_embeddings=1024,
            rms_norm_eps=1e-5)
GRID = {
    "full": dict(chunks=(0, 128, 512, 2048), histories=(0, 2048), batches=(0, 1, 16, 64), contexts=(512, 4096),
                 repeats=7, warmup=1),
    "smoke": dict(chunks=(0, 8, 32), histories=(0, 32), batches=(0, 1, 4), contexts=(16, 64), repeats=2,
                  warmup=1),
}
GRID_CODE_PATH = ("ModelRunner.execute(SchedulerOutput.of(entries)): the model runner's step as Engine.step runs it "
                  "after Scheduler.schedule (prepare the flattened batch with decodes first, one forward over the "
                  "paged KV cache, sampling with its one host copy); the scheduler's own bookkeeping is not timed. "
                  "KV blocks reserved from the engine's BlockManager as workers/profiling.py does.")


# ---------------------------------------------------------------------------------------------
# child side: one sub-check in this process
# ---------------------------------------------------------------------------------------------
class Ctx:
    """What a sub-check gets: its mode, device, limits, and a result dict saved as it goes."""

    def __init__(self, name: str, mode: str, out: Path, budget_s: float):
        self.name, self.mode, self.out, self.budget_s = name, mode, out, budget_s
        self.started = time.monotonic()
        self.smoke = mode == "smoke"
        self.result: dict = {"name": name, "mode": mode, "status": "running"}
        self.path = out / f"{name}.json"
        self.work = Path(tempfile.mkdtemp(prefix=f"gpu_check_{name}_"))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def save(self) -> None:
        self.result["seconds"] = round(self.elapsed(), 3)
        write_json(self.path, self.result)

    @property
    def device(self) -> str:
        import torch

        if self.smoke:
            return "cpu"
        if not torch.cuda.is_available():
            raise Skip("CUDA is not available to torch here (run with --cpu-smoke for the CPU quick mode)")
        return "cuda"

    def sync(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


class Skip(Exception):
    """A sub-check that cannot run here; its message is the recorded reason."""


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_child(name: str, mode: str, out: Path, budget_s: float) -> int:
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    ctx = Ctx(name, mode, out, budget_s)
    try:
        ctx.save()
        if ctx.smoke:  # tiny shapes: one thread is as fast and steadier on a shared 2-core machine
            import torch

            torch.set_num_threads(1)
        CHECKS[name](ctx)
        ctx.result.setdefault("status", "ok")
        if ctx.result["status"] == "running":
            ctx.result["status"] = "ok"
    except Skip as why:
        ctx.result.update(status="skipped", reason=str(why))
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if top in PROJECT_PACKAGES or not top:
            ctx.result.update(status="error", error=repr(err), traceback=traceback.format_exc())
        else:
            ctx.result.update(status="skipped", reason=f"missing module {err.name!r} on this machine ({err})",
                              traceback=traceback.format_exc())
    except Exception as err:  # recorded; the parent goes on with the next sub-check
        ctx.result.update(status="error", error=repr(err), traceback=traceback.format_exc())
    finally:
        shutil.rmtree(ctx.work, ignore_errors=True)
    ctx.save()
    print(f"[{name}] {ctx.result['status']} in {ctx.elapsed():.1f} s")
    return 0


def _part(ctx: Ctx, key: str, fn) -> dict:
    """Run one part of a sub-check; its exception is recorded under `key` and the rest goes on."""
    try:
        ctx.result[key] = fn()
    except Exception as err:
        ctx.result[key] = {"status": "error", "error": repr(err), "traceback": traceback.format_exc()}
    ctx.save()
    return ctx.result[key]


# ---- env ---------------------------------------------------------------------------------------
def check_env(ctx: Ctx) -> None:
    import importlib.util

    r = ctx.result
    r["python"] = sys.version.split()[0]
    r["platform"] = platform.platform()
    r["cpus"] = os.cpu_count()
    r["modules"] = {m: importlib.util.find_spec(m) is not None for m in (
        "torch", "transformers", "safetensors", "tokenizers", "numpy", "grpc", "xxhash", "redis",
        "prometheus_client", "fastapi", "flash_attn", "nixl", "aiconfigurator_core")}
    import torch

    r["torch"] = torch.__version__
    r["torch_cuda"] = torch.version.cuda
    r["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        r["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count(),
                    "total_gib": round(total / 2**30, 2), "free_gib": round(free / 2**30, 2),
                    "multiprocessors": props.multi_processor_count}
        r["cudnn"] = torch.backends.cudnn.version()
    try:
        import transformers

        r["transformers"] = transformers.__version__
    except Exception as err:
        r["transformers"] = f"unavailable: {err!r}"
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            r["nvidia_smi"] = smi.stdout.strip()
        except Exception as err:
            r["nvidia_smi"] = repr(err)
    if ctx.mode == "full" and not r["cuda_available"]:
        r["status"] = "failed"
        r["reason"] = "torch sees no CUDA device: every GPU sub-check will be skipped"


# ---- token_exact -------------------------------------------------------------------------------
def _tiny_model(ctx: Ctx, arch: str) -> Path:
    from splitserve.cli.demo_model import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=384, max_position_embeddings=512, seed=1234, initializer_range=0.2)
    return build_demo_model(spec, ctx.work / arch)


def _prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 259) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check_token_exact(ctx: Ctx) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from workers.engine import LLM, SamplingParams

    device = ctx.device
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 as on the CPU: no TF32 rounding
        torch.backends.cudnn.allow_tf32 = False
    max_new = 12
    prompts = _prompts(8, 1, 60, seed=7)
    r = ctx.result
    r.update(device=device, dtype="float32", max_new_tokens=max_new, prompts=len(prompts),
             prompt_lengths=[len(p) for p in prompts], archs={})
    all_ok = True
    archs = ("llama", "qwen2")
    for arch in archs:
        if ctx.left() < 5:
            r["archs"][arch] = {"status": "skipped", "reason": "time limit"}
            continue
        model_dir = _tiny_model(ctx, arch)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
        expected = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p], device=device)
                gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                  pad_token_id=hf.config.pad_token_id)
                expected.append(gen[0, len(p):].tolist())
        del hf
        params = SamplingParams(max_tokens=max_new, temperature=0.0)
        kv = 32 << 20  # explicit: on CUDA the default sizes the KV cache to 90% of the GPU
        runs = {}
        single = LLM(str(model_dir), device=device, kv_cache_memory_bytes=kv)
        runs["one_by_one"] = [single.generate([p], params)[0].token_ids for p in prompts]
        engine_info = {"attention": "flash" if single.engine.runner.use_flash else "sdpa",
                       "engine_device": str(single.engine.runner.device), "engine_dtype": str(single.engine.runner.dtype)}
        batched = LLM(str(model_dir), device=device, kv_cache_memory_bytes=kv)
        runs["batched"] = [o.token_ids for o in batched.generate(prompts, params)]
        chunked = LLM(str(model_dir), device=device, kv_cache_memory_bytes=kv, max_num_batched_tokens=16, block_size=4)
        runs["batched_chunked_prefill_16"] = [o.token_ids for o in chunked.generate(prompts, params)]
        result = {"engine": engine_info, "runs": {}}
        for how, got in runs.items():
            bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
            result["runs"][how] = {"match": not bad, "mismatched_prompts": bad,
                                   "first_mismatch": ({"prompt": bad[0], "engine": got[bad[0]], "transformers": expected[bad[0]]}
                                                      if bad else None)}
            all_ok &= not bad
        result["status"] = "ok" if all(v["match"] for v in result["runs"].values()) else "failed"
        result["sample_tokens"] = expected[0]
        r["archs"][arch] = result
        del single, batched, chunked
        if device == "cuda":
            torch.cuda.empty_cache()
        ctx.save()
    ran = [a for a in archs if r["archs"][a].get("status") in ("ok", "failed")]
    r["passed"] = bool(ran) and all_ok and "llama" in ran
    r["status"] = "ok" if r["passed"] else "failed"


# ---- kv_digest ---------------------------------------------------------------------------------
def _import_kv_base(ctx: Ctx):
    """workers.kv_transfer.base; where xxhash is missing (its CPU digest), a stand-in lets the
    module import (device_digest does not use it) and the xxh3 comparison is left out."""
    try:
        import xxhash  # noqa: F401

        ctx.result["xxhash"] = "installed"
    except ModuleNotFoundError:
        import types

        class _Absent:
            def update(self, _data):
                raise RuntimeError("xxhash is not installed here (gpu_check's stand-in)")

            def intdigest(self) -> int:
                return 0

        stub = types.ModuleType("xxhash")
        stub.xxh3_64 = _Absent
        sys.modules["xxhash"] = stub
        ctx.result["xxhash"] = ("missing: a stand-in let workers.kv_transfer.base import (device_digest does not use "
                                "xxhash); the CPU xxh3 digest (kv_digest) is not computed")
    from workers.kv_transfer import base

    return base


def check_kv_digest(ctx: Ctx) -> None:
    import torch

    base = _import_kv_base(ctx)
    from workers.engine import sampler
    from workers.tensor_hash import hash32

    device = ctx.device
    r = ctx.result
    r["device"] = device
    if device == "cpu":
        r["note"] = "CPU smoke: the 'device' side is the CPU too, so equality is trivial here; on a GPU it is the check"
    gen = torch.Generator().manual_seed(34)
    words = base.DEVICE_DIGEST_CHUNK_WORDS

    def digest_equal():
        size = (words * 4 + 12) if not ctx.smoke else (1 << 20) + 12  # two chunks: a full one and 3 words
        chunk = words if not ctx.smoke else 1 << 16
        host = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        dev = host.to(device)
        t = time.perf_counter()
        on_device = base.device_digest(dev, chunk)
        ctx.sync()
        device_s = time.perf_counter() - t
        t = time.perf_counter()
        on_cpu = base.device_digest(host, chunk)
        cpu_s = time.perf_counter() - t
        # Chunking does not change the digest (sums of per-word terms): 4099-word chunks on the
        # device against the default on the CPU, over a 4 MiB prefix (many chunks, few launches).
        prefix = (4 << 20) + 12
        other_chunking = base.device_digest(dev[:prefix], 4099) == base.device_digest(host[:prefix])
        out = {"bytes": size, "chunk_words": chunk, "device_digest": f"{on_device:016x}", "cpu_digest": f"{on_cpu:016x}",
               "equal": on_device == on_cpu, "equal_with_other_chunking": other_chunking,
               "device_s": round(device_s, 4), "cpu_s": round(cpu_s, 4)}
        dev[size // 2] ^= 1
        out["corruption_detected"] = base.device_digest(dev, chunk) != on_device
        if r["xxhash"] == "installed":
            out["cpu_xxh3"] = f"{base.kv_digest([host.numpy()]):016x} (another digest: not compared)"
        out["status"] = "ok" if out["equal"] and out["equal_with_other_chunking"] and out["corruption_detected"] else "failed"
        return out

    def kv_memory():
        shape = (16, 4, 2, 16, 2, 64)  # [blocks, layers, k/v, block_size, kv_heads, head_dim]
        host = torch.randn(shape, generator=gen).to(torch.bfloat16)
        cache = host.to(device).contiguous()
        # A CPU cache would hash with xxh3 by default; the smoke run checks the device digest's code.
        on_device = True if device == "cpu" else None
        mem = base.KvMemory(cache, digest_on_device=on_device)
        ref = base.KvMemory(host.clone(), digest_on_device=True)
        blocks = [3, 1, 7, 8, 9, 15]
        out = {"digest_on_device": mem.digest_on_device, "blocks": blocks}
        out["whole_equal"] = mem.checksum(blocks) == ref.checksum(blocks)
        out["layers_equal"] = all(mem.checksum(blocks, layer=k) == ref.checksum(blocks, layer=k) for k in range(4))
        before = mem.checksum(blocks)
        cache[7, 2, 1, 5, 0, 3] += 1
        out["corruption_detected"] = mem.checksum(blocks) != before
        payload = mem.read(blocks)  # host bytes of device blocks (the gRPC transport's path)
        other = base.KvMemory(torch.zeros_like(cache), digest_on_device=on_device)
        other.write([0, 1, 2, 3, 4, 5], payload)
        out["round_trip_equal"] = other.checksum([0, 1, 2, 3, 4, 5]) == mem.checksum(blocks)
        if device == "cuda":
            out["note"] = "device cache: digest_on_device is chosen automatically (no host copy)"
            if not mem.digest_on_device:
                out["note"] = "a CUDA cache did not choose the device digest"
        ok = out["whole_equal"] and out["layers_equal"] and out["corruption_detected"] and out["round_trip_equal"]
        out["status"] = "ok" if ok and (device == "cpu" or mem.digest_on_device) else "failed"
        return out

    def noise_equal():
        keys = torch.tensor([sampler.mix_seed(s, i) for s in (0, 1, 2**40 + 7) for i in (0, 1, 999)], dtype=torch.int64)
        vocab = 128256 if not ctx.smoke else 512
        on_device = sampler.counter_uniform(keys.to(device), vocab).cpu()
        on_cpu = sampler.counter_uniform(keys, vocab)
        x = torch.randint(0, 2**32, (1 << 16,), dtype=torch.int64, generator=gen)
        hash_equal = torch.equal(hash32(x.to(device)).cpu(), hash32(x))
        equal = torch.equal(on_device, on_cpu)
        return {"counter_uniform_equal": equal, "hash32_equal": hash_equal, "rows": keys.numel(), "vocab": vocab,
                "status": "ok" if equal and hash_equal else "failed"}

    def throughput():
        if device != "cuda":
            return {"status": "skipped", "reason": "no CUDA device (CPU smoke)"}
        size = 1 << 30
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
        base.device_digest(data[: 1 << 20])
        ctx.sync()
        t = time.perf_counter()
        base.device_digest(data)
        ctx.sync()
        dev_s = time.perf_counter() - t
        t = time.perf_counter()
        host = data.cpu()
        copy_s = time.perf_counter() - t
        out = {"bytes": size, "device_digest_s": round(dev_s, 4), "device_digest_gb_s": round(size / dev_s / 1e9, 2),
               "host_copy_s": round(copy_s, 4)}
        if r["xxhash"] == "installed":
            t = time.perf_counter()
            base.kv_digest([host.numpy()])
            out["host_xxh3_s"] = round(time.perf_counter() - t, 4)
        out["status"] = "ok"
        return out

    parts = {"digest": digest_equal, "kv_memory": kv_memory, "sampler_noise": noise_equal, "throughput": throughput}
    for key, fn in parts.items():
        _part(ctx, key, fn)
    statuses = [ctx.result[k].get("status") for k in parts]
    r["status"] = "ok" if all(s in ("ok", "skipped") for s in statuses) else (
        "error" if "error" in statuses else "failed")


# ---- an engine over a shaped random model (grid, captured_shapes) -------------------------------
def _random_loader(spec, dtype, device, max_positions, use_flash):
    """Stands in for `loader.load_model`: the engine's own model class, built on the device
    with random N(0, 0.02) weights (norms 1, biases 0) instead of a checkpoint's."""
    import torch

    from workers.engine.models import MODEL_REGISTRY

    cls = MODEL_REGISTRY[spec.architecture]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(spec, max_positions, use_flash)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def shaped_engine(ctx: Ctx, kv_blocks: int, max_seqs: int, max_tokens: int, **options):
    """(engine, description): the real Engine over a Llama-3-8B-shaped random model (the tiny
    shape in the CPU smoke), built without a checkpoint: config.json plus a placeholder
    safetensors file for `load_model_spec`, weights made on the device (`_random_loader`)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    import workers.engine.model_runner as model_runner
    from workers.engine import Engine, EngineConfig
    from workers.engine.config import load_model_spec

    shape = TINY if ctx.smoke else LLAMA3_8B
    dtype = "float32" if ctx.smoke else "bfloat16"
    model_dir = ctx.work / "shaped-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, dtype=dtype,
                architectures=["LlamaForCausalLM"]).save_pretrained(str(model_dir))
    save_file({"placeholder": torch.zeros(1)}, str(model_dir / "placeholder.safetensors"))
    spec = load_model_spec(model_dir)
    block_size = 16
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    bytes_per_block = 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem
    config = EngineConfig(model=str(model_dir), dtype=dtype, device=ctx.device, block_size=block_size,
                          max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                          max_model_len=shape["max_position_embeddings"],
                          kv_cache_memory_bytes=kv_blocks * bytes_per_block, enable_prefix_caching=False,
                          detokenize=False, **options)
    original = model_runner.load_model
    model_runner.load_model = _random_loader
    t = time.perf_counter()
    try:
        engine = Engine(config, spec=spec)
    finally:
        model_runner.load_model = original
    ctx.sync()
    params = sum(p.numel() for p in engine.runner.model.parameters())
    info = {"shape": {k: shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")},
            "name": "tiny Llama (CPU smoke)" if ctx.smoke else "Llama-3-8B-shaped",
            "parameters": params, "dtype": dtype, "device": str(engine.runner.device),
            "weights": "random N(0, 0.02), built on the device (loader.load_model replaced for this engine only; "
                       "ModelRunner, attention, KV cache, sampler are the engine's own)",
            "attention": "flash" if engine.runner.use_flash else "sdpa",
            "decode_graph_batches": list(engine.runner.decode_batches),
            "decode_kernel": engine.runner.decode_kernel_name or "sdpa over gathered KV",
            "block_size": block_size, "kv_blocks": engine.runner.num_blocks, "kv_bytes_per_block": bytes_per_block,
            "build_s": round(time.perf_counter() - t, 2)}
    if engine.runner.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(engine.runner.device)
        info["gpu_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    return engine, info


def _token_ids(n: int, vocab: int, salt: int) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _sequence(name: str, index: int, tokens: list[int], prompt_len: int, seed: int = 0):
    from splitserve.core import SamplingParams, Sequence, StageKey

    return Sequence(StageKey(name, index), tokens, prompt_len, SamplingParams(max_tokens=2, temperature=0.0),
                    seed=seed, arrival_time=0.0)


def mixed_entries(engine, chunk: int, history: int, batch: int, context: int, salt: int = 0):
    """(entries, reserved blocks): one prefill chunk [history, history + chunk) and `batch`
    decodes each attending to `context` tokens (one token at position context - 1), as
    workers/profiling.py lays them out; blocks reserved from the engine's block manager."""
    from splitserve.core import ScheduledEntry, SequenceStatus

    vocab = engine.spec.vocab_size
    scheduler = engine.scheduler
    entries, taken = [], []
    try:
        if chunk:
            total = history + chunk
            seq = _sequence(f"grid/p{history}x{chunk}", 0, _token_ids(total, vocab, salt), total)
            seq.block_table = scheduler.reserve_kv(total)
            taken.extend(seq.block_table)
            seq.status = SequenceStatus.RUNNING
            entries.append(ScheduledEntry(seq, history, chunk))
        for i in range(batch):
            seq = _sequence(f"grid/d{batch}x{context}", i, _token_ids(context, vocab, salt * 1000 + i + 1), context - 1, i)
            seq.block_table = scheduler.reserve_kv(context)
            taken.extend(seq.block_table)
            seq.status = SequenceStatus.RUNNING
            entries.append(ScheduledEntry(seq, context - 1, 1))
    except Exception:
        scheduler.release_reserved(taken)
        raise
    return entries, taken


def timed_calls(ctx: Ctx, fn, repeats: int, warmup: int = 0) -> tuple[list[float], object]:
    """`fn()` `warmup` times, then `repeats` times each timed between device syncs: (the wall
    seconds of each timed call, the last call's value). For steps (milliseconds and up)."""
    value = None
    for _ in range(warmup):
        value = fn()
    runs = []
    for _ in range(repeats):
        ctx.sync()
        t = time.perf_counter()
        value = fn()
        ctx.sync()
        runs.append(time.perf_counter() - t)
    return runs, value


def mean_call_ms(ctx: Ctx, fn, iters: int) -> float:
    """Milliseconds per call of `fn` over `iters` back-to-back calls between two device syncs,
    after one warm call: for kernels too short to time one at a time (a sync costs more)."""
    fn()
    ctx.sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    ctx.sync()
    return round((time.perf_counter() - t) / iters * 1e3, 4)


def timed_execute(ctx: Ctx, runner, out, repeats: int, warmup: int) -> tuple[list[float], dict]:
    """`runner.execute(out)` `warmup` times, then `repeats` times timed between device syncs."""
    return timed_calls(ctx, lambda: runner.execute(out), repeats, warmup)


def grid_points(mode: str) -> list[tuple[int, int, int, int]]:
    """(chunk_tokens, chunk_history, decode_batch, decode_context): history 0 first (if the
    budget runs out, the points with history are the ones left)."""
    g = GRID[mode]
    points = []
    for history in g["histories"]:
        for chunk in g["chunks"]:
            if history and not chunk:
                continue
            for batch in g["batches"]:
                if not chunk and not batch:
                    continue
                for context in (g["contexts"] if batch else (0,)):
                    points.append((chunk, history if chunk else 0, batch, context))
    return points


def check_grid(ctx: Ctx) -> None:
    import torch

    from splitserve.core import SchedulerOutput

    g = GRID[ctx.mode]
    points = grid_points(ctx.mode)
    r = ctx.result
    r["device"] = ctx.device  # a full run without CUDA stops here (skipped, saying why)
    r.update(code_path=GRID_CODE_PATH, records=[], skipped_points=[], grid={k: list(v) if isinstance(v, tuple) else v
                                                                          for k, v in g.items()})
    bs = 16
    need = max((-(-(h + c) // bs) if c else 0) + b * -(-x // bs) for c, h, b, x in points) + 8
    max_batch = max(g["batches"])
    engine, info = shaped_engine(ctx, kv_blocks=need, max_seqs=max_batch + 1,
                                 max_tokens=max(g["chunks"]) + max_batch)
    r["model"] = info
    r["torch"] = torch.__version__
    ctx.save()
    runner = engine.runner
    soft_budget = ctx.budget_s - (20 if not ctx.smoke else 5)
    for n, (chunk, history, batch, context) in enumerate(points):
        point = {"chunk_tokens": chunk, "chunk_history": history, "decode_batch": batch, "decode_context": context}
        if ctx.elapsed() > soft_budget:
            r["skipped_points"].append({**point, "reason": "the sub-check's time budget ran out"})
            continue
        taken = []
        try:
            entries, taken = mixed_entries(engine, chunk, history, batch, context, salt=n)
            out = SchedulerOutput.of(entries)
            repeats = g["repeats"]
            runs, _ = timed_execute(ctx, runner, out, 1, g["warmup"] + (1 if n == 0 else 0))
            if runs[0] > 0.5:  # slow points: fewer repeats
                repeats = max(3, repeats // 2)
            more, _ = timed_execute(ctx, runner, out, repeats - 1, 0)
            runs += more
            r["records"].append({**point, "seconds_median": statistics.median(runs), "repeats": len(runs),
                                 "seconds_min": min(runs), "runs": [round(x, 6) for x in runs],
                                 "tokens": chunk + batch})
        except Exception as err:
            r["skipped_points"].append({**point, "reason": f"error: {err!r}"})
            if "out of memory" in str(err).lower() and runner.device.type == "cuda":
                torch.cuda.empty_cache()
        finally:
            if taken:
                engine.scheduler.release_reserved(taken)
        ctx.save()
    if runner.device.type == "cuda":
        r["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    errors = [p for p in r["skipped_points"] if p["reason"].startswith("error")]
    if not r["records"]:
        r["status"] = "error"
        r["reason"] = "no point measured"
    elif errors:
        r["status"] = "error"
        r["reason"] = f"{len(errors)} points failed (see skipped_points)"
    elif r["skipped_points"]:
        r["status"] = "partial"
        r["reason"] = f"{len(r['skipped_points'])} points left unmeasured by the time budget"
    else:
        r["status"] = "ok"


# ---- profile -----------------------------------------------------------------------------------
PROFILE_POINTS = {"full": [(0, 0, 1, 512), (0, 0, 64, 4096), (512, 0, 0, 0), (2048, 0, 64, 4096)],
                  "smoke": [(0, 0, 1, 16), (32, 0, 4, 64)]}


def check_profile(ctx: Ctx) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from splitserve.core import SchedulerOutput

    r = ctx.result
    points = PROFILE_POINTS[ctx.mode]
    bs = 16
    need = sum((-(-(h + c) // bs) if c else 0) + b * -(-x // bs) for c, h, b, x in points) + 8
    engine, info = shaped_engine(ctx, kv_blocks=need, max_seqs=max(p[2] for p in points) + 1,
                                 max_tokens=max(p[0] + p[2] for p in points), decode_graphs="on")
    r.update(device=ctx.device, model=info, torch=torch.__version__, points=[])
    runner = engine.runner
    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def timed(fn, repeats=5):
        runs, value = timed_calls(ctx, fn, repeats)
        return statistics.median(runs), value

    for n, (chunk, history, batch, context) in enumerate(points):
        point = {"chunk_tokens": chunk, "chunk_history": history, "decode_batch": batch, "decode_context": context}
        taken = []
        try:
            entries, taken = mixed_entries(engine, chunk, history, batch, context, salt=100 + n)
            out = SchedulerOutput.of(entries)
            with torch.inference_mode():
                for _ in range(2):
                    runner.execute(out)
                before = runner.num_padded_steps
                step_s, _ = timed(lambda: runner.execute(out))  # as the engine runs it (decode graphs on CUDA)
                bucketed = runner.num_padded_steps > before
                graphs = runner.buckets
                runner.buckets = None
                try:
                    runner.execute(out)
                    eager_s, _ = timed(lambda: runner.execute(out))
                finally:
                    runner.buckets = graphs
                prepare_s, prepared = timed(lambda: runner.prepare(out.entries))
                forward_s, logits = timed(lambda: runner.model(prepared.input_ids, prepared.positions,
                                                               runner.layer_caches, prepared.meta,
                                                               prepared.logits_indices))
                sampling = len(prepared.sampling_entries)
                seqs = [e.seq for e in prepared.sampling_entries]
                sample_s, _ = timed(lambda: runner._sample(logits[:sampling], seqs))
                steps = 3
                ctx.sync()
                t = time.perf_counter()
                with profile(activities=activities) as prof:
                    for _ in range(steps):
                        runner.execute(out)
                    ctx.sync()
                wall = (time.perf_counter() - t) / steps
            averages = prof.key_averages()

            def device_us(e):
                return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0

            # Kernels as the profiler attaches them to their launching ops; else its device-side events.
            events = prof.events()
            kernel_us_list = [k.duration for e in events for k in (getattr(e, "kernels", None) or [])]
            if not kernel_us_list:
                kernel_us_list = [e.time_range.elapsed_us() for e in events
                                  if str(getattr(e, "device_type", "")).endswith("CUDA")]
            kernels, kernel_us = kernel_us_list, sum(kernel_us_list)
            top_cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
            top_dev = sorted(averages, key=device_us, reverse=True)[:12] if cuda else []
            point.update(
                step_ms=round(step_s * 1e3, 3), step_eager_ms=round(eager_s * 1e3, 3),
                decode_graph=bucketed, prepare_ms=round(prepare_s * 1e3, 3),
                forward_ms=round(forward_s * 1e3, 3), sample_ms=round(sample_s * 1e3, 3),
                profiled_step_ms=round(wall * 1e3, 3),
                kernels_per_step=round(len(kernels) / steps, 1),
                kernel_ms_per_step=round(kernel_us / 1e3 / steps, 3),
                gpu_busy_fraction=round(kernel_us / 1e6 / steps / wall, 3) if cuda and wall > 0 else None,
                top_host_ops=[{"op": e.key, "calls_per_step": round(e.count / steps, 1),
                               "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3)} for e in top_cpu],
                top_device_ops=[{"op": e.key[:120], "calls_per_step": round(e.count / steps, 1),
                                 "device_ms_per_step": round(device_us(e) / 1e3 / steps, 3)} for e in top_dev],
            )
            if cuda:
                try:
                    point["sm_clock_mhz_after"] = torch.cuda.clock_rate()
                except Exception as err:  # pynvml absent or refused: recorded, not fatal
                    point["sm_clock_mhz_after"] = repr(err)
        except Exception as err:
            point.update(status="error", error=repr(err), traceback=traceback.format_exc())
        finally:
            if taken:
                engine.scheduler.release_reserved(taken)
        r["points"].append(point)
        ctx.save()
    del engine, runner
    _part(ctx, "decode_attention", lambda: _decode_attention(ctx))
    _part(ctx, "elementwise", lambda: _elementwise(ctx))
    failed = any(p.get("status") == "error" for p in r["points"]) or any(
        r[k].get("status") == "error" for k in ("decode_attention", "elementwise"))
    r["status"] = "error" if failed else "ok"


def _triton_module(ctx: Ctx, name: str):
    """`workers.engine.<name>` (a Triton module), or the skip record saying why it cannot run here."""
    import importlib

    try:
        module = importlib.import_module(f"workers.engine.{name}")
    except ImportError as err:
        return {"status": "skipped", "reason": f"triton not importable here ({err})"}
    if not ctx.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return {"status": "skipped", "reason": "Triton kernels run on CUDA (or under TRITON_INTERPRET=1)"}
    return module


def _elementwise(ctx: Ctx) -> dict:
    """The Triton RMSNorm (with residual) and rotary (workers/engine/triton_elementwise.py)
    against the model's torch path on the 8B shape's rows (bf16 on the GPU): elements that
    differ (bit for bit: the rounding is torch's, only the mean's summation order is not)
    and the time of each."""
    import torch

    from workers.engine.models.llama import RMSNorm, apply_rotary

    cuda = ctx.device.startswith("cuda")
    triton_elementwise = _triton_module(ctx, "triton_elementwise")
    if isinstance(triton_elementwise, dict):
        return triton_elementwise
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens, hidden, heads, kv_heads, dim = (512, 4096, 32, 8, 128) if not ctx.smoke else (8, 64, 4, 2, 16)
    iters = 50 if cuda else 2
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    out: dict = {"status": "ok", "dtype": str(dtype), "tokens": tokens, "hidden": hidden}

    with torch.inference_mode():
        norm = RMSNorm(hidden, 1e-5).to(device=ctx.device, dtype=dtype)
        norm.weight.copy_(torch.randn(hidden, device=ctx.device, generator=gen).to(dtype))
        x = torch.randn(tokens, hidden, device=ctx.device, generator=gen).to(dtype)
        residual = torch.randn(tokens, hidden, device=ctx.device, generator=gen).to(dtype)
        r_torch, r_triton = residual.clone(), residual.clone()
        a = norm(x, r_torch)
        b = triton_elementwise.rms_norm(x, norm.weight, 1e-5, r_triton)
        out["rms_norm"] = {"differing_elements": int((a != b).sum()), "residual_differing": int((r_torch != r_triton).sum()),
                           "max_abs_diff": float((a.float() - b.float()).abs().max()),
                           "torch_ms": mean_call_ms(ctx, lambda: norm(x, residual.clone()), iters),
                           "triton_ms": mean_call_ms(ctx, lambda: triton_elementwise.rms_norm(x, norm.weight, 1e-5, residual.clone()), iters)}
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=ctx.device, generator=gen).to(dtype)
        angles = torch.randn(tokens, dim // 2, device=ctx.device, generator=gen)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

        def views(t):
            q, k, _ = t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)

        q_ref, k_ref = apply_rotary(*views(qkv.clone()), (cos, sin))
        q, k = views(qkv.clone())
        triton_elementwise.rotary_inplace(q, k, cos, sin)
        out["rotary"] = {"differing_elements": int((q != q_ref).sum() + (k != k_ref).sum()),
                         "torch_ms": mean_call_ms(ctx, lambda: apply_rotary(*views(qkv), (cos, sin)), iters),
                         "triton_ms": mean_call_ms(ctx, lambda: triton_elementwise.rotary_inplace(*views(qkv.clone()), cos, sin), iters)}
    if out["rotary"]["differing_elements"] or out["rms_norm"]["residual_differing"]:
        out["status"] = "error"
        out["reason"] = "rotary or the residual sum not bit for bit torch's"
    return out


DECODE_ATTENTION_CASES = {"full": [(1, 512), (16, 4096), (64, 4096), (256, 1024)], "smoke": [(2, 40), (4, 64)]}


def _decode_attention(ctx: Ctx) -> dict:
    """One layer's decode attention, Llama-3-8B heads (32 query, 8 KV, dim 128; bf16 on the GPU):
    the Triton paged kernel (workers/engine/triton_attention.py) against SDPA over the gathered
    KV (`attention._sdpa_decode`, the path without it), same inputs: max difference and time."""
    import torch

    from workers.engine.attention import AttentionMetadata, _sdpa_decode

    cuda = ctx.device.startswith("cuda")
    triton_attention = _triton_module(ctx, "triton_attention")
    if isinstance(triton_attention, dict):
        return triton_attention
    paged_decode_attention = triton_attention.paged_decode_attention
    heads, kv_heads, dim = (32, 8, 128) if not ctx.smoke else (4, 2, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    bs, iters = 16, (50 if cuda else 2)
    cases = []
    for batch, context in DECODE_ATTENTION_CASES[ctx.mode]:
        case = {"batch": batch, "context": context}
        try:
            per_seq = -(-context // bs)
            blocks = batch * per_seq + 1
            gen = torch.Generator(device=ctx.device).manual_seed(batch + context)
            cache = torch.randn(blocks, 2, 2, bs, kv_heads, dim, device=ctx.device, dtype=dtype, generator=gen)
            k_cache, v_cache = cache[:, 1].unbind(1)  # a layer's strided views, as the engine passes them
            tables = torch.randperm(blocks - 1, device=ctx.device, generator=gen)[:batch * per_seq].view(batch, per_seq)
            lens = torch.full((batch,), context, dtype=torch.long, device=ctx.device)
            q = torch.randn(batch, heads, dim, device=ctx.device, dtype=dtype, generator=gen)
            meta = AttentionMetadata(slot_mapping=None, slot_blocks=None, slot_offsets=None, num_decode_tokens=batch,
                                     decode_block_tables=tables, decode_context_lens=lens, prefills=[], block_size=bs)
            scale = dim ** -0.5
            runs = {"triton": lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, 0),
                    "triton_sum": lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, 0, False),
                    "sdpa_gathered": lambda: _sdpa_decode(q, k_cache, v_cache, meta, None, scale)}
            outs = {}
            for name, fn in runs.items():
                outs[name] = fn()
                case[f"{name}_ms"] = mean_call_ms(ctx, fn, iters)
            case["max_abs_diff"] = float((outs["triton"].float() - outs["sdpa_gathered"].float()).abs().max())
            case["max_abs_diff_sum"] = float((outs["triton_sum"].float() - outs["sdpa_gathered"].float()).abs().max())
            case["kv_gib"] = round(2 * batch * context * kv_heads * dim * cache.element_size() / 2**30, 3)
            case["triton_gib_per_s"] = round(case["kv_gib"] / (case["triton_ms"] / 1e3), 1)
            case["speedup"] = round(case["sdpa_gathered_ms"] / case["triton_ms"], 2)
            del cache, k_cache, v_cache, outs
        except Exception as err:
            case.update(status="error", error=repr(err), traceback=traceback.format_exc())
        cases.append(case)
    limit = 2e-2 if cuda else 1e-5
    bad = [c for c in cases if c.get("status") == "error" or max(c.get("max_abs_diff", 0), c.get("max_abs_diff_sum", 0)) > limit]
    return {"status": "error" if bad else "ok", "dtype": str(dtype), "heads": [heads, kv_heads, dim], "cases": cases}


# ---- captured_shapes ---------------------------------------------------------------------------
def check_captured_shapes(ctx: Ctx) -> None:
    import torch

    device = ctx.device
    r = ctx.result
    r["device"] = device
    r["executor"] = "cuda_graph" if device == "cuda" else "eager"
    if device != "cuda":
        r["note"] = "no CUDA here (CPU smoke): the captured shapes run the eager executor; cuda_graph needs a GPU"
    _part(ctx, "tokens", lambda: _captured_tokens(ctx))
    if ctx.left() < 20 and not ctx.smoke:
        r["timing"] = {"status": "skipped", "reason": "time limit"}
    else:
        _part(ctx, "timing", lambda: _captured_timing(ctx))
    statuses = [r[k].get("status") for k in ("tokens", "timing")]
    r["status"] = "ok" if all(s in ("ok", "skipped") for s in statuses) else (
        "error" if "error" in statuses else "failed")
    if device == "cuda":
        torch.cuda.empty_cache()


def _captured_tokens(ctx: Ctx) -> dict:
    """The tiny float32 Llama generating with and without captured shapes: the same tokens."""
    import torch

    from workers.engine import LLM, SamplingParams

    device = ctx.device
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = _tiny_model(ctx, "llama")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (3, 9, 17, 30, 6, 12, 70, 5, 25)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    kv = 32 << 20
    plain = LLM(str(model_dir), device=device, kv_cache_memory_bytes=kv).generate(prompts, params)
    out = {"prompt_lengths": [len(p) for p in prompts], "variants": {}}
    ok = True
    variants = {"auto": {}, "eager": {"captured_shapes_executor": "eager"}}
    for name, options in variants.items():
        llm = LLM(str(model_dir), device=device, kv_cache_memory_bytes=kv, captured_shapes=True, max_num_seqs=4,
                  **options)
        got = llm.generate(prompts, params)
        runner = llm.engine.runner
        same = [o.token_ids for o in got] == [o.token_ids for o in plain]
        v = {"executor": runner.buckets.executor, "same_tokens": same, "padded_steps": runner.num_padded_steps,
             "captures": runner.buckets.captures, "hits": runner.buckets.hits, "misses": runner.buckets.misses}
        ok &= same and runner.num_padded_steps >= 1
        if runner.buckets.executor == "cuda_graph":
            ok &= runner.buckets.captures >= 1
        out["variants"][name] = v
    out["status"] = "ok" if ok else "failed"
    return out


def _captured_timing(ctx: Ctx) -> dict:
    """On the shaped model: short-prefill steps as a replayed CUDA graph, as the eager bucket and
    unpadded; a decode step with captured shapes on (never bucketed) and off."""
    from splitserve.core import SchedulerOutput
    from workers.engine.captured_shapes import BucketRunner, build_bucket_step

    tokens_grid, batch_grid = ("16,32,64,128", "1,2,4,8,16") if not ctx.smoke else ("8,16,32", "1,2,4")
    engine, info = shaped_engine(ctx, kv_blocks=640 if not ctx.smoke else 256, max_seqs=32, max_tokens=2048,
                                 captured_shapes=True, shape_tokens=tokens_grid, shape_batches=batch_grid,
                                 decode_graphs="on")
    runner = engine.runner
    graph_runner = runner.buckets
    eager_runner = BucketRunner(runner._bucket_forward, runner.block_size, runner.device, "eager")
    cases = ([(32, 8, 0), (128, 4, 0), (16, 16, 0), (32, 4, 480)] if not ctx.smoke else [(16, 4, 0), (8, 2, 40)])
    repeats = 10 if not ctx.smoke else 2
    out = {"model": info, "shape_tokens": tokens_grid, "shape_batches": batch_grid, "cases": [],
           "what": "one step of B short prefills (lengths in (L/2, L], on `history` cached tokens) timed through "
                   "ModelRunner.execute with runner.buckets set to the CUDA-graph runner, an eager BucketRunner, or "
                   "None (unpadded); warm-up (and capture) first, median of repeats"}
    all_ok = True
    rng = random.Random(5)
    for length, batch, history in cases:
        if ctx.left() < 15:
            out["cases"].append({"L": length, "B": batch, "history": history, "status": "skipped",
                                 "reason": "time limit"})
            continue
        case = {"L": length, "B": batch, "history": history}
        taken = []
        try:
            from splitserve.core import ScheduledEntry, SequenceStatus

            entries = []
            for i in range(batch):
                n = rng.randint(length // 2 + 1, length)
                total = history + n
                seq = _sequence(f"cap/{length}x{batch}", i, _token_ids(total, engine.spec.vocab_size, 77 + i), total, i)
                seq.block_table = engine.scheduler.reserve_kv(total)
                taken.extend(seq.block_table)
                seq.status = SequenceStatus.RUNNING
                entries.append(ScheduledEntry(seq, history, n))
            step = build_bucket_step(entries, runner.shapes, runner.block_size, runner.num_blocks,
                                     runner.max_blocks_per_seq)
            case["bucket"] = None if step is None else [step.key.tokens, step.key.batch, step.key.context_blocks]
            sched_out = SchedulerOutput.of(entries)
            tokens = {}
            variants = [("unpadded", None), ("bucket_eager", eager_runner)]
            if graph_runner.executor == "cuda_graph":
                variants.append(("bucket_cuda_graph", graph_runner))
            for name, bucket_runner in variants:
                runner.buckets = bucket_runner
                padded_before = runner.num_padded_steps
                ctx.sync()
                t = time.perf_counter()
                first = runner.execute(sched_out)  # warm-up; the capture for cuda_graph
                ctx.sync()
                case[f"{name}_first_s"] = round(time.perf_counter() - t, 6)
                runs, sampled = timed_execute(ctx, runner, sched_out, repeats, 0)
                case[f"{name}_s"] = statistics.median(runs)
                case[f"{name}_bucketed"] = runner.num_padded_steps > padded_before
                tokens[name] = [sampled[e.seq.key] for e in entries]
                case[f"{name}_stable"] = tokens[name] == [first[e.seq.key] for e in entries]
            runner.buckets = graph_runner
            case["same_tokens_as_unpadded"] = {k: v == tokens["unpadded"] for k, v in tokens.items() if k != "unpadded"}
            if "bucket_cuda_graph" in tokens:
                case["graph_vs_eager_bucket_same_tokens"] = tokens["bucket_cuda_graph"] == tokens["bucket_eager"]
                case["graph_speedup_vs_unpadded"] = round(case["unpadded_s"] / case["bucket_cuda_graph_s"], 3)
            bucketed = case.get("bucket_eager_bucketed") and case.get("bucket_cuda_graph_bucketed", True)
            case["status"] = "ok" if step is not None and bucketed else "failed"
        except Exception as err:
            case.update(status="error", error=repr(err), traceback=traceback.format_exc())
        finally:
            runner.buckets = graph_runner
            if taken:
                engine.scheduler.release_reserved(taken)
        all_ok &= case.get("status") in ("ok", "skipped")
        out["cases"].append(case)
        ctx.result["timing"] = out
        ctx.save()
    # A decode step as a decode graph (EngineConfig.decode_graphs: bucket (1, B)) and eagerly.
    batch, context = (16, 512) if not ctx.smoke else (4, 64)
    decode = {"decode_batch": batch, "decode_context": context}
    taken = []
    try:
        entries, taken = mixed_entries(engine, 0, 0, batch, context, salt=99)
        sched_out = SchedulerOutput.of(entries)
        tokens = {}
        for name, bucket_runner in (("decode_graph_on", graph_runner), ("decode_graph_off", None)):
            runner.buckets = bucket_runner
            before = runner.num_padded_steps
            runs, sampled = timed_execute(ctx, runner, sched_out, repeats, 1)
            decode[f"{name}_s"] = statistics.median(runs)
            decode[f"{name}_bucketed"] = runner.num_padded_steps > before
            tokens[name] = [sampled[e.seq.key] for e in entries]
        # Random bf16 weights: near-tied logits may round to another argmax when the row
        # count of a GEMM changes; token_exact checks exactness on float32 models.
        decode["same_tokens"] = tokens["decode_graph_on"] == tokens["decode_graph_off"]
        decode["speedup"] = round(decode["decode_graph_off_s"] / decode["decode_graph_on_s"], 3)
        decode["status"] = "ok"
    except Exception as err:
        decode.update(status="error", error=repr(err), traceback=traceback.format_exc())
        all_ok = False
    finally:
        runner.buckets = graph_runner
        if taken:
            engine.scheduler.release_reserved(taken)
    out["decode_step"] = decode
    out["graph_captures"] = graph_runner.captures
    out["status"] = "ok" if all_ok else "failed"
    return out


CHECKS = {"env": check_env, "token_exact": check_token_exact, "kv_digest": check_kv_digest, "grid": check_grid,
          "captured_shapes": check_captured_shapes, "profile": check_profile}


# ---------------------------------------------------------------------------------------------
# parent side: run each sub-check in its own process, time-boxed
# ---------------------------------------------------------------------------------------------
def run_all(mode: str, out: Path, only: list[str], total_s: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    started = time.monotonic()
    deadline = started + total_s
    summary = {"mode": mode, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "python": sys.executable, "repo": str(REPO), "total_budget_s": total_s, "subchecks": {}}
    names = [n for n in SUBCHECKS if n in only]
    for i, name in enumerate(names):
        later = sum(RESERVE_S[mode][n] for n in names[i + 1:])
        timeout = min(TIMEOUT_S[mode][name], deadline - time.monotonic() - later)
        path = out / f"{name}.json"
        path.unlink(missing_ok=True)
        if timeout < 5:
            result = {"name": name, "status": "skipped", "reason": "no time left in the run's total budget"}
        else:
            result = _launch(name, mode, out, timeout)
        summary["subchecks"][name] = result
        summary["elapsed_s"] = round(time.monotonic() - started, 1)
        write_json(out / "gpu_check.json", summary)
        print(_line(name, result), flush=True)
    failing = {n: r["status"] for n, r in summary["subchecks"].items() if r["status"] not in ("ok", "skipped", "partial")}
    summary["passed"] = not failing
    summary["elapsed_s"] = round(time.monotonic() - started, 1)
    write_json(out / "gpu_check.json", summary)
    print(f"gpu_check ({mode}): {'all sub-checks ok' if not failing else 'not ok: ' + json.dumps(failing)}"
          f" in {summary['elapsed_s']} s; JSON under {out}", flush=True)
    return 0 if not failing else 1


def _launch(name: str, mode: str, out: Path, timeout: float) -> dict:
    path = out / f"{name}.json"
    log = out / "logs" / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--mode", mode, "--out", str(out),
           "--budget", f"{timeout:.1f}"]
    t = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=str(REPO))
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            timed_out = True
    result = None
    if path.is_file():
        try:
            result = json.loads(path.read_text())
        except ValueError:
            result = None
    result = result or {"name": name}
    if timed_out:
        result["status"] = "timeout"
        result["reason"] = f"killed at its time limit of {timeout:.0f} s (what it had saved is kept)"
    elif result.get("status") in (None, "running"):
        result["status"] = "error"
        result["reason"] = f"the process ended (exit code {rc}) without a result"
    result["wall_s"] = round(time.monotonic() - t, 1)
    result["timeout_s"] = round(timeout, 1)
    if result["status"] not in ("ok", "skipped", "partial"):
        result["log_tail"] = log.read_text(errors="replace")[-3000:]
    write_json(path, result)
    return result


def _line(name: str, r: dict) -> str:
    status = r["status"]
    text = f"  {name:16s} {status:8s} {r.get('wall_s', 0):6.1f} s"
    if r.get("reason"):
        text += f"  ({r['reason']})"
    if r.get("error"):
        text += f"  {r['error'][:200]}"
    if status == "skipped":
        return text
    if name == "env" and "torch" in r:
        gpu = r.get("gpu", {}).get("name", "no GPU")
        text += f"  torch {r['torch']}, {gpu}, flash_attn={r['modules'].get('flash_attn')}"
    elif name == "token_exact" and "archs" in r:
        parts = []
        for arch, a in r["archs"].items():
            runs = a.get("runs", {})
            parts.append(f"{arch}: " + ", ".join(f"{k}={'match' if v['match'] else 'MISMATCH'}" for k, v in runs.items())
                         if runs else f"{arch}: {a.get('status')}")
        text += "  " + "; ".join(parts)
    elif name == "kv_digest":
        d = r.get("digest", {})
        text += f"  device==cpu digest: {d.get('equal')}, kv_memory: {r.get('kv_memory', {}).get('status')}, " \
                f"noise equal: {r.get('sampler_noise', {}).get('counter_uniform_equal')}"
    elif name == "grid" and "records" in r:
        recs = r["records"]
        text += f"  {len(recs)} points measured, {len(r.get('skipped_points', []))} not"
        for rec in recs[:3] + recs[-2:] if len(recs) > 5 else recs:
            text += (f"\n      chunk {rec['chunk_tokens']:5d} hist {rec['chunk_history']:5d} B {rec['decode_batch']:3d} "
                     f"C {rec['decode_context']:5d}: {rec['seconds_median'] * 1e3:9.3f} ms")
    elif name == "captured_shapes" and "tokens" in r:
        t = r["tokens"]
        text += "  tokens: " + ", ".join(f"{k}={v.get('same_tokens')}" for k, v in t.get("variants", {}).items())
        for case in r.get("timing", {}).get("cases", []):
            if "unpadded_s" in case:
                text += (f"\n      L{case['L']} B{case['B']} h{case['history']}: unpadded {case['unpadded_s'] * 1e3:.3f} ms,"
                         f" eager bucket {case['bucket_eager_s'] * 1e3:.3f} ms")
                if "bucket_cuda_graph_s" in case:
                    text += f", graph {case['bucket_cuda_graph_s'] * 1e3:.3f} ms"
        d = r.get("timing", {}).get("decode_step", {})
        if "decode_graph_on_s" in d:
            text += (f"\n      decode B{d['decode_batch']} C{d['decode_context']}: {d['decode_graph_on_s'] * 1e3:.3f} ms "
                     f"(decode graph), {d['decode_graph_off_s'] * 1e3:.3f} ms (eager); same tokens {d['same_tokens']}")
    elif name == "profile" and "points" in r:
        for pt in r["points"]:
            if "step_ms" not in pt:
                continue
            text += (f"\n      chunk {pt['chunk_tokens']:5d} B {pt['decode_batch']:3d} C {pt['decode_context']:5d}: "
                     f"step {pt['step_ms']:.2f} ms (decode graph: {pt['decode_graph']}); eager {pt['step_eager_ms']:.2f} ms "
                     f"= prepare {pt['prepare_ms']:.2f} + forward {pt['forward_ms']:.2f} "
                     f"+ sample {pt['sample_ms']:.2f}; {pt['kernels_per_step']:.0f} kernels, "
                     f"{pt['kernel_ms_per_step']:.2f} ms on the device (busy {pt['gpu_busy_fraction']})")
        for case in r.get("decode_attention", {}).get("cases", []):
            if "triton_ms" in case:
                text += (f"\n      decode attention B {case['batch']:3d} C {case['context']:5d}: triton {case['triton_ms']:.3f} ms, "
                         f"(sums: {case['triton_sum_ms']:.3f} ms), "
                         f"sdpa over gathered KV {case['sdpa_gathered_ms']:.3f} ms (x{case['speedup']}), "
                         f"max diff {case['max_abs_diff']:.2e}")
        e = r.get("elementwise", {})
        if "rms_norm" in e:
            text += (f"\n      rms_norm {e['rms_norm']['torch_ms']:.3f} -> {e['rms_norm']['triton_ms']:.3f} ms "
                     f"({e['rms_norm']['differing_elements']} elements differ, max {e['rms_norm']['max_abs_diff']:.2e}); "
                     f"rotary {e['rotary']['torch_ms']:.3f} -> {e['rotary']['triton_ms']:.3f} ms "
                     f"({e['rotary']['differing_elements']} differ)")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"))
    ap.add_argument("--cpu-smoke", action="store_true", default=os.environ.get("GPU_CHECK_CPU_SMOKE") == "1",
                    help="tiny shapes on the CPU (or set GPU_CHECK_CPU_SMOKE=1)")
    ap.add_argument("--only", default=",".join(SUBCHECKS), help="comma-separated sub-checks to run")
    ap.add_argument("--total-s", type=float, default=None, help="the whole run's time limit (s)")
    ap.add_argument("--child", choices=SUBCHECKS, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("full", "smoke"), help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = args.out.resolve()
    if args.child:
        return run_child(args.child, args.mode, out, args.budget)
    mode = "smoke" if args.cpu_smoke else "full"
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SUBCHECKS))
    if unknown:
        ap.error(f"unknown sub-checks {unknown}; known: {', '.join(SUBCHECKS)}")
    return run_all(mode, out, only, args.total_s or TOTAL_S[mode])


if __name__ == "__main__":
    sys.exit(main())
