"""``splitserve profile``: measure a live worker and fit the performance model to it.

    splitserve profile --worker 127.0.0.1:50061 --out perf.json
    splitserve simulate --perf-model perf.json ...            # the simulator on the fitted times
    SPLITSERVE_WORKER_PERF_MODEL=perf.json splitserve serve worker --backend emulated ...

1. `Worker.Profile` times real engine steps of synthetic prefill (l_hist x l_incr), decode
   (batch x ctx) and mixed (a prefill chunk l_hist x l_incr beside a decode batch batch x
   ctx, one step) shapes on the worker's own engine (`workers/profiling.py`).
2. KV transfer: `Worker.PullKv` of the first n KV blocks, streamed from the worker to
   this process over the gRPC transport (read-only: other requests' KV is not touched),
   timed end to end for each size; the payload size gives the KV bytes per token. An
   emulated worker holds no KV bytes (its transfers are the preset's sleeps), so its
   transfer coefficients come from the base model instead.
3. `fit_perf_model` fits the piecewise alpha-beta model to all of them, mixed steps
   included: they settle how the prefill and decode lines add up in one step (kinds not
   measured come from `--base`, a preset like H100/llama-3-8b or a model JSON; an emulated
   worker's own preset by default), and the result goes to a JSON file and to Redis under
   `perf:{worker_id}` (`StateStore.put_perf`), both in `PerfModel.to_dict` form plus a
   "profile" section with the raw samples, so either loads with `PerfModel.from_dict`
   (`splitserve.perf.store.load_perf_model` reads either back).

The pure parts (`parse_ints`, `samples_from_response`, `build_document`, `base_model_for`)
take plain data; `run_profile` does the I/O.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from splitserve.perf.model import (DecodeCoeffs, PerfModel, PrefillCoeffs, ProfileSample, TransferCoeffs,
                                   fit_perf_model)
# Reads back what `run_profile` stores. It lives in the runtime module perf_store, where the
# simulator imports it without this command's gRPC code, and stays importable from here.
from splitserve.perf.store import load_perf_model
from workers.profiling import DEFAULT_GRID, ProfileGrid

__all__ = ["ProfileOptions", "base_model_for", "build_document", "load_perf_model", "parse_ints", "profile_command",
           "run_profile", "samples_from_response"]

console = Console()


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))

DEFAULT_TRANSFER_TOKENS = (16, 64, 256, 1024, 4096)


@dataclass
class ProfileOptions:
    worker: str
    grid: ProfileGrid = DEFAULT_GRID  # the shapes and repeats (workers/profiling.py owns the defaults)
    transfer_tokens: tuple[int, ...] = DEFAULT_TRANSFER_TOKENS
    base: str = ""  # GPU/MODEL[/TP] preset or a perf-model JSON; "" = the emulated worker's preset, else none
    out: Path | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "ss:"
    store_redis: bool = True
    worker_id: str = ""
    label: str = ""
    timeout_s: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)
    # The cluster's mutual TLS (the services' --mtls-* files): empty ca = plaintext.
    mtls_ca_file: str = ""
    mtls_cert_file: str = ""
    mtls_key_file: str = ""


def parse_ints(text: str, name: str, allow_zero: bool = False) -> tuple[int, ...]:
    """'16,64,256' -> (16, 64, 256); '' or 'none' -> (); ValueError naming the option otherwise."""
    text = text.strip()
    if text in ("", "none"):
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{name}: expected a comma list of integers, got {text!r}") from None
    low = 0 if allow_zero else 1
    if any(v < low for v in values):
        raise ValueError(f"{name}: every value must be >= {low}, got {text!r}")
    return values


def samples_from_response(response: Any) -> list[ProfileSample]:
    """`ProfileSample`s (perf_model) of a `worker_pb2.ProfileResponse`."""
    out = []
    for s in response.samples:
        if s.kind == "prefill":
            out.append(ProfileSample("prefill", l_hist=s.l_hist, l_incr=s.l_incr, batch=1, seconds=s.seconds))
        elif s.kind == "decode":
            out.append(ProfileSample("decode", batch=s.batch, ctx=s.ctx, seconds=s.seconds))
        elif s.kind == "mixed":
            out.append(ProfileSample("mixed", l_hist=s.l_hist, l_incr=s.l_incr, batch=s.batch, ctx=s.ctx,
                                     seconds=s.seconds))
    return out


def base_model_for(base: str, device: str) -> PerfModel | None:
    """The model unmeasured kinds come from: `base` (GPU/MODEL[/TP] or a JSON path), else the preset an
    emulated worker's device names ("emulated:H100x1/Llama-3-8B"), else None."""
    from splitserve.perf.presets import preset

    spec = base
    if not spec and device.startswith("emulated:"):
        gpu_tp, _, model = device[len("emulated:"):].partition("/")
        gpu, _, tp = gpu_tp.rpartition("x")
        spec = f"{gpu}/{model}/{tp}"
    if not spec:
        return None
    if spec.endswith(".json") or Path(spec).is_file():
        return PerfModel.load(spec)
    parts = spec.split("/")
    if len(parts) not in (2, 3):
        raise ValueError(f"--base: expected GPU/MODEL[/TP] or a perf-model JSON file, got {spec!r}")
    return preset(parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 1)


