"""Typed configuration of every service; each field is a CLI flag and an env var.

A field `max_num_seqs` of `WorkerConfig` is `--max-num-seqs` on the command line and
`SPLITSERVE_WORKER_MAX_NUM_SEQS` in the environment; fields shared by all services
(`redis_url`, `log_level`, ...) read `SPLITSERVE_REDIS_URL` etc. The flag wins over the
variable, the variable over the default.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

COMMON = "common"


def opt(default: Any, help: str, *, common: bool = False, **kwargs) -> Any:
    """A config field with its help text (and whether its env var is service-independent)."""
    metadata = {"help": help, COMMON: common}
    if default in (list, dict, set):  # a mutable default: one fresh instance per config
        return field(default_factory=default, metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


@dataclass
class CommonConfig:
    """Options every service has."""

    redis_url: str = opt("redis://127.0.0.1:6379/0", "Redis holding the live cluster state.", common=True)
    redis_prefix: str = opt("ss:", "Prefix of every Redis key (isolates clusters sharing a Redis).", common=True)
    redis_connect_attempts: int = opt(10, "Connection attempts at start-up (exponential backoff) before giving up.", common=True)
    log_level: str = opt("INFO", "DEBUG | INFO | WARNING | ERROR", common=True)
    log_json: bool = opt(True, "Log one JSON object per line (false: plain text).", common=True)
    otlp_endpoint: str = opt("", "OTLP/gRPC endpoint for traces, e.g. http://otel-collector:4317; empty disables export.", common=True)
    metrics_port: int = opt(0, "Port of the Prometheus /metrics HTTP endpoint; 0 picks a free port (logged).")
    host: str = opt("127.0.0.1", "Address to listen on (0.0.0.0 in containers).")
    max_message_bytes: int = opt(64 << 20, "Largest gRPC message accepted or sent.", common=True)
    drain_timeout_s: float = opt(30.0, "On SIGTERM: how long in-flight work may take to finish.", common=True)
    mtls_ca_file: str = opt("", "Mutual TLS between services: the CA certificate (PEM) that signs every service's "
                            "certificate. Set: every internal gRPC server requires a client certificate signed by it "
                            "and every internal channel verifies its server against it (give --mtls-cert-file and "
                            "--mtls-key-file too). Empty: plaintext between services (the default).", common=True)
    mtls_cert_file: str = opt("", "Mutual TLS: this service's certificate (PEM), presented as server and as client.",
                              common=True)
    mtls_key_file: str = opt("", "Mutual TLS: the private key (PEM) of --mtls-cert-file.", common=True)
    mtls_server_name: str = opt("", "Mutual TLS: the name every internal server's certificate is checked against "
                                "instead of the host dialed (for servers reached by an address their certificate "
                                "does not name, e.g. workers advertising a container IP). Empty: the host dialed.",
                                common=True)

    SERVICE: typing.ClassVar[str] = ""


@dataclass
class WorkerConfig(CommonConfig):
    """A worker: the engine behind the Worker gRPC service."""

    port: int = opt(50061, "gRPC port of the Worker service.")
    worker_id: str = opt("", "Unique id in the cluster; default: hostname-port.")
    advertise_address: str = opt("", "host:port other services dial; default: host:port.")
    role: str = opt("both", "both | prefill | decode")
    prefill_pool: str = opt("", "LAPS spatial mode: the prefill pool this worker starts in: short | long | '' (none; "
                            "the laps pool controller assigns one).")
    model: str = opt("", "Hugging Face model directory (config.json + safetensors + tokenizer), .gguf file, or "
                     "repository id Org/Name (from the local Hugging Face cache, downloaded unless HF_HUB_OFFLINE); with --backend "
                     "emulated optional: only its config.json's vocabulary and EOS are used (the max length is the "
                     "preset model's context).")
    served_model_name: str = opt("", "The model id clients send (the gateway's --served-model-name), used as the "
                                 "model_name label of the vLLM-named metrics; default: the Hugging Face id given as "
                                 "--model, else the model directory's name.")
    backend: str = opt("real", "real: the engine on CPU/CUDA | emulated: the real service, scheduler and block manager, "
                       "each forward pass replaced by sleeping the performance model's time (no weights).")
    gpu: str = opt("H100", "emulated: GPU of the performance-model preset (A100 | H100 | H200 | L40S | RTX4090).")
    model_preset: str = opt("llama-3-8b", "emulated: model of the preset (Llama-3-8B | Qwen2.5-14B | Qwen2.5-32B | "
                            "Llama-3.1-70B).")
    tp: int = opt(1, "emulated: tensor-parallel degree of the preset (1 | 2 | 4 | 8).")
    perf_backend: str = opt("auto", "emulated: what times the steps: aiconfigurator (NVIDIA's per-op timings measured "
                            "on real GPUs) | roofline (kernel classes, constants fitted to those measurements) | "
                            "datasheet (the whole-step roofline of earlier results) | auto (measured where the GPU x "
                            "model x framework is covered, else the roofline with a warning); the first, second and last add "
                            "the framework's per-step cost fitted to end-to-end GPU measurements (vLLM's), their "
                            "-kernels forms (auto-kernels, ...) time the kernels alone.")
    perf_framework: str = opt("vllm", "emulated: the framework whose measured kernels time the steps: vllm | sglang | "
                              "trtllm.")
    perf_database_version: str = opt("", "emulated: aiconfigurator database version (empty: its current one).")
    dtype: str = opt("auto", "Weights and KV cache dtype (vLLM's --dtype): auto (float32 on the CPU; on CUDA the "
                     "checkpoint's, float32 for a .gguf) | bfloat16 | float16 | float32 (half, float: as vLLM).")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N")
    block_size: int = opt(0, "Tokens per KV block; 0: 256 on CUDA with flash-attn (its paged kernels need a "
                          "multiple of 256), else 16.")
    max_num_batched_tokens: int = opt(2048, "Token budget of one engine step (prefill + decode).")
    max_num_seqs: int = opt(64, "Most requests running at once.")
    max_model_len: int = opt(0, "Longest prompt + output; 0: the model's max_position_embeddings (emulated: "
                             "the preset model's context length, e.g. 8192 for Llama-3-8B).")
    kv_cache_memory_bytes: int = opt(0, "KV cache size on CPU; 0: enough for max_num_seqs full sequences, at most 2 GiB "
                                     "(emulated: the preset GPU's memory beside the weights; never allocated).")
    gpu_memory_utilization: float = opt(0.9, "Fraction of GPU memory the worker may use (CUDA).")
    enable_prefix_caching: bool = opt(True, "Reuse KV of identical prompt prefixes.")
    attention_backend: str = opt("auto", "Attention kernels: auto (flash-attn on CUDA where it fits, else the Triton "
                                 "paged decode kernel where triton imports; on the CPU the paged decode kernel "
                                 "compiled for this machine; else torch SDPA) | sdpa | flash | cpu_kernel | triton.")
    cpu_linear: str = opt("auto", "CPU linear layers: auto/onednn (oneDNN over weights reordered once; 1.3-1.9x "
                          "torch's default here) | torch (F.linear).")
    captured_shapes: bool = opt(False, "LAPS captured shapes: pad each step of short prefills to a (tokens, batch) "
                                "bucket, as a CUDA graph replay needs (exact; on the CPU it only costs the pads).")
    shape_tokens: str = opt("8,16,32,64,128,256", "Captured prompt-length buckets (with --captured-shapes).")
    shape_batches: str = opt("1,2,4,8,16,32,64", "Captured batch sizes (with --captured-shapes).")
    captured_shapes_executor: str = opt("auto", "How a captured shape runs: auto (cuda_graph on CUDA, eager on the "
                                        "CPU) | cuda_graph (captured once per bucket, replayed) | eager | compile "
                                        "(torch.compile per bucket).")
    max_captured_buckets: int = opt(64, "Most captured buckets (CUDA graphs) kept; a step of another runs unpadded.")
    decode_graphs: str = opt("auto", "Decode steps as CUDA graphs: a step of decodes only padded to the next of "
                             "--decode-graph-batches and replayed (vLLM's decode graphs; exact). auto: on CUDA | on "
                             "(the CPU too: the padded layout, run eagerly) | off.")
    decode_graph_batches: str = opt("1,2,4,8,16,24,32,48,64,96,128,192,256",
                                    "Decode batch sizes captured (with --decode-graphs); a larger step runs eagerly.")
    structured_output_cache_size: int = opt(256, "Compiled structured-output grammars kept (LRU by the request's "
                                            "schema, regex, choices or grammar); a request for another compiles it.")
    design: str = opt("", "A research design: dynaserve | laps | ampd, or '' (none). Selects the design's local "
                      "batch policy (slo_aware | laps | prefill_reorder) unless --batch-policy is given (an ablation); "
                      "give the scheduler the same --design (or --policy). One variable for every service.",
                      common=True)
    scheduling_policy: str = opt("fcfs", "Order of waiting requests, as vLLM's --scheduling-policy: fcfs (arrival; "
                                 "the gateway refuses a nonzero priority) | priority (a lower priority value first, "
                                 "ties by arrival; out of KV memory the running request with the largest (priority, "
                                 "arrival) is preempted first). Give the gateway the same value (one variable for "
                                 "both).", common=True)
    batch_policy: str = opt("", "Local batch policy (splitserve/core/policies); '' = the --design's, else fcfs: fcfs | slo_aware (DynaServe "
                            "Alg. 2: decodes first, then prefill up to what the ITL SLO leaves room for, by a latency "
                            "table seeded from --perf-model, the emulated preset, or learned from scratch) | prefill_reorder (AMPD "
                            "Alg. 2: the waiting queue's head window reordered to meet the most TTFT SLOs) | laps (LAPS: short and long (re-)prefills never in "
                            "one step; short ones batched to captured shapes with an adaptive wait, long ones by fixed "
                            "chunks).")
    batch_policy_options: str = opt("", "JSON object of the batch policy's options, e.g. '{\"target_fraction\": 0.9, "
                                    "\"min_prefill_tokens\": 16}' for slo_aware.")
    itl_slo_ms: float = opt(0.0, "slo_aware: ITL objective (ms) for steps whose decodes carry none (requests sent "
                            "without an SLO); 0: none, such steps get the whole step budget as fcfs does.")
    perf_model: str = opt("", "Fitted performance model JSON (`splitserve profile --out`): the emulated backend's "
                          "step and transfer times instead of the preset's, and the starting latency table of "
                          "slo_aware (without it: the emulated preset's, or learned from scratch on a real engine).")
    num_threads: int = opt(0, "torch CPU threads of the engine; 0: all cores this process may use but one (that "
                           "one runs the gRPC event loop).")
    dllm_cache: str = opt("dual", "Diffusion models (LLaDA): dual = a Refresh step at each block start caches the "
                          "sequence's KV, Reuse steps compute only the block against it (dLLM-Serve §2.3) | none = "
                          "every step recomputes the whole sequence.")
    max_num_logits: int = opt(2048, "Diffusion models: logit rows materialised at once; larger steps compute, "
                              "decode and free their logits in chunks of this many rows (dLLM-Serve §4.3).")
    sparse_kv: str = opt("head", "Diffusion models, for requests with retention_ratio < 1: head = each KV head keeps "
                         "its own top positions (dLLM-Serve §4.5) | uniform = one set for all heads (Sparse-dLLM).")
    diffusion_policy: str = opt("phase_multiplexed", "Diffusion models: phase_multiplexed = requests join in the "
                                "query-token headroom others free moving from Refresh to Reuse (dLLM-Serve §4.4) | "
                                "static = batches of --static-batch-size admitted when the previous one drained "
                                "(the baseline).")
    static_batch_size: int = opt(8, "Diffusion models, diffusion_policy static: requests per batch.")
    heartbeat_interval_s: float = opt(1.0, "How often the heartbeat is refreshed in Redis.")
    load_interval_s: float = opt(0.1, "How often load, prefill-queue metadata and latency samples are published.")
    heartbeat_ttl_s: float = opt(3.0, "How long the registry keeps a worker without a heartbeat.")
    latency_window_s: float = opt(10.0, "Window of the TTFT/ITL samples published to Redis.")
    kv_transport: str = opt("auto", "KV transfer between workers: auto (NIXL when importable) | nixl | grpc.")
    kv_transfer_lanes: int = opt(1, "NIXL agents per worker, each on its own thread; a large transfer is split across "
                                 "the lanes two workers share (CPU: one core's copy each; GPU: one per NIC).")
    kv_transfer_timeout_s: float = opt(10.0, "Longest wait for a stage's incoming KV before recomputing it from tokens.")
    kv_reservation_ttl_s: float = opt(60.0, "Reserved KV blocks no stage claimed are freed after this.")
    kv_fault_injection: str = opt("", "Testing only: corrupt (bytes altered in flight after their digest was "
                                  "taken: a flipped payload byte on gRPC, a WRITE from the wrong blocks on NIXL) | truncate (the last chunk never sent) | fail (the push fails at "
                                  "the sender, which tells the receiver) the KV this worker pushes.")
    kv_layer_push: bool = opt(True, "NIXL: push a stage's last step's KV layer by layer as each decoder layer writes "
                              "it, instead of as one chunk after the step (gRPC always pushes whole chunks).")

    SERVICE: typing.ClassVar[str] = "worker"


@dataclass
class SchedulerConfig(CommonConfig):
    """The global scheduler: placement of requests onto workers."""

    port: int = opt(50071, "gRPC port of the GlobalScheduler service.")
    design: str = opt("", "A research design: dynaserve | laps | ampd, or '' (none): its placement policy unless "
                      "--policy is given (an ablation); give the workers the same --design. One variable for every "
                      "service.", common=True)
    policy: str = opt("", "Placement policy ('' = the --design's, else least_loaded): round_robin | least_loaded | pd_disaggregated | split | "
                      "dynaserve (DynaServe Alg. 1: a split point per request from the worker pair's predicted load).")
    split_ratio: float = opt(0.5, "split policy: phi, the fraction of prompt + max_tokens run on the first worker.")
    policy_params: str = opt("", "The placement policy's parameters: a JSON object or key=value pairs separated by "
                             "commas, e.g. 'perf_model=A100/qwen2.5-14b,max_probes=6' for dynaserve (perf_model: a "
                             "preset GPU/MODEL[/TP], a `splitserve profile` JSON file or redis:WORKER_ID).")
    view_refresh_s: float = opt(0.05, "How often the cluster view is re-read from Redis.")
    view_idle_refresh_s: float = opt(1.0, "After 2 s in which nothing read the cluster view (no placement, "
                                     "ClusterState or readiness check: coordinators placing locally), it is re-read "
                                     "this often instead; the next read brings back --view-refresh-s at once. "
                                     "0: always --view-refresh-s.")

    SERVICE: typing.ClassVar[str] = "scheduler"


@dataclass
class CoordinatorConfig(CommonConfig):
    """The coordinator: request lifecycle from plan to stitched stream."""

    port: int = opt(50081, "gRPC port of the Coordinator service.")
    scheduler_address: str = opt("127.0.0.1:50071", "host:port of the global scheduler.")
    request_record_ttl_s: float = opt(600.0, "How long request records stay in Redis.")
    request_timeout_s: float = opt(600.0, "Deadline of a request when the caller sets none.")
    kv_chunk_tokens: int = opt(64, "Tokens per pushed KV chunk between stages (rounded up to whole blocks).")
    kv_reserve_wait_s: float = opt(30.0, "How long a stage waits, in line, for the next stage's worker to have room "
                                   "for its KV before it is sent anyway and the next stage recomputes that range "
                                   "from tokens (a prefill worker's backlog holds decode KV only once it runs). "
                                   "0: recompute at once.")
    migration_timeout_s: float = opt(20.0, "How long to keep re-placing a request whose worker died mid-stream.")
    placement: str = opt("scheduler", "Where plans come from: scheduler (the GlobalScheduler service; run-time "
                         "SetPolicy, one view for all coordinators) | local (the same policy in this process: one "
                         "gRPC hop less per request).")
    policy: str = opt("least_loaded", "placement=local: the policy (round_robin | least_loaded | pd_disaggregated | "
                      "split | dynaserve).")
    split_ratio: float = opt(0.5, "placement=local, policy split: phi.")
    policy_params: str = opt("", "placement=local: the policy's parameters (JSON object or key=value,...), as the "
                             "scheduler's --policy-params.")
    view_refresh_s: float = opt(0.05, "placement=local: how often the cluster view is re-read from Redis.")
    view_idle_refresh_s: float = opt(1.0, "placement=local: after 2 s in which nothing read the cluster view "
                                     "(gateways' readiness checks read it twice a second), it is re-read this often "
                                     "instead; 0: always --view-refresh-s.")
    record_flush_interval_s: float = opt(0.02, "Request records are written to Redis in one batch per interval.")
    session_ttl_s: float = opt(600.0, "Idle time before a session expires when the client asks for none.")
    max_session_ttl_s: float = opt(86400.0, "Longest idle TTL a client may ask for when opening a session.")
    max_sessions_per_key: int = opt(1000, "Open sessions per API key (per owner); 0: no limit.")
    max_session_history_tokens: int = opt(0, "Longest prompt (history + new turn) of a session round; 0: only the "
                                          "model's length.")

    SERVICE: typing.ClassVar[str] = "coordinator"


@dataclass
class GatewayConfig(CommonConfig):
    """The gateway: gRPC Gateway and OpenAI-compatible HTTP API."""

    port: int = opt(50051, "gRPC port of the Gateway service.")
    http_port: int = opt(8000, "Port of the OpenAI-compatible HTTP API (also serves /metrics).")
    coordinator_address: str = opt("127.0.0.1:50081", "host:port of the coordinator, or 'embedded': run the "
                                   "coordinator in this process (configured by SPLITSERVE_COORDINATOR_* variables).")
    model: str = opt("", "Model directory, .gguf file or Hugging Face repository id Org/Name: its tokenizer and "
                     "config (max length) are used here.")
    served_model_name: str = opt("", "Model id clients send; default: the Hugging Face id given as --model, else "
                                 "the model directory's name.")
    api_keys: list[str] = opt(list, "Accepted API keys (comma-separated in the env var); empty: no auth.")
    max_model_len: int = opt(0, "Longest prompt + output accepted; 0: the model directory's config (an emulated "
                             "cluster's gateway takes the preset model's context, as its workers do).")
    max_tokens_limit: int = opt(4096, "Largest max_tokens a request may ask for.")
    max_n: int = opt(16, "Largest n (choices per request) a request may ask for; each choice is generated as a "
                           "request of its own.")
    default_max_tokens: int = opt(16, "max_tokens when a request sets none.")
    max_request_body_bytes: int = opt(16 << 20, "Largest HTTP request body accepted (larger: 413 naming the limit; "
                                      "gRPC messages are bounded by --max-message-bytes).")
    max_concurrent_requests: int = opt(256, "Requests in flight before new ones wait in the admission queue.")
    max_queued_requests: int = opt(1024, "Admission queue length; beyond it requests get 429 / RESOURCE_EXHAUSTED.")
    queue_timeout_s: float = opt(30.0, "Longest wait in the admission queue before 429.")
    rate_limit_requests_per_minute: int = opt(0, "Requests per minute per API key (all gateways together, token "
                                              "bucket in Redis); beyond it 429 with Retry-After. 0: no limit.")
    rate_limit_tokens_per_minute: int = opt(0, "Tokens (prompt + max_tokens) per minute per API key, as above. "
                                            "0: no limit.")
    api_keys_file: str = opt("", "Tenants and their hashed API keys (JSON or TOML, see docs/deployment.md#security; "
                             "hash a key with `python -m splitserve.keys hash`), each tenant with optional "
                             "requests_per_minute / tokens_per_minute overriding the --rate-limit-* defaults. "
                             "Combines with --api-keys (those belong to the tenant 'default').")
    tls_cert_file: str = opt("", "TLS certificate (PEM, with its chain) of the gateway's public gRPC and HTTP "
                             "listeners; with --tls-key-file. Empty: plaintext (the default).")
    tls_key_file: str = opt("", "Private key (PEM) of --tls-cert-file.")
    scheduling_policy: str = opt("fcfs", "The workers' --scheduling-policy: fcfs (a request with a nonzero priority "
                                 "is refused, 400 naming priority, as vLLM) | priority (priority is accepted; lower "
                                 "values are served first). One variable for the gateway and the workers.",
                                 common=True)
    tls_client_ca_file: str = opt("", "With TLS: clients of the public listeners must present a certificate "
                                  "signed by this CA (PEM); empty: no client certificate asked for.")

    SERVICE: typing.ClassVar[str] = "gateway"


SERVICE_CONFIGS: dict[str, type[CommonConfig]] = {
    c.SERVICE: c for c in (WorkerConfig, SchedulerConfig, CoordinatorConfig, GatewayConfig)
}


def env_var(cls: type[CommonConfig], f: dataclasses.Field) -> str:
    if f.metadata.get(COMMON):
        return f"SPLITSERVE_{f.name.upper()}"
    return f"SPLITSERVE_{cls.SERVICE.upper()}_{f.name.upper()}"


def field_type(cls: type, f: dataclasses.Field) -> type:
    return typing.get_type_hints(cls)[f.name]


def parse_value(raw: str, typ: Any, name: str) -> Any:
    """Convert a flag or env string to the field's type; ValueError names the field."""
    try:
        if typ is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        if typing.get_origin(typ) is list:
            return [p.strip() for p in raw.split(",") if p.strip()]
        return raw
    except ValueError as err:
        raise ValueError(f"{name}: cannot parse {raw!r}: {err}") from None


def load_config(cls: type[CommonConfig], overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> CommonConfig:
    """Build a config: explicit overrides, then env vars, then defaults."""
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides and overrides[f.name] is not None:
            values[f.name] = overrides.pop(f.name)
        elif env_var(cls, f) in environ:
            values[f.name] = parse_value(environ[env_var(cls, f)], field_type(cls, f), env_var(cls, f))
    if overrides:
        raise ValueError(f"unknown {cls.SERVICE} options: {sorted(overrides)}")
    return cls(**values)


def default_worker_id(host: str, port: int) -> str:
    name = socket.gethostname().split(".")[0] or "worker"
    return f"{name}-{port}".replace(":", "-")
