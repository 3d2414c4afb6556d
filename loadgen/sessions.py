"""AMPD-style multi-round (agentic) sessions.

A session is a sequence of rounds. Round 0 is the *initial* prompt (no history);
every later round is an *incremental* prefill: a tool result / user turn of
``incr_prompt_len`` tokens appended to everything before it (all earlier prompts and
outputs), sent ``delay_before_s`` after the previous round's last token (the tool call).

Distributions (chosen so large-sample means match the published preset means):

* rounds per session: fixed when the published mean is an integer (HotpotQA, DuReader:
  3), otherwise ``1 + Poisson(mean - 1)`` -- at least one round, exact mean, variance
  ``mean - 1``;
* per-round incremental prompt and output lengths: independent lognormals with the
  published mean and log-space sigma ``length_sigma`` (default 0.6, CV ~ 0.66), i.e.
  ``mu = ln(mean) - sigma**2 / 2``; the same distribution for the initial and the
  incremental rounds, since the presets publish a single per-round mean. Samples are
  multiplied by ``length_scale``, then rounded and clamped to >= 1;
* tool-call delay before rounds >= 1: exponential with mean 1 s by default
  (:class:`ToolDelay`), 0 before round 0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Literal, Mapping, Sequence

import numpy as np

__all__ = [
    "SessionPreset",
    "PRESETS",
    "ToolDelay",
    "parse_tool_delay",
    "Round",
    "Session",
    "SessionStats",
    "generate_sessions",
    "session_stats",
]


@dataclass(frozen=True, slots=True)
class SessionPreset:
    """Published per-session means: rounds, prefill tokens per round, decode tokens per round."""

    name: str
    mean_rounds: float
    mean_prefill_tokens: float
    mean_decode_tokens: float
    length_sigma: float = 0.6

    def __post_init__(self) -> None:
        if not self.mean_rounds >= 1:
            raise ValueError(f"mean_rounds: must be >= 1, got {self.mean_rounds}")
        for name in ("mean_prefill_tokens", "mean_decode_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not self.length_sigma >= 0:
            raise ValueError(f"length_sigma: must be >= 0, got {self.length_sigma}")


# Means published with AMPD for its four agentic workloads.
PRESETS: Mapping[str, SessionPreset] = MappingProxyType(
    {
        "toolbench": SessionPreset("toolbench", 3.96, 703.79, 50.39),
        "gaia": SessionPreset("gaia", 11.32, 6161.02, 528.76),
        "hotpotqa": SessionPreset("hotpotqa", 3.0, 1569.8, 80.03),
        "dureader": SessionPreset("dureader", 3.0, 3081.23, 150.10),
    }
)


@dataclass(frozen=True, slots=True)
class ToolDelay:
    """Distribution of the tool-call delay between rounds: exponential, constant or none."""

    kind: Literal["exponential", "constant", "none"] = "exponential"
    mean_s: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("exponential", "constant", "none"):
            raise ValueError(f"kind: unknown tool delay {self.kind!r}")
        if not (self.mean_s >= 0 and math.isfinite(self.mean_s)):
            raise ValueError(f"mean_s: must be a finite number >= 0, got {self.mean_s}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` delays in seconds."""
        if self.kind == "none" or self.mean_s == 0:
            return np.zeros(n)
        if self.kind == "constant":
            return np.full(n, float(self.mean_s))
        return rng.exponential(self.mean_s, size=n)


def parse_tool_delay(spec: str) -> ToolDelay:
    """Parse ``"exponential:mean=1"``, ``"constant:mean=0.5"`` or ``"none"``."""
    kind, _, body = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind == "none":
        return ToolDelay("none", 0.0)
    if kind not in ("exponential", "constant"):
        raise ValueError(f"kind: unknown tool delay {kind!r} (expected exponential, constant or none)")
    mean_s = 1.0
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = item.partition("=")
        if key.strip().lower() != "mean" or not eq:
            raise ValueError(f"{key.strip()}: unknown field for {kind} (expected mean=SECONDS)")
        try:
            mean_s = float(value)
        except ValueError:
            raise ValueError(f"mean: not a number: {value!r}") from None
    return ToolDelay(kind, mean_s)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Round:
    """One round: new prompt tokens, tokens to generate, delay after the previous round."""

    incr_prompt_len: int
    output_len: int
    delay_before_s: float


