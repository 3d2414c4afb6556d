"""Local batch policies: which queued work goes into a worker's next step.

They live in the core, not in `workers/`, because the real worker, the emulated worker
and the simulator run the very same policy objects (ARCHITECTURE principle 1).
"""

from __future__ import annotations

from typing import Any

from splitserve.core.policies.fcfs import FcfsPolicy
from splitserve.core.policy import BatchPolicy

_POLICIES: dict[str, type] = {"fcfs": FcfsPolicy}


def known_batch_policies() -> list[str]:
    return sorted(_POLICIES)


def register_batch_policy(name: str, factory: type) -> None:
    """Make `make_batch_policy(name, **options)` build `factory(**options)` (plug-ins, tests)."""
    _POLICIES[name] = factory


def unregister_batch_policy(name: str) -> None:
    _POLICIES.pop(name, None)


def make_batch_policy(name: str, **options: Any) -> BatchPolicy:
    """Build a registered local batch policy by name; ValueError names unknown ones or bad options."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown batch policy {name!r}; known: {known_batch_policies()}")
    try:
        return cls(**options)
    except TypeError as err:
        raise ValueError(f"bad options for batch policy {name!r}: {err}") from None


__all__ = ["FcfsPolicy", "known_batch_policies", "make_batch_policy", "register_batch_policy",
           "unregister_batch_policy"]
