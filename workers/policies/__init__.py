"""Local batch policies: which queued work goes into the next engine step."""

from workers.policies.base import Batch, BatchEntry, BatchPolicy, QueuedRequest, StepBudget
from workers.policies.fcfs import FcfsPolicy

_POLICIES: dict[str, type] = {"fcfs": FcfsPolicy}


def make_batch_policy(name: str, **options) -> BatchPolicy:
    """Build a registered local batch policy by name."""
    try:
        return _POLICIES[name](**options)
    except KeyError:
        raise ValueError(f"unknown batch policy {name!r}; known: {sorted(_POLICIES)}") from None


__all__ = ["Batch", "BatchEntry", "BatchPolicy", "QueuedRequest", "StepBudget", "FcfsPolicy", "make_batch_policy"]
