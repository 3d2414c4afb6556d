"""Global scheduler: placement policies (pure) and the GlobalScheduler gRPC service.

Importing the package pulls in only the pure policy modules; the service lives in
`services.global_scheduler.server`.
"""

from services.global_scheduler.baselines import LeastLoadedPolicy, RoundRobinPolicy
from services.global_scheduler.policy import (
    ClusterView,
    CompletionListener,
    CompletionReport,
    NoWorkerAvailable,
    Placement,
    PlacementPolicy,
    PlacementRequest,
    StagePlacement,
    WorkerView,
    known_policies,
    make_policy,
    register_policy,
)

__all__ = [
    "ClusterView",
    "CompletionListener",
    "CompletionReport",
    "LeastLoadedPolicy",
    "NoWorkerAvailable",
    "Placement",
    "PlacementPolicy",
    "PlacementRequest",
    "RoundRobinPolicy",
    "StagePlacement",
    "WorkerView",
    "known_policies",
    "make_policy",
    "register_policy",
]