def _zero_model() -> PerfModel:
    return PerfModel(PrefillCoeffs(), DecodeCoeffs(), TransferCoeffs(), label="zero")


def fit_samples(samples: list[ProfileSample], base: PerfModel | None, kv_bytes_per_token: float | None,
                label: str) -> PerfModel:
    """Fit; a kind neither measured nor in `base` gets zero coefficients (stated in the document)."""
    kinds = {s.kind for s in samples}
    if base is None and not {"prefill", "decode", "transfer"} <= kinds:
        base = _zero_model()
    return fit_perf_model(samples, base=base, kv_bytes_per_token=kv_bytes_per_token, label=label)


def build_document(model: PerfModel, samples: list[ProfileSample], *, worker_id: str, address: str,
                   engine_kind: str, device: str, base_label: str | None, measured_at: float,
                   grid: dict[str, Any]) -> dict[str, Any]:
    """What goes to the JSON file and to Redis: the model (`PerfModel.from_dict` reads it) plus the profile."""
    measured = sorted({s.kind for s in samples})
    return {
        **model.to_dict(),
        "profile": {
            "worker_id": worker_id, "address": address, "engine_kind": engine_kind, "device": device,
            "measured_at_unix_s": measured_at, "grid": grid, "measured_kinds": measured,
            "base": base_label, "samples": [asdict(s) for s in samples],
            "predicted_s": [_predict(model, s) for s in samples],
        },
    }


def _predict(model: PerfModel, s: ProfileSample) -> float:
    if s.kind == "prefill":
        return model.step_time([(s.l_hist, s.l_incr)] * max(s.batch, 1))
    if s.kind == "decode":
        return model.decode_time(s.batch, s.ctx)
    if s.kind == "mixed":
        return model.mixed_step_time(s.l_incr, s.l_hist, s.batch, s.ctx)
    return model.kv_transfer_time(s.tokens)


# ---- I/O -------------------------------------------------------------------------------------

