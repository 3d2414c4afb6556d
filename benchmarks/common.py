"""What the benchmarks share: the repository root on sys.path, and percentiles.

A benchmark imports it first, `from common import REPO` (benchmarks/ is sys.path[0] when it
runs as `python benchmarks/x.py`); importing it puts the repository first on sys.path, so the
project's packages come from this checkout even under a Python that has not installed them.
A benchmark that a test loads by its file path puts its own folder on sys.path first, since
the folder is not there then.

The benchmarks report percentiles by three definitions, each kept so that a result stays
comparable with its earlier runs; all take q in [0, 100] and give nan for no values:
* `percentile_linear`: linear interpolation between the two nearest ranks (numpy's default
  method, computed without numpy: equal to `np.percentile` but for the last bit);
* `percentile_round_rank`: the value at rank round(q/100 * (n - 1)) (no interpolation);
* `percentile_floor_rank`: the value at rank floor(q/100 * n), the last one at most.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def percentile_linear(values: Iterable[float], q: float) -> float:
    """The q-th percentile, interpolating linearly between the two nearest ranks."""
    s = sorted(values)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def percentile_round_rank(values: Iterable[float], q: float) -> float:
    """The value at rank round(q/100 * (n - 1)) of the sorted values (0-based)."""
    s = sorted(values)
    if not s:
        return math.nan
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def percentile_floor_rank(values: Iterable[float], q: float) -> float:
    """The value at rank floor(q/100 * n) of the sorted values (0-based), the last one at most."""
    s = sorted(values)
    if not s:
        return math.nan
    return s[min(len(s) - 1, int(q / 100 * len(s)))]
