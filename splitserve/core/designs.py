"""The research designs by name: each is a placement policy and a local batch policy.

A design is both halves. `--policy dynaserve` on `splitserve up`, `simulate` and `plan`, or
`--design dynaserve` (`SPLITSERVE_DESIGN`) on `splitserve serve worker` / `serve scheduler`,
selects DynaServe's placement *and* its local batching; a batch policy (or placement) given
explicitly beside it replaces that half only, which is an ablation and is reported as one.

This table is the one place the pairs are written down; every command resolves through
`resolve_design`. The names are plain strings: placement policies live above the core
(`services/global_scheduler`), so the core only names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

__all__ = ["BASELINE_BATCH_POLICY", "BASELINE_PLACEMENT", "DESIGNS", "Design", "DesignChoice", "known_designs",
           "resolve_design"]

BASELINE_PLACEMENT = "least_loaded"
BASELINE_BATCH_POLICY = "fcfs"


@dataclass(frozen=True)
class Design:
    """One research design: its placement policy (a `make_policy` name) and its workers' local
    batch policy (a `make_batch_policy` name)."""

    name: str
    placement: str
    batch_policy: str


DESIGNS: Mapping[str, Design] = MappingProxyType({d.name: d for d in (
    # DynaServe: a split point per request (Alg. 1) + SLO-aware batch composition (Alg. 2).
    Design("dynaserve", placement="dynaserve", batch_policy="slo_aware"),
    # LAPS: short and long prefill pools (§3.2) + short/long apart in time with AWD batching (§3.1).
    Design("laps", placement="laps", batch_policy="laps"),
    # AMPD: sessions bound to a decode worker, prefills routed by Alg. 1 + look-ahead prefill reordering (Alg. 2).
    Design("ampd", placement="ampd", batch_policy="prefill_reorder"),
)})


def known_designs() -> list[str]:
    return sorted(DESIGNS)


@dataclass(frozen=True)
class DesignChoice:
    """What a command runs: the design it names ("" for none), the placement and the local batch policy."""

    design: str
    placement: str
    batch_policy: str

    @property
    def ablations(self) -> tuple[str, ...]:
        """The halves that differ from the named design's, in words ('' design: none)."""
        design = DESIGNS.get(self.design)
        if design is None:
            return ()
        out = []
        if self.placement != design.placement:
            out.append(f"placement {self.placement} instead of {design.placement}")
        if self.batch_policy != design.batch_policy:
            out.append(f"local batching {self.batch_policy} instead of {design.batch_policy}")
        return tuple(out)

    def describe(self) -> str:
        """One line for logs and tables, e.g. 'laps (placement laps, local batching laps)'."""
        halves = f"placement {self.placement}, local batching {self.batch_policy}"
        if not self.design:
            return halves
        ablations = self.ablations
        return f"{self.design} ({halves}" + (f"; ablation: {', '.join(ablations)})" if ablations else ")")


def resolve_design(policy: str | None = None, batch_policy: str | None = None, design: str | None = None) -> DesignChoice:
    """The placement and local batch policy a command runs.

    `design`: a design's name ('' / None: the one `policy` names, if it names one);
    `policy`: the placement asked for ('' / None: the design's, else least_loaded);
    `batch_policy`: the local batch policy asked for ('' / None: the design's, else fcfs).
    Explicit halves always win: that is how an ablation is spelled. ValueError names an
    unknown design (placement and batch policy names are checked where they are built).
    """
    design = (design or "").strip()
    policy = (policy or "").strip()
    batch_policy = (batch_policy or "").strip()
    if design and design not in DESIGNS:
        raise ValueError(f"design must be one of {', '.join(known_designs())} (or empty), got {design!r}")
    if not design and policy in DESIGNS:
        design = policy
    chosen = DESIGNS.get(design)
    return DesignChoice(design=design,
                        placement=policy or (chosen.placement if chosen else BASELINE_PLACEMENT),
                        batch_policy=batch_policy or (chosen.batch_policy if chosen else BASELINE_BATCH_POLICY))
