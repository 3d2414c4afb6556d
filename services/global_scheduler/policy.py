"""The placement-policy interface and the plain data it decides over.

Pure (architecture principle 1): no gRPC, no Redis, no wall clock. The scheduler
service, the emulated cluster and the discrete-event simulator all call the same
policies with a `ClusterView` and an injected `now`.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

from splitserve.errors import Unavailable
# POOLS and ROLES are re-exported: policies and the simulator take them from here.
from splitserve.core.records import (DIFFUSION, POOLS, ROLES, PrefillTask, WorkerLoad,  # noqa: F401
                                      engine_family)


class NoWorkerAvailable(Unavailable):
    """No eligible worker can take the request (retriable: workers may come back)."""


@dataclass(frozen=True, slots=True)
class WorkerSignals:
    """What a worker's recent service looked like (AMPD §3: the shared windowed statistics
    and prefill queues). Read only for policies that ask (`view_signals`): it costs the
    scheduler a Redis read per worker per refresh."""

    ttft_mean_s: float | None = None  # mean TTFT of its prefills in the last window; None: no samples
    itl_mean_s: float | None = None  # mean gap between its tokens in the last window; None: no samples
    prefill_queue: tuple[PrefillTask, ...] = ()  # its pending prefills, in queue order


@dataclass(frozen=True)
class WorkerView:
    """One worker as a policy sees it: registry entry, latest load, and recent placements."""

    worker_id: str
    address: str
    load: WorkerLoad  # its role is the live one (Worker.SetRole changes it)
    # Requests this scheduler placed here since the load snapshot was taken: the snapshot
    # does not show them yet, and without them every placement inside one refresh
    # interval would land on the same "least loaded" worker.
    inflight_assigned: int = 0
    signals: WorkerSignals | None = None  # only when the policy asks for them (`view_signals`)

    @property
    def role(self) -> str:
        """"both" | "prefill" | "decode"."""
        return self.load.role

    @property
    def engine_kind(self) -> str:
        return self.load.engine_kind

    @property
    def eligible(self) -> bool:
        """Whether new work may be placed here."""
        return not self.load.draining

    @property
    def free_kv_fraction(self) -> float:
        """Free KV blocks / total blocks; 0 when the worker reports no KV cache."""
        return self.load.free_kv_fraction


@dataclass(frozen=True)
class ClusterView:
    """A snapshot of the workers, sorted by worker id, taken at `taken_at` (unix seconds)."""

    workers: tuple[WorkerView, ...]
    taken_at: float

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.workers, key=lambda w: w.worker_id))
        object.__setattr__(self, "workers", ordered)

    @property
    def eligible(self) -> tuple[WorkerView, ...]:
        """Workers that accept new work (not draining)."""
        return tuple(w for w in self.workers if w.eligible)

    def by_role(self, *roles: str, eligible_only: bool = True) -> tuple[WorkerView, ...]:
        """Workers whose role is one of `roles` (only eligible ones unless told otherwise)."""
        pool = self.eligible if eligible_only else self.workers
        return tuple(w for w in pool if w.role in roles)

    def get(self, worker_id: str) -> WorkerView | None:
        """The worker with this id, or None."""
        return next((w for w in self.workers if w.worker_id == worker_id), None)

    def of_family(self, family: str) -> ClusterView:
        """This view with only the workers of one engine family ("diffusion" or "": autoregressive)."""
        kept = tuple(w for w in self.workers if engine_family(w.engine_kind) == family)
        return self if len(kept) == len(self.workers) else ClusterView(kept, self.taken_at)

    def without(self, worker_ids: Iterable[str]) -> ClusterView:
        """This view without those workers (ones a request already failed on)."""
        drop = set(worker_ids)
        if not drop:
            return self
        return ClusterView(tuple(w for w in self.workers if w.worker_id not in drop), self.taken_at)


@dataclass(frozen=True)
class PlacementRequest:
    """What a policy knows about a request: lengths, SLOs, priority (mirrors RequestMeta)."""

    request_id: str
    prompt_len: int  # whole prompt, history included
    max_tokens: int  # output budget: the plan covers [0, prompt_len + max_tokens)
    session_id: str = ""
    history_len: int = 0  # prefix already held as KV by the session's decode worker
    bound_worker: str = ""  # that worker (AMPD binding); "" for a new session or none
    # The client's hint of its output length; None: no hint given (a policy then predicts:
    # services.global_scheduler.length_predictor.predicted_output_len does both).
    predicted_output_len: int | None = None
    slo_ttft_ms: int = 0  # 0: no objective
    slo_itl_ms: int = 0
    priority: int = 0
    # Workers this request already failed on (a retry or migration); the view the policy
    # sees leaves them out, so a dead worker still in the registry is not chosen again.
    avoid_workers: tuple[str, ...] = ()
    # "diffusion": a diffusion model's request, placed whole on a diffusion worker
    # (`place_diffusion`); "": autoregressive, placed by the policy among the others.
    engine_family: str = ""

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0 <= self.history_len <= self.prompt_len:
            raise ValueError(f"history_len must be in [0, prompt_len], got {self.history_len}")
        if self.predicted_output_len is not None and self.predicted_output_len < 0:
            raise ValueError(f"predicted_output_len must be >= 0 or None, got {self.predicted_output_len}")

    @property
    def total_len(self) -> int:
        """Length of the logical sequence: prompt plus the whole output budget."""
        return self.prompt_len + self.max_tokens


@dataclass(frozen=True)
class StagePlacement:
    """Token range [start, end) of one request run on one worker."""

    worker_id: str
    address: str
    start: int
    end: int
    # This stage's KV goes to the next stage's worker (see `orient_kv_transfers`).
    push_kv: bool = True


@dataclass(frozen=True)
class Placement:
    """A plan: stages run in order and tile [0, L) without gaps or overlaps."""

    stages: tuple[StagePlacement, ...]
    policy: str
    reason: str = ""
    # The numbers behind the decision (e.g. dynaserve's phi, probes, predicted drain times).
    decision: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a placement needs at least one stage")
        position = 0
        for index, stage in enumerate(self.stages):
            if stage.start != position or stage.end <= stage.start:
                raise ValueError(f"stage {index} [{stage.start}, {stage.end}) must be non-empty and start at {position}")
            position = stage.end

    @property
    def end(self) -> int:
        """End of the last stage: the length of the sequence the plan covers."""
        return self.stages[-1].end

    @property
    def worker_ids(self) -> tuple[str, ...]:
        """Worker of each stage, in stage order."""
        return tuple(s.worker_id for s in self.stages)

    @classmethod
    def single_stage(cls, worker: WorkerView, request: PlacementRequest, policy: str,
                     reason: str = "") -> Placement:
        """The colocated plan: the whole sequence on one worker."""
        stage = StagePlacement(worker.worker_id, worker.address, 0, request.total_len)
        return cls((stage,), policy, reason)


def place_diffusion(request: PlacementRequest, view: ClusterView) -> Placement:
    """A diffusion request (dLLM-Serve) on the eligible diffusion worker with the fewest requests
    (running, waiting and placed since its snapshot), whole: a denoising step reads the whole
    sequence, so there is no prefill to split off and no KV to move. Ties by worker id."""
    workers = view.of_family(DIFFUSION).eligible
    if not workers:
        raise NoWorkerAvailable("no diffusion worker is available for a diffusion model's request")
    best = min(workers, key=lambda w: (w.load.running + w.load.waiting + w.inflight_assigned, w.worker_id))
    return Placement.single_stage(best, request, "diffusion", "fewest requests among diffusion workers")


# Role ranks for the direction KV may flow between the stages of one request.
ROLE_RANK = {"prefill": 0, "both": 1, "decode": 2}


def worker_rank(worker: WorkerView) -> tuple[int, str]:
    """A total order on workers: by role (prefill, both, decode), then by id."""
    return ROLE_RANK.get(worker.role, 1), worker.worker_id


def orient_kv_transfers(placement: Placement, view: ClusterView) -> Placement:
    """The placement with each stage's KV pushed to the next stage only up the worker order.

    A push reserves KV blocks on the next worker before this stage runs, and the
    reservation waits there until this stage is done. If reservations could point both
    ways, two workers could each hold memory for the other's waiting stage while their
    own stages wait for memory: a deadlock (the simulator found it with the `split`
    policy under overload). Reservations only ever made on a higher-ranked worker for a
    stage of a lower-ranked one cannot form a cycle: the lowest-ranked worker's stages
    wait for nothing but its own work, and by induction every worker's do. A stage
    boundary pointing down recomputes instead (no transfer); policies that want a
    transfer put their first stage on the lower-ranked worker. Applied where every plan
    is made (the scheduler's view and the simulator), whatever the policy. (A second guard
    since: a worker grants no reservation while its own stages are short of blocks,
    `Scheduler.kv_short`, which alone breaks that cycle; tests/unit/test_kv_orientation.py.)
    """
    stages = placement.stages
    if len(stages) < 2:
        return placement
    ranks = {w.worker_id: worker_rank(w) for w in view.workers}
    oriented = []
    for index, stage in enumerate(stages):
        following = stages[index + 1] if index + 1 < len(stages) else None
        up = following is not None and stage.worker_id != following.worker_id and \
            ranks.get(stage.worker_id, (1, stage.worker_id)) < ranks.get(following.worker_id, (1, following.worker_id))
        oriented.append(stage if stage.push_kv == up else replace(stage, push_kv=up))
    return replace(placement, stages=tuple(oriented))


@dataclass(frozen=True)
class CompletionReport:
    """How a placed request ended (mirrors the CompletionReport message); fed back to policies."""

    request_id: str
    finish_reason: str  # "stop", "length", "abort" or "error"
    session_id: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float = 0.0
    mean_itl_ms: float = 0.0
    e2e_ms: float = 0.0
    worker_ids: tuple[str, ...] = ()
    error: str = ""


@runtime_checkable
class PlacementPolicy(Protocol):
    """Turns a request and a cluster view into a plan of stages (pure).

    A policy that learns from outcomes also implements `CompletionListener`.
    """

    name: str

    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        """Choose stages and workers; raise NoWorkerAvailable when no worker is eligible."""
        ...


@runtime_checkable
class CompletionListener(Protocol):
    """The optional feedback half of a policy: called once per finished request."""

    def on_completion(self, report: CompletionReport) -> None:
        """Learn from a finished request (predictors, boundaries, windows)."""
        ...


def learns_from_completions(policy: object) -> bool:
    """Whether `policy` implements CompletionListener.

    The same test isinstance(policy, CompletionListener) makes, without its cost: on a
    runtime_checkable Protocol that walks the protocol's attributes every call, which
    showed up at ~4% of a gateway's CPU when done per request.
    """
    return callable(getattr(policy, "on_completion", None))


# name -> "module:attribute" of a factory; imported on first use so this module does not
# import every policy (and so policy modules can import this one without a cycle).
_BUILTIN_POLICIES: dict[str, str] = {
    "round_robin": "services.global_scheduler.baselines:RoundRobinPolicy",
    "least_loaded": "services.global_scheduler.baselines:LeastLoadedPolicy",
    "session_affinity": "services.global_scheduler.baselines:SessionAffinityPolicy",
    "pd_disaggregated": "services.global_scheduler.disaggregated:PdDisaggregatedPolicy",
    "split": "services.global_scheduler.disaggregated:SplitPolicy",
    "dynaserve": "services.global_scheduler.dynaserve:DynaServePolicy",
    "ampd": "services.global_scheduler.ampd:AmpdPolicy",
    "laps": "services.global_scheduler.laps:LapsPlacementPolicy",
}
_REGISTERED: dict[str, Callable[..., PlacementPolicy]] = {}


def register_policy(name: str, factory: Callable[..., PlacementPolicy]) -> None:
    """Make `make_policy(name, ...)` build policies with `factory(**params)`."""
    _REGISTERED[name] = factory


def known_policies() -> list[str]:
    """Names `make_policy` accepts, sorted."""
    return sorted(set(_BUILTIN_POLICIES) | set(_REGISTERED))


def parse_policy_params(text: str, field_name: str = "policy_params") -> dict[str, str]:
    """A service option's placement parameters: a JSON object (`{"max_probes": 6}`) or
    comma-separated `key=value` pairs (`max_probes=6,perf_model=A100/qwen2.5-14b`); values
    stay strings, as `SetPolicy` receives them. ValueError names `field_name`."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{field_name}: not a JSON object: {err}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{field_name}: expected a JSON object, got {text!r}")
        return {str(key): str(value) for key, value in parsed.items()}
    params: dict[str, str] = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{field_name}: expected key=value pairs separated by commas, got {item.strip()!r}")
        params[key.strip()] = value.strip()
    return params