def _measure_transfers(stub, tokens_list: tuple[int, ...], block_size: int, total_blocks: int, repeats: int,
                       timeout_s: float) -> tuple[list[ProfileSample], float | None, list[str]]:
    """PullKv of the first n blocks for each size: (samples, KV bytes per token, skipped sizes)."""
    from splitserve.proto import worker_pb2

    samples, skipped = [], []
    bytes_per_token = None
    for tokens in tokens_list:
        blocks = -(-tokens // block_size)
        if blocks > total_blocks:
            skipped.append(f"transfer {tokens} tokens: needs {blocks} blocks, the worker has {total_blocks}")
            continue
        n_tokens = blocks * block_size
        runs = []
        for i in range(repeats + 1):  # the first is a warm-up
            request = worker_pb2.PullKvRequest(transfer_id=f"__profile__/{uuid.uuid4().hex[:8]}",
                                               request_id="__profile__", start=0, end=n_tokens,
                                               block_ids=list(range(blocks)))
            started = time.perf_counter()
            payload = 0
            for chunk in stub.PullKv(request, timeout=timeout_s):
                payload += len(chunk.payload)
                if chunk.last:
                    break
            elapsed = time.perf_counter() - started
            if i:
                runs.append(elapsed)
        if payload:
            bytes_per_token = payload / n_tokens
        samples.append(ProfileSample("transfer", tokens=n_tokens, seconds=statistics.median(runs)))
    return samples, bytes_per_token, skipped


def run_profile(opts: ProfileOptions) -> dict[str, Any]:
    """Profile `opts.worker`, fit, write the JSON and the Redis entry; returns the document."""
    import grpc

    from splitserve.proto import worker_pb2, worker_pb2_grpc

    shapes = asdict(opts.grid)  # every field of ProfileRequest's grid, by the same names
    grid = {**{k: list(v) if isinstance(v, tuple) else v for k, v in shapes.items()},
            "transfer_tokens": list(opts.transfer_tokens)}
    request = worker_pb2.ProfileRequest(**shapes)
    g = opts.grid
    if not g.prefill_lens and not g.decode_batch_sizes and not g.mixed_prefill_lens:
        raise ValueError("nothing to measure: give --prefill-lens, --decode-batch or --mixed-chunk")
    # An empty list in the request means the worker's default grid: shapes of a kind not asked
    # for are measured by the worker but dropped here.
    from splitserve.tls import channel_credentials, open_channel

    credentials = None
    if opts.mtls_ca_file or opts.mtls_cert_file or opts.mtls_key_file:
        credentials = channel_credentials(opts.mtls_ca_file, opts.mtls_cert_file, opts.mtls_key_file,
                                          fields=("--mtls-ca-file", "--mtls-cert-file", "--mtls-key-file"))
    with open_channel(opts.worker, credentials, [("grpc.max_receive_message_length", 256 << 20)]) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
        worker_id = opts.worker_id or load.worker_id
        started = time.time()
        response = stub.Profile(request, timeout=opts.timeout_s)
        samples = samples_from_response(response)
        samples = [s for s in samples if (s.kind != "prefill" or g.prefill_lens)
                   and (s.kind != "decode" or g.decode_batch_sizes)
                   and (s.kind != "mixed" or g.mixed_prefill_lens)]
        emulated = response.device.startswith("emulated:")
        transfer, bytes_per_token, skipped = [], None, []
        if opts.transfer_tokens and not emulated:
            transfer, bytes_per_token, skipped = _measure_transfers(
                stub, opts.transfer_tokens, load.block_size, load.total_blocks, g.repeats, opts.timeout_s)
        elif opts.transfer_tokens:
            skipped.append("transfer: an emulated worker holds no KV bytes; coefficients from the base model")
    samples += transfer
    base = base_model_for(opts.base, response.device)
    label = opts.label or f"profile:{worker_id} ({response.device})"
    kv_bytes = bytes_per_token if bytes_per_token is not None else (base.kv_bytes_per_token if base else 0.0)
    model = fit_samples(samples, base, kv_bytes, label)
    doc = build_document(model, samples, worker_id=worker_id, address=opts.worker, engine_kind=response.engine_kind,
                         device=response.device, base_label=base.label if base else None, measured_at=started,
                         grid=grid)
    doc["profile"]["skipped"] = skipped
    out = opts.out or Path(f"perf-{worker_id.replace('/', '_').replace(':', '_')}.json")
    doc["profile"]["json_path"] = str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if opts.store_redis:
        from splitserve.state.store import RedisRetryPolicy, StateStore

        async def store() -> None:
            async with StateStore(opts.redis_url, opts.redis_prefix,
                                  retry_policy=RedisRetryPolicy(attempts=3)) as st:
                await st.put_perf(worker_id, doc)

        asyncio.run(store())
    return doc


def _report(doc: dict[str, Any]) -> None:
    prof = doc["profile"]
    table = Table("kind", "shape", "measured ms", "fitted ms", "error", title=f"profile of {prof['worker_id']} "
                  f"({prof['engine_kind']} on {prof['device']})", header_style="bold")
    for s, pred in zip(prof["samples"], prof["predicted_s"]):
        shape = {"prefill": f"l_hist={s['l_hist']} l_incr={s['l_incr']}", "decode": f"batch={s['batch']} ctx={s['ctx']}",
                 "mixed": f"l_hist={s['l_hist']} l_incr={s['l_incr']} + batch={s['batch']} ctx={s['ctx']}",
                 "transfer": f"{s['tokens']} tokens"}[s["kind"]]
        err = (pred - s["seconds"]) / s["seconds"]
        table.add_row(s["kind"], shape, f"{s['seconds'] * 1e3:.3f}", f"{pred * 1e3:.3f}", f"{err:+.1%}")
    console.print(table)
    fit = doc.get("fit") or {}
    for kind in ("prefill", "decode", "transfer", "mixed"):
        e = fit.get(kind)
        if e:
            console.print(f"{kind}: {e['n']} samples, mean error {e['mean_rel']:.1%}, max {e['max_rel']:.1%}")
        elif kind == "mixed":
            console.print("mixed: not measured; mixed steps are predicted from the prefill and decode fits")
        else:
            console.print(f"{kind}: not measured; coefficients from {prof['base'] or 'zero (no base model)'}")
    for line in prof.get("skipped", []):
        console.print(f"[yellow]skipped[/]: {line}")


def profile_command(
    worker: str = typer.Option(..., "--worker", help="HOST:PORT of the worker's gRPC server."),
    prefill_lens: str = typer.Option(_csv(DEFAULT_GRID.prefill_lens), "--prefill-lens", help="l_incr values (comma list; none)."),
    history_lens: str = typer.Option(_csv(DEFAULT_GRID.history_lens), "--history-lens", help="l_hist values, crossed with --prefill-lens."),
    decode_batch: str = typer.Option(_csv(DEFAULT_GRID.decode_batch_sizes), "--decode-batch", help="Decode batch sizes (comma list; none)."),
    decode_ctx: str = typer.Option(_csv(DEFAULT_GRID.decode_context_lens), "--decode-ctx", help="Decode contexts, crossed with --decode-batch."),
    mixed_chunk: str = typer.Option(_csv(DEFAULT_GRID.mixed_prefill_lens), "--mixed-chunk",
                                    help="Mixed steps: prefill chunk lengths l_incr beside a decode batch (comma list; none)."),
    mixed_history: str = typer.Option(_csv(DEFAULT_GRID.mixed_history_lens), "--mixed-history", help="Mixed steps: the chunk's cached tokens l_hist."),
    mixed_batch: str = typer.Option(_csv(DEFAULT_GRID.mixed_decode_batch_sizes), "--mixed-batch", help="Mixed steps: decode batch sizes beside the chunk."),
    mixed_ctx: str = typer.Option(_csv(DEFAULT_GRID.mixed_decode_context_lens), "--mixed-ctx", help="Mixed steps: decode contexts (all four lists crossed)."),
    transfer_tokens: str = typer.Option(",".join(map(str, DEFAULT_TRANSFER_TOKENS)), "--transfer-tokens",
                                        help="KV transfer sizes in tokens, pulled over gRPC (comma list; none)."),
    repeats: int = typer.Option(DEFAULT_GRID.repeats, "--repeats", help="Timed runs per shape after one warm-up (median kept)."),
    base: str = typer.Option("", "--base", help="Kinds not measured come from this: a GPU/MODEL or GPU/MODEL/TP preset or a "
                             "perf-model JSON (default: an emulated worker's own preset)."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON file (default perf-<worker id>.json)."),
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", "--redis-url", envvar="SPLITSERVE_REDIS_URL"),
    redis_prefix: str = typer.Option("ss:", "--redis-prefix", envvar="SPLITSERVE_REDIS_PREFIX"),
    store_redis: bool = typer.Option(True, "--redis/--no-redis", help="Also store under perf:{worker_id} in Redis."),
    worker_id: str = typer.Option("", "--worker-id", help="Key to store under (default: the worker's own id)."),
    label: str = typer.Option("", "--label", help="Label of the fitted model."),
    timeout_s: float = typer.Option(600.0, "--timeout", help="Seconds the worker may take to measure the grid."),
    mtls_ca_file: str = typer.Option("", "--mtls-ca-file", envvar="SPLITSERVE_MTLS_CA_FILE",
                                     help="The cluster's mutual TLS: CA of the workers' certificates (empty: plaintext)."),
    mtls_cert_file: str = typer.Option("", "--mtls-cert-file", envvar="SPLITSERVE_MTLS_CERT_FILE",
                                       help="Mutual TLS: the client certificate to present."),
    mtls_key_file: str = typer.Option("", "--mtls-key-file", envvar="SPLITSERVE_MTLS_KEY_FILE",
                                      help="Mutual TLS: the key of --mtls-cert-file."),
) -> None:
    """Measure a worker over a grid of shapes, fit the performance model, store it (JSON and Redis)."""
    import grpc

    try:
        grid = ProfileGrid(
            prefill_lens=parse_ints(prefill_lens, "--prefill-lens"),
            history_lens=parse_ints(history_lens, "--history-lens", allow_zero=True),
            decode_batch_sizes=parse_ints(decode_batch, "--decode-batch"),
            decode_context_lens=parse_ints(decode_ctx, "--decode-ctx"), repeats=repeats,
            mixed_prefill_lens=parse_ints(mixed_chunk, "--mixed-chunk"),
            mixed_history_lens=parse_ints(mixed_history, "--mixed-history", allow_zero=True),
            mixed_decode_batch_sizes=parse_ints(mixed_batch, "--mixed-batch"),
            mixed_decode_context_lens=parse_ints(mixed_ctx, "--mixed-ctx"))
        opts = ProfileOptions(
            worker=worker, grid=grid, transfer_tokens=parse_ints(transfer_tokens, "--transfer-tokens"), base=base, out=out,
            redis_url=redis_url, redis_prefix=redis_prefix, store_redis=store_redis, worker_id=worker_id,
            label=label, timeout_s=timeout_s, mtls_ca_file=mtls_ca_file, mtls_cert_file=mtls_cert_file,
            mtls_key_file=mtls_key_file)
        doc = run_profile(opts)
    except ValueError as err:
        console.print(f"[red]error:[/] {err}")
        raise typer.Exit(2) from None
    except grpc.RpcError as err:
        console.print(f"[red]worker {worker}:[/] {err.code().name}: {err.details()}")
        raise typer.Exit(1) from None
    _report(doc)
    console.print(f"wrote {doc['profile']['json_path']}"
                  + (f" and Redis {redis_prefix}perf:{doc['profile']['worker_id']}" if store_redis else ""))