@dataclass
class Session:
    """A multi-round session; ``rounds[0]`` is the initial prompt, the rest incremental."""

    session_id: str
    rounds: list[Round]

    def history_len(self, round_index: int) -> int:
        """Tokens already in context when round ``round_index`` starts (earlier prompts + outputs)."""
        return sum(r.incr_prompt_len + r.output_len for r in self.rounds[:round_index])

    def context_len(self, round_index: int) -> int:
        """History plus this round's incremental prompt: the prompt length the model sees."""
        return self.history_len(round_index) + self.rounds[round_index].incr_prompt_len


def _sample_rounds(mean_rounds: float, n: int, rng: np.random.Generator) -> np.ndarray:
    if float(mean_rounds).is_integer():
        return np.full(n, int(mean_rounds), dtype=np.int64)
    return 1 + rng.poisson(mean_rounds - 1.0, size=n)


def _sample_lengths(mean: float, sigma: float, scale: float, n: int, rng: np.random.Generator) -> np.ndarray:
    # Lognormal mean is exp(mu + sigma^2/2); solve for mu so the mean is the published one.
    mu = math.log(mean) - sigma * sigma / 2.0
    raw = rng.lognormal(mu, sigma, size=n) * scale
    return np.maximum(1, np.rint(raw)).astype(np.int64)


def generate_sessions(
    preset: str | SessionPreset,
    n: int,
    rng: np.random.Generator,
    length_scale: float = 1.0,
    tool_delay: ToolDelay = ToolDelay(),
) -> list[Session]:
    """Draw ``n`` sessions from ``preset`` (a :class:`SessionPreset` or a name in :data:`PRESETS`)."""
    if isinstance(preset, str):
        try:
            preset = PRESETS[preset.lower()]
        except KeyError:
            raise ValueError(f"preset: unknown session preset {preset!r} (expected one of {sorted(PRESETS)})") from None
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if not (length_scale > 0 and math.isfinite(length_scale)):
        raise ValueError(f"length_scale: must be a finite number > 0, got {length_scale!r}")

    # Draw each quantity in one vectorised call, in a fixed order, so a seed pins everything.
    rounds = _sample_rounds(preset.mean_rounds, n, rng)
    total = int(rounds.sum())
    prompts = _sample_lengths(preset.mean_prefill_tokens, preset.length_sigma, length_scale, total, rng)
    outputs = _sample_lengths(preset.mean_decode_tokens, preset.length_sigma, length_scale, total, rng)
    delays = tool_delay.sample(total, rng)

    sessions: list[Session] = []
    start = 0
    for i, k in enumerate(rounds.tolist()):
        sessions.append(
            Session(
                session_id=f"{preset.name}-{i}",
                rounds=[
                    Round(
                        incr_prompt_len=int(prompts[j]),
                        output_len=int(outputs[j]),
                        delay_before_s=0.0 if j == start else float(delays[j]),
                    )
                    for j in range(start, start + k)
                ],
            )
        )
        start += k
    return sessions


@dataclass(frozen=True, slots=True)
class SessionStats:
    """Sample means of a set of sessions, comparable with a :class:`SessionPreset`."""

    n_sessions: int
    n_rounds: int
    mean_rounds: float
    mean_prefill_tokens: float
    mean_decode_tokens: float
    mean_delay_s: float

    def to_dict(self) -> dict[str, float | int]:
        """JSON-able view."""
        return asdict(self)


def session_stats(sessions: Sequence[Session]) -> SessionStats:
    """Per-session round count and per-round length/delay means (delays over rounds >= 1)."""
    rounds = [r for s in sessions for r in s.rounds]
    delays = [r.delay_before_s for s in sessions for r in s.rounds[1:]]
    nan = float("nan")
    return SessionStats(
        n_sessions=len(sessions),
        n_rounds=len(rounds),
        mean_rounds=len(rounds) / len(sessions) if sessions else nan,
        mean_prefill_tokens=float(np.mean([r.incr_prompt_len for r in rounds])) if rounds else nan,
        mean_decode_tokens=float(np.mean([r.output_len for r in rounds])) if rounds else nan,
        mean_delay_s=float(np.mean(delays)) if delays else nan,
    )