def configured_policy_params(policy: str, split_ratio: float, policy_params: str,
                             field_name: str = "policy_params") -> dict[str, Any]:
    """The parameters a service builds its placement policy with: `policy_params`, plus the
    older `split_ratio` option for `split` (an explicit `split_ratio` in `policy_params` wins)."""
    params: dict[str, Any] = {"split_ratio": split_ratio} if policy == "split" else {}
    params.update(parse_policy_params(policy_params, field_name))
    return params


def make_policy(name: str, *, deployment_perf_model: Any = None, **params: Any) -> PlacementPolicy:
    """Build a placement policy by name; ValueError names unknown policies or bad params.

    `deployment_perf_model`: the deployment's performance model (the simulator's, an
    emulated cluster's preset), handed to a policy that predicts with one
    (`uses_perf_model`) unless its params name another (`perf_model`)."""
    factory = _REGISTERED.get(name)
    if factory is None and name in _BUILTIN_POLICIES:
        module_name, attribute = _BUILTIN_POLICIES[name].split(":")
        factory = getattr(importlib.import_module(module_name), attribute)
    if factory is None:
        raise ValueError(f"unknown placement policy {name!r}; known: {', '.join(known_policies())}")
    if deployment_perf_model is not None and getattr(factory, "uses_perf_model", False) \
            and "perf_model" not in params:
        params = {**params, "perf_model": deployment_perf_model}
    try:
        return factory(**params)
    except TypeError as err:  # unexpected keyword: report it as bad input, not a crash
        raise ValueError(f"bad parameters for placement policy {name!r}: {err}") from None
