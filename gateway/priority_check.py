"""Whether a request's `priority` can be honoured: only where the workers schedule by it.

vLLM refuses a nonzero priority unless it runs `--scheduling-policy priority`; so does the
gateway, from its own `--scheduling-policy` (`SPLITSERVE_SCHEDULING_POLICY`, the one variable
the workers read too): the gateway cannot see the workers' setting, and a priority silently
ignored is worse than a 400 naming it.
"""

from __future__ import annotations

from splitserve.core.policy import PRIORITY, scheduling_policy_option
from splitserve.errors import InvalidArgument

__all__ = ["check_priority"]


def check_priority(priority: int, scheduling_policy: str) -> None:
    """InvalidArgument (400 / INVALID_ARGUMENT, param `priority`) for a nonzero priority when
    the cluster does not schedule by priority; ValueError for an unknown scheduling policy (a
    configuration error, caught at start by the same call with priority 0)."""
    policy = scheduling_policy_option(scheduling_policy)
    if priority and policy != PRIORITY:
        raise InvalidArgument(f"priority must be 0: this cluster schedules {policy}, not by priority (got "
                              f"{priority}; start it with --scheduling-policy priority to honour it)",
                              param="priority")
