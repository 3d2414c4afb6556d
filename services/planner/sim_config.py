"""What a simulated cluster is: workers, engine limits, policies, view staleness, fixed delays."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from services.global_scheduler.policy import ROLES
from splitserve.core.designs import resolve_design
from splitserve.perf.model import PerfModel

MAX_NUM_SEQS = 256  # running sequences per simulated worker (vLLM's default); the planner's limit too

__all__ = ["KV_RECEIVE_MODES", "NetworkLatency", "SimulatorConfig", "worker_id"]

# How a stage's incoming KV reaches its worker (`SimulatorConfig.kv_receive`):
# "async" — as this project's workers: pushes (NIXL) overlap the receiver's steps, and the stage
#   starts on its worker once its last chunk has arrived;
# "blocking" — as vLLM v0's PyNccl disaggregation connector (the 1P1D baseline of DynaServe's
#   Table 1): the stage is handed over when the previous one ends, and the receiver pulls the whole
#   KV inside the step that first schedules it, so every request in that step's batch waits
#   `PerfModel.kv_transfer_time(tokens)` longer for its token.
KV_RECEIVE_MODES = ("async", "blocking")


def worker_id(index: int) -> str:
    """Zero-padded, so id order (the order policies and ClusterView sort by) is index order."""
    return f"w{index:03d}"


@dataclass(frozen=True)
class NetworkLatency:
    """Fixed control-plane delays (seconds) around the workers' compute; KV transfers use the perf model.

    dispatch_s: a client's send until the first stage is queued on its worker (gateway,
    coordinator, GlobalScheduler.Place, Worker.Execute); handoff_s: a stage's end reaching
    the coordinator until the next stage's Execute reaches its worker; stream_s: a sampled
    token leaving its worker until the client sees it (worker -> coordinator -> gateway).
    Defaults are sub-millisecond in-datacenter gRPC hops.
    """

    dispatch_s: float = 1.0e-3
    handoff_s: float = 0.5e-3
    stream_s: float = 0.5e-3

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class SimulatorConfig:
    """Every knob of a simulated cluster (see `Simulator` for their meaning)."""

    num_workers: int
    perf_model: PerfModel
    num_kv_blocks: int
    placement_policy: str = "least_loaded"
    policy_params: dict[str, Any] = field(default_factory=dict)
    batch_policy: str = "fcfs"
    batch_policy_options: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = MAX_NUM_SEQS
    roles: tuple[str, ...] | None = None
    view_refresh_s: float = 0.1
    latency: NetworkLatency = NetworkLatency()
    kv_chunk_tokens: int = 64
    # How long a stage's KV reservation on the next worker waits for room, FIFO, before the
    # next stage recomputes the range instead (the coordinator's --kv-reserve-wait-s).
    kv_reserve_wait_s: float = 30.0
    kv_receive: str = "async"  # one of KV_RECEIVE_MODES
    enable_prefix_caching: bool = True
    fast_forward: bool = True
    slo_ttft_ms: int = 0
    slo_itl_ms: int = 0
    # Heterogeneous deployments (e.g. prefill workers at TP 4, decode workers at TP 8): each
    # worker's own model and KV blocks; None: every worker has `perf_model` / `num_kv_blocks`.
    worker_perf_models: tuple[PerfModel, ...] | None = None
    worker_kv_blocks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_workers", "num_kv_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs",
                     "kv_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be an integer > 0, got {value!r}")
        if not (math.isfinite(self.kv_reserve_wait_s) and self.kv_reserve_wait_s >= 0):
            raise ValueError(f"kv_reserve_wait_s must be a finite number >= 0, got {self.kv_reserve_wait_s!r}")
        if self.kv_receive not in KV_RECEIVE_MODES:
            raise ValueError(f"kv_receive must be one of {', '.join(KV_RECEIVE_MODES)}, got {self.kv_receive!r}")
        if not (math.isfinite(self.view_refresh_s) and self.view_refresh_s > 0):
            raise ValueError(f"view_refresh_s must be a finite number > 0, got {self.view_refresh_s!r}")
        if self.roles is not None:
            roles = tuple(self.roles)
            object.__setattr__(self, "roles", roles)
            if len(roles) != self.num_workers:
                raise ValueError(f"roles: {len(roles)} given for {self.num_workers} workers")
            bad = sorted({r for r in roles if r not in ROLES})
            if bad:
                raise ValueError(f"roles: unknown role(s) {bad}; known: {', '.join(ROLES)}")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("worker_perf_models", "worker_kv_blocks"):
            values = getattr(self, name)
            if values is None:
                continue
            values = tuple(values)
            object.__setattr__(self, name, values)
            if len(values) != self.num_workers:
                raise ValueError(f"{name}: {len(values)} given for {self.num_workers} workers")
        if self.worker_kv_blocks is not None and any(
                isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in self.worker_kv_blocks):
            raise ValueError(f"worker_kv_blocks must be integers > 0, got {list(self.worker_kv_blocks)}")

    def perf_model_of(self, index: int) -> PerfModel:
        return self.worker_perf_models[index] if self.worker_perf_models is not None else self.perf_model

    def kv_blocks_of(self, index: int) -> int:
        return self.worker_kv_blocks[index] if self.worker_kv_blocks is not None else self.num_kv_blocks

    @property
    def worker_roles(self) -> tuple[str, ...]:
        """The role of each worker (all "both" unless given)."""
        return self.roles if self.roles is not None else ("both",) * self.num_workers

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view, the performance model by its label, backend and coefficients (`PerfModel.describe`)."""
        data = {name: getattr(self, name) for name in self.__dataclass_fields__
                if name not in ("perf_model", "worker_perf_models")}
        if self.worker_perf_models is not None:
            data["worker_perf_models"] = [m.describe() for m in self.worker_perf_models]
            data["worker_kv_blocks"] = list(self.worker_kv_blocks) if self.worker_kv_blocks is not None else None
        data["roles"] = list(self.worker_roles)
        # The design its two policies make, or the ablation of one ("dynaserve (...; ablation: local batching fcfs ...)").
        data["design"] = resolve_design(self.placement_policy, self.batch_policy).describe()
        data["latency"] = asdict(self.latency)
        data["perf_model"] = self.perf_model.describe()
        data["kv_capacity_tokens_per_worker"] = self.num_kv_blocks * self.block_size
        return data
