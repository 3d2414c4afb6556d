"""Floor of a per-layer KV push inside a stage's last step (issue 12), measured before building it.

The chunked push (DynaServe §4.3) leaves exposed the chunk the stage's last step computes
(`benchmarks/kv_overlap.py`: 160 tokens, 2.5 MiB of the bench Llama's float32 KV) plus one
post. Pushing that chunk per layer, as each decoder layer writes its KV, could hide all but
the last layer's slice. This script measures, in one process pair, what that would cost and
save on this machine:

(a) the last step's forward (a 4000-token prompt in steps of 256 on the bench Llama, the
    last step 160 tokens at context 3840, engine on one torch thread as a worker on two
    cores runs it) and each decoder layer's share of it;
(b) raw NIXL WRITEs (UCX, to a child process, on a NIXL thread as the worker's transport
    posts them: sender digest, post with notification, spin until DONE) of: one block's
    slice of one layer (≈ a post's fixed cost), one layer's slice of the last chunk, the
    whole last chunk, and the whole request's KV at once (the "one transfer" baseline);
(c) the forward alone vs the forward with (i) a back-to-back copy loop of whole chunks on
    the NIXL thread, (ii) the per-layer push itself (a hook after every layer posts that
    layer's slice to the NIXL thread without waiting); and, per variant, the time from the
    forward's end to the last byte of the last chunk in place (the sender's exposed floor:
    whole chunk posted after the forward, or per layer).

Variants run interleaved round by round; medians over the rounds. The prediction: hidden
fraction = 1 - exposed / one-transfer exposed, with the floors of (c), and again with the
transport's measured overheads (kv_overlap's chunked exposed minus this floor) added back.

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/kv_layer_push_floor.py \\
        --out bench-results/kv_layer_push_floor.json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from common import REPO  # noqa: E402

import numpy as np  # noqa: E402

MIB = 1 << 20


# ---- the child: a NIXL agent that receives WRITEs and polls notifications ----------------------
def run_peer(num_blocks: int, block_bytes: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from workers.engine.host_memory import zeros_on_huge_pages

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NIXL logs to stdout
    cache = zeros_on_huge_pages((num_blocks * block_bytes,), torch.uint8)
    agent = nixl_agent("beta", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory(cache)
    out.write(json.dumps({"metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
                          "base": cache.data_ptr()}) + "\n")
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    notifs = 0
    while not stop.is_set():  # as a receiver's poller while a push is announced: every 1 ms
        notifs += sum(len(v) for v in agent.get_new_notifs().values())
        time.sleep(0.001)
    out.write(json.dumps({"notifs": notifs}) + "\n")


# ---- the sender ------------------------------------------------------------------------------------
class Sender:
    """A NIXL agent over the engine's KV cache, every call on one thread (as NixlTransport)."""

    def __init__(self, kv_cache, num_layers: int, peer: dict[str, Any], peer_blocks: int):
        from nixl._api import nixl_agent, nixl_agent_config

        from workers.kv_transfer.base import KvMemory
        from workers.kv_transfer.nixl_thread import NixlThread
        from workers.kv_transfer.poll_schedule import PollSchedule

        self.memory = KvMemory(kv_cache)
        self.num_layers = num_layers
        self.block_bytes = self.memory.block_bytes
        self.layer_bytes = self.block_bytes // num_layers
        self.thread = NixlThread("nixl-floor", lambda: False, PollSchedule())
        self.peer = peer
        self.peer_blocks = peer_blocks
        self.thread.submit(self._setup).result()

    def _rows(self, base: int, num_blocks: int, per_layer: bool) -> np.ndarray:
        if per_layer:  # row block * layers + layer: one layer's slice of one block
            n, size = num_blocks * self.num_layers, self.layer_bytes
        else:
            n, size = num_blocks, self.block_bytes
        rows = np.empty((n, 3), dtype=np.uint64)
        rows[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(size)
        rows[:, 1] = size
        rows[:, 2] = 0
        return rows

    def _setup(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        import logging

        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.agent = nixl_agent("alpha", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory(self.memory.tensor)
        name = self.agent.add_remote_agent(base64.b64decode(self.peer["metadata"]))
        base = self.memory.base_ptr
        self.local = {pl: self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._rows(base, self.memory.num_blocks, pl),
                                                     "DRAM") for pl in (False, True)}
        self.remote = {pl: self.agent.prep_xfer_dlist(name, self._rows(self.peer["base"], self.peer_blocks, pl), "DRAM")
                       for pl in (False, True)}
        self.remote_name = name

    def digest(self, src: list[int], layer: int | None) -> int:
        from workers.kv_transfer.base import kv_digest

        host = self.memory._host
        if layer is None:
            return self.memory.checksum(src)
        lo, hi = layer * self.layer_bytes, (layer + 1) * self.layer_bytes
        return kv_digest(host[b, lo:hi] for b in src)

    def write(self, src: list[int], dst: list[int], layer: int | None) -> None:
        """On the thread: digest, post with a notification, spin (then nap) until DONE — the transport's loop."""
        digest = self.digest(src, layer)
        notif = json.dumps({"checksum": digest, "layer": layer, "dst": dst}).encode()
        if layer is None:
            local, remote, per_layer = src, dst, False
        else:
            local = [b * self.num_layers + layer for b in src]
            remote = [b * self.num_layers + layer for b in dst]
            per_layer = True
        handle = self.agent.make_prepped_xfer("WRITE", self.local[per_layer], local, self.remote[per_layer], remote,
                                              notif)
        state = self.agent.transfer(handle)
        # as NixlTransport: a layer slice other than the last naps from the start (nobody waits for it)
        spin = layer is None or layer == self.num_layers - 1
        spin_until, pause = time.monotonic() + (0.002 if spin else 0.0), 0.0
        while state == "PROC":
            if time.monotonic() >= spin_until:
                pause = min(0.001, pause * 2 or 0.00005)
            time.sleep(pause)
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"transfer state {state}")
        handle.release()

    def timed_write(self, src: list[int], dst: list[int], layer: int | None = None) -> float:
        """Submit from this thread, wait for it: the hop to the NIXL thread included."""
        t0 = time.perf_counter()
        self.thread.submit(self.write, src, dst, layer).result()
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.thread.stop()


# ---- the engine, captured at its last step ----------------------------------------------------------
def last_step(model_dir: Path, prompt_len: int, step_tokens: int, threads: int):
    import torch

    from splitserve.core import SamplingParams, StageKey, StageSpec
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(model_dir), max_num_batched_tokens=step_tokens,
                                 kv_cache_memory_bytes=512 << 20, num_threads=threads, detokenize=False))
    torch.set_num_threads(threads)
    key = StageKey("floor", 0)
    prompt = [(i * 7919 + 104729) % 250 + 1 for i in range(prompt_len)]
    engine.add_stage(StageSpec(key, tuple(prompt), SamplingParams(max_tokens=1, temperature=0.0)))
    runner = engine.runner
    captured: list[Any] = []
    prepare = runner.prepare
    tables: list[list[int]] = []

    def capture(entries):
        tables.append(list(entries[0].seq.block_table))
        captured.append(prepare(entries))
        return captured[-1]
    runner.prepare = capture
    while engine.has_unfinished():
        engine.step()
    table = tables[-1]
    runner.prepare = prepare
    batch = captured[-1]
    last_tokens = len(batch.input_ids)
    model = runner.model
    stamps: list[float] = []
    hooks: list[Callable[[int], None]] = []
    for index, layer in enumerate(model.model.layers):
        def after(module, args, output, index=index):
            stamps.append(time.perf_counter())
            for hook in hooks:
                hook(index)
        layer.register_forward_hook(after)

    def forward() -> tuple[float, list[float], float]:
        """Run the last step's forward again (it rewrites the same KV); (start, layer ends, end)."""
        stamps.clear()
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(batch.input_ids, batch.positions, runner.layer_caches, batch.meta, batch.logits_indices)
            t1 = time.perf_counter()
        return t0, list(stamps), t1

    return engine, table, last_tokens, forward, hooks


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker on 2 cores uses 1)")
    ap.add_argument("--rounds", type=int, default=15, help="forward passes per variant in (c)")
    ap.add_argument("--repeats", type=int, default=50, help="NIXL writes per size in (b)")
    ap.add_argument("--kv-overlap", type=Path, default=None,
                    help="a kv_overlap.py JSON of the same session: its NIXL exposed figures calibrate the prediction")
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "bench-llama")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "kv_layer_push_floor.json")
    ap.add_argument("--peer", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        run_peer(*args.peer)
        return

    from rich.console import Console
    from rich.table import Table

    from splitserve.cli.demo_model import bench_model_spec, build_demo_model

    console = Console()
    model_dir = build_demo_model(bench_model_spec(), args.model_dir)
    engine, table, last_tokens, forward, hooks = last_step(model_dir, args.prompt_len, args.step_tokens, args.threads)
    spec = engine.spec
    bs = engine.config.block_size
    first_block = (args.prompt_len - last_tokens) // bs
    chunk_src = table[first_block: -(-args.prompt_len // bs)]
    all_src = table[: -(-args.prompt_len // bs)]
    kv_cache = engine.runner.kv_cache
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    peer_blocks = len(all_src) + 8
    child = subprocess.Popen([sys.executable, __file__, "--peer", str(peer_blocks), str(block_bytes)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    peer = json.loads(child.stdout.readline())
    sender = Sender(kv_cache, spec.num_layers, peer, peer_blocks)
    L = spec.num_layers
    chunk_dst = list(range(len(chunk_src)))
    all_dst = list(range(len(all_src)))
    try:
        # (a) the last step's forward, alone
        for _ in range(3):
            forward()  # warm-up
        # (b) NIXL writes, engine idle
        for _ in range(5):
            sender.timed_write(chunk_src, chunk_dst)
            sender.timed_write(all_src, all_dst)
        b: dict[str, list[float]] = {"one block, one layer": [], "one layer of the chunk": [],
                                     "all layers of the chunk, one post each": [], "whole chunk": [],
                                     "whole request (one transfer)": []}
        for _ in range(args.repeats):
            b["one block, one layer"].append(sender.timed_write(chunk_src[:1], chunk_dst[:1], L - 1))
            b["one layer of the chunk"].append(sender.timed_write(chunk_src, chunk_dst, L - 1))
            t0 = time.perf_counter()
            futures = [sender.thread.submit(sender.write, chunk_src, chunk_dst, layer) for layer in range(L)]
            for f in futures:
                f.result()
            b["all layers of the chunk, one post each"].append(time.perf_counter() - t0)
            b["whole chunk"].append(sender.timed_write(chunk_src, chunk_dst))
        for _ in range(max(5, args.repeats // 5)):
            b["whole request (one transfer)"].append(sender.timed_write(all_src, all_dst))
        digest_s = {"layer": [], "chunk": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sender.digest(chunk_src, L - 1)
            digest_s["layer"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sender.digest(chunk_src, None)
            digest_s["chunk"].append(time.perf_counter() - t0)

        # (c) forward alone / with a copy loop / with the per-layer push; exposed floors
        variants = ["alone", "copy loop beside it", "per-layer push"]
        fwd: dict[str, list[float]] = {v: [] for v in variants}
        layer_s: list[list[float]] = []
        tail_s: list[float] = []
        exposed: dict[str, list[float]] = {"whole chunk after the forward": [], "per layer": []}
        loop_copies: list[int] = []
        for _ in range(args.rounds):
            for variant in variants:
                if variant == "alone":
                    t0, stamps, t1 = forward()
                    fwd[variant].append(t1 - t0)
                    layer_s.append([stamps[0] - t0] + [b_ - a for a, b_ in zip(stamps, stamps[1:])])
                    tail_s.append(t1 - stamps[-1])
                    # the current path: the whole last chunk posted once the step is done
                    done = sender.thread.submit(sender.write, chunk_src, chunk_dst, None)
                    done.result()
                    exposed["whole chunk after the forward"].append(time.perf_counter() - t1)
                elif variant == "copy loop beside it":
                    stop = threading.Event()
                    copies = [0]

                    def loop() -> None:
                        while not stop.is_set():
                            sender.write(chunk_src, chunk_dst, None)
                            copies[0] += 1
                    running = sender.thread.submit(loop)
                    time.sleep(0.002)
                    t0, _, t1 = forward()
                    stop.set()
                    running.result()
                    fwd[variant].append(t1 - t0)
                    loop_copies.append(copies[0])
                else:
                    pending: list[Any] = []
                    hooks.append(lambda layer: pending.append(
                        sender.thread.submit(sender.write, chunk_src, chunk_dst, layer)))
                    t0, _, t1 = forward()
                    hooks.clear()
                    for f in pending:
                        f.result()
                    fwd[variant].append(t1 - t0)
                    exposed["per layer"].append(max(0.0, time.perf_counter() - t1))
    finally:
        sender.stop()
        child.stdin.write("stop\n")
        child.stdin.flush()
        child.wait(30)

    step_ms = med(fwd["alone"]) * 1e3
    per_layer_ms = [med([r[i] for r in layer_s]) * 1e3 for i in range(L)]
    single_ms = med(b["whole request (one transfer)"]) * 1e3
    floor_now = med(exposed["whole chunk after the forward"]) * 1e3
    floor_layer = med(exposed["per layer"]) * 1e3
    result: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "command": " ".join(sys.argv), "prompt_len": args.prompt_len, "step_tokens": args.step_tokens,
        "threads": args.threads, "last_step_tokens": last_tokens, "chunk_blocks": len(chunk_src),
        "chunk_mib": len(chunk_src) * block_bytes / MIB, "layer_slice_kib": len(chunk_src) * block_bytes / L / 1024,
        "a_last_step_forward_ms": step_ms, "a_per_layer_ms": per_layer_ms,
        "a_after_last_layer_ms": med(tail_s) * 1e3,
        "b_write_ms": {k: med(v) * 1e3 for k, v in b.items()},
        "b_digest_ms": {k: med(v) * 1e3 for k, v in digest_s.items()},
        "c_forward_ms": {k: med(v) * 1e3 for k, v in fwd.items()},
        # per round, against the "alone" forward of the same round: the machine's drift cancels
        "c_forward_ratio_vs_alone": {k: med([x / y for x, y in zip(v, fwd["alone"])]) for k, v in fwd.items()
                                     if k != "alone"},
        "c_copy_loop_chunks_per_forward": med(loop_copies),
        "c_exposed_floor_ms": {"whole chunk after the forward": floor_now, "per layer": floor_layer},
        "predicted_hidden_floor": {"whole chunk": 1 - floor_now / single_ms, "per layer": 1 - floor_layer / single_ms},
        "raw": {"forward": fwd, "exposed": exposed, "b": b},
    }
    if args.kv_overlap is not None:
        row = next(r for r in json.loads(args.kv_overlap.read_text())["rows"]
                   if r["transport"] == "nixl" and not r.get("layer_push"))
        if "chunked" in row:  # one run per configuration (before --repeats)
            measured, one = row["chunked"]["exposed_s_per_request"] * 1e3, row["single"]["exposed_s_per_request"] * 1e3
        else:
            measured, one = row["exposed_ms_median"], row["single_exposed_ms_median"]
        overhead = measured - floor_now  # event-loop hops, report latency: what the transport adds to the floor
        result["calibrated"] = {"kv_overlap_chunked_ms": measured, "kv_overlap_single_ms": one,
                                "transport_overhead_ms": overhead,
                                "predicted_per_layer_ms": floor_layer + overhead,
                                "predicted_hidden_per_layer": 1 - (floor_layer + overhead) / one,
                                "measured_hidden_chunked": row["hidden_fraction"]}

    t = Table("what", "ms (median)")
    t.add_row(f"(a) last step forward ({last_tokens} tokens, {args.threads} thread)", f"{step_ms:.1f}")
    t.add_row("(a) per decoder layer", " / ".join(f"{x:.1f}" for x in per_layer_ms))
    t.add_row("(a) after the last layer (norm, lm_head)", f"{result['a_after_last_layer_ms']:.2f}")
    for k, v in result["b_write_ms"].items():
        t.add_row(f"(b) NIXL write: {k}", f"{v:.3f}")
    t.add_row("(b) digest: one layer's slice / whole chunk",
              f"{result['b_digest_ms']['layer']:.3f} / {result['b_digest_ms']['chunk']:.3f}")
    for k, v in result["c_forward_ms"].items():
        t.add_row(f"(c) forward, {k}", f"{v:.1f}")
    t.add_row("(c) chunks copied by the loop during one forward", f"{result['c_copy_loop_chunks_per_forward']:.0f}")
    for k, v in result["c_forward_ratio_vs_alone"].items():
        t.add_row(f"(c) forward, {k} / alone, same round (median ratio)", f"{v:.3f}")
    for k, v in result["c_exposed_floor_ms"].items():
        t.add_row(f"(c) exposed floor: {k}", f"{v:.3f}")
    for k, v in result["predicted_hidden_floor"].items():
        t.add_row(f"predicted hidden (floor): {k}", f"{v:.1%}")
    if "calibrated" in result:
        c = result["calibrated"]
        t.add_row("kv_overlap chunked exposed / one transfer (measured)",
                  f"{c['kv_overlap_chunked_ms']:.2f} / {c['kv_overlap_single_ms']:.2f}")
        t.add_row("transport overhead over the floor", f"{c['transport_overhead_ms']:.2f}")
        t.add_row("predicted hidden, per layer (calibrated)", f"{c['predicted_hidden_per_layer']:.1%}")
    console.print(t)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
