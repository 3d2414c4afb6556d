"""Option parsing shared by the local batch policies: options arrive as numbers or as text
(CLI flags, environment variables, the simulator's `batch_policy_options`), and a bad one is
a ValueError naming the option and its limits."""

from __future__ import annotations

import json
import math
from typing import Any

from splitserve.perf.model import PerfModel

__all__ = ["number_option", "perf_model_option"]


def number_option(name: str, value: Any, *, minimum: float, maximum: float = math.inf, integer: bool = False,
            allow_none: bool = False, allow_inf: bool = False) -> Any:
    """A policy option as a number in [minimum, maximum]; `allow_none`: None or "none" / "" is
    None (the caller's default); `allow_inf`: None, inf, "inf", "none", "off" or "" is inf (a
    bound switched off)."""
    if allow_inf and (value is None or (isinstance(value, str) and value.strip().lower() in ("inf", "none", "off", ""))
                      or (isinstance(value, float) and value == math.inf)):
        return math.inf
    if value is None or (allow_none and isinstance(value, str) and value.strip().lower() in ("", "none")):
        if allow_none:
            return None
        raise ValueError(f"{name} must be a number, got None")
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(number) and minimum <= number <= maximum) or (integer and number != int(number)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} in [{minimum:g}, {maximum:g}], got {value!r}")
    return int(number) if integer else number


def perf_model_option(value: Any) -> PerfModel | None:
    if value is None or isinstance(value, PerfModel):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"perf_model: not a perf model's JSON text ({err}); drivers load files") from None
    if isinstance(value, dict):
        try:
            return PerfModel.from_dict(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"perf_model: {err}") from None
    raise ValueError(f"perf_model must be a PerfModel, its to_dict() or its JSON text, got {type(value).__name__}")


def flag_option(name: str, value: bool | str) -> bool:
    """A boolean option given as a bool or as text (true/false, 1/0, yes/no, on/off); a
    ValueError names the option."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")
