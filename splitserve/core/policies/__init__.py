"""Local batch policies: which queued work goes into a worker's next step.

They live in the core, not in `workers/`, because the real worker, the emulated worker
and the simulator run the very same policy objects (ARCHITECTURE principle 1).

`make_batch_policy(name, **options)` builds one from its options; drivers call
`build_batch_policy(name, options, perf_model=...)`, which also hands their performance
model (the emulated worker's preset, the simulator's model, a real worker's
`--perf-model`) to a policy whose constructor takes a `perf_model` its options do not set.

Every policy also takes the option `scheduling_policy` (`fcfs` | `priority`, vLLM's
`--scheduling-policy`): it is not the policy constructor's but the scheduler's, which reads it
from the built policy (`splitserve.core.policy`) to order the waiting queue and preemptions.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Mapping

from splitserve.core.policies.fcfs import FcfsPolicy
from splitserve.core.policies.laps import LapsPolicy
from splitserve.core.policies.latency_table import LatencyTable
from splitserve.core.policies.prefill_first import PrefillFirstPolicy
from splitserve.core.policies.prefill_reorder import PrefillReorderPolicy
from splitserve.core.policies.slo_aware import SloAwarePolicy
from splitserve.core.policy import FCFS, BatchPolicy, scheduling_policy_option

if TYPE_CHECKING:
    from splitserve.perf.model import PerfModel

_POLICIES: dict[str, type] = {"fcfs": FcfsPolicy, "slo_aware": SloAwarePolicy,
                               "prefill_reorder": PrefillReorderPolicy, "laps": LapsPolicy,
                               "prefill_first": PrefillFirstPolicy}


def known_batch_policies() -> list[str]:
    return sorted(_POLICIES)


def register_batch_policy(name: str, factory: type) -> None:
    """Make `make_batch_policy(name, **options)` build `factory(**options)` (plug-ins, tests)."""
    _POLICIES[name] = factory


def unregister_batch_policy(name: str) -> None:
    _POLICIES.pop(name, None)


def make_batch_policy(name: str, **options: Any) -> BatchPolicy:
    """Build a registered local batch policy by name; ValueError names unknown ones or bad options.

    `scheduling_policy` (any policy): "priority" marks the built policy so the scheduler
    orders waiting requests and preemption victims by (priority, arrival)."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown batch policy {name!r}; known: {known_batch_policies()}")
    try:
        scheduling = scheduling_policy_option(options.pop("scheduling_policy", FCFS))
        policy = cls(**options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad options for batch policy {name!r}: {err}") from None
    if scheduling != getattr(policy, "scheduling_policy", FCFS):
        try:
            policy.scheduling_policy = scheduling
        except AttributeError:  # slots or a frozen object: it cannot be told
            raise ValueError(f"bad options for batch policy {name!r}: it cannot take scheduling_policy "
                             f"{scheduling!r}") from None
    return policy


def takes_option(name: str, option: str) -> bool:
    """Whether the registered policy `name`'s constructor has a parameter `option`."""
    cls = _POLICIES.get(name)
    if cls is None:
        return False
    try:
        return option in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a factory without an inspectable signature
        return False


def build_batch_policy(name: str, options: Mapping[str, Any] | None = None, *,
                       perf_model: PerfModel | None = None) -> BatchPolicy:
    """A driver's policy: `make_batch_policy(name, **options)`, given the driver's `perf_model`
    when the policy takes one and `options` set none (policies that predict step latency
    start from it; others never see it)."""
    options = dict(options or {})
    if perf_model is not None and options.get("perf_model") in (None, "") and takes_option(name, "perf_model"):
        options["perf_model"] = perf_model
    return make_batch_policy(name, **options)


__all__ = ["FcfsPolicy", "LapsPolicy", "LatencyTable", "PrefillFirstPolicy", "PrefillReorderPolicy", "SloAwarePolicy", "build_batch_policy", "known_batch_policies",
           "make_batch_policy", "register_batch_policy", "takes_option", "unregister_batch_policy"]
