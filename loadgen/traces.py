"""Readers for real request traces (Azure LLM inference 2023 CSV, Mooncake JSONL).

Both formats become a list of :class:`TraceRequest`, sorted by arrival, with
``arrival_s`` relative to the earliest request. Any path is accepted; the format is
taken from the extension (``.csv`` / ``.jsonl`` / ``.json``, optionally ``.gz``) and,
failing that, from the first non-empty line.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Iterable, Literal, Sequence

__all__ = [
    "TraceRequest",
    "MOONCAKE_BLOCK_TOKENS",
    "read_trace",
    "read_azure_csv",
    "read_mooncake_jsonl",
    "detect_format",
    "scale_lengths",
    "limit",
]

TraceFormat = Literal["azure", "mooncake"]

# One Mooncake ``hash_ids`` entry stands for one 512-token block of the prompt.
MOONCAKE_BLOCK_TOKENS = 512

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_ONE_SECOND = timedelta(seconds=1)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One traced request: arrival (s from the first), lengths and prefix blocks.

    ``prefix_block_ids`` holds Mooncake hash ids (one per ``block_tokens`` prompt
    tokens; equal leading ids mean a shared prefix); Azure rows have none and
    ``block_tokens == 0``. ``length_scale`` records the factor applied by
    :func:`scale_lengths` so reports can state it.
    """

    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_block_ids: tuple[int, ...] = ()
    block_tokens: int = 0
    length_scale: float = 1.0


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def detect_format(path: str | Path) -> TraceFormat:
    """Tell Azure CSV from Mooncake JSONL by extension, else by the first line."""
    path = Path(path)
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    if suffixes and suffixes[-1] == ".csv":
        return "azure"
    if suffixes and suffixes[-1] in (".jsonl", ".json"):
        return "mooncake"
    with _open_text(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                return "mooncake"
            if line.split(",")[0].strip().upper() == "TIMESTAMP":
                return "azure"
            break
    raise ValueError(f"{path}: cannot tell the trace format (expected Azure CSV or Mooncake JSONL)")


def read_trace(path: str | Path, fmt: TraceFormat | None = None) -> list[TraceRequest]:
    """Read any supported trace file, auto-detecting its format unless ``fmt`` is given."""
    fmt = fmt or detect_format(path)
    if fmt == "azure":
        return read_azure_csv(path)
    if fmt == "mooncake":
        return read_mooncake_jsonl(path)
    raise ValueError(f"fmt: unknown trace format {fmt!r}")


def _parse_wallclock(text: str) -> tuple[int, float]:
    """Whole seconds since a naive epoch and the fraction, keeping every fractional digit.

    Azure writes 7 fractional digits (``2023-11-16 18:17:03.9799600``), one more than
    ``datetime`` holds, so the whole seconds and the fraction are parsed apart; keeping
    them apart also avoids float64's ~0.2 us resolution at epoch magnitudes.
    """
    whole, _, frac = text.strip().partition(".")
    # Only differences matter, so the naive timestamp's epoch is irrelevant.
    seconds = (datetime.fromisoformat(whole) - datetime(1970, 1, 1)) // _ONE_SECOND
    fraction = 0.0
    if frac:
        if not (frac.isascii() and frac.isdigit()):
            raise ValueError(f"bad fractional seconds in {text!r}")
        fraction = int(frac) / 10 ** len(frac)
    return seconds, fraction


def _parse_count(field: str, text: str, where: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {field}: not an integer: {text!r}") from None
    if value < 0:
        raise ValueError(f"{where}: {field}: must be >= 0, got {value}")
    return value


def _relative_sorted(rows: list[TraceRequest], absolute: list[float]) -> list[TraceRequest]:
    """Sort by arrival (stable, so ties keep file order) and shift to start at 0."""
    if not rows:
        return []
    order = sorted(range(len(rows)), key=absolute.__getitem__)
    t0 = absolute[order[0]]
    return [replace(rows[i], arrival_s=absolute[i] - t0) for i in order]


def read_azure_csv(path: str | Path) -> list[TraceRequest]:
    """Read an Azure 2023 trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    path = Path(path)
    rows: list[TraceRequest] = []
    absolute: list[float] = []
    base_s: int | None = None  # whole seconds of the first row, subtracted early for precision
    with _open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return []
        names = [h.strip() for h in header]
        missing = [c for c in _AZURE_COLUMNS if c not in names]
        if missing:
            raise ValueError(f"{path}: header lacks column(s) {missing}")
        i_ts, i_ctx, i_gen = (names.index(c) for c in _AZURE_COLUMNS)
        for line_no, rec in enumerate(reader, start=2):
            if not rec:
                continue
            where = f"{path}:{line_no}"
            try:
                seconds, fraction = _parse_wallclock(rec[i_ts])
            except (ValueError, TypeError, IndexError) as exc:
                raise ValueError(f"{where}: TIMESTAMP: {exc}") from None
            if base_s is None:
                base_s = seconds
            absolute.append((seconds - base_s) + fraction)
            rows.append(
                TraceRequest(
                    arrival_s=0.0,
                    prompt_len=_parse_count("ContextTokens", rec[i_ctx], where),
                    output_len=_parse_count("GeneratedTokens", rec[i_gen], where),
                )
            )
    return _relative_sorted(rows, absolute)


def read_mooncake_jsonl(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Read a Mooncake trace (JSONL: ``timestamp`` ms, lengths, ``hash_ids``)."""
    path = Path(path)
    rows: list[TraceRequest] = []
    absolute: list[float] = []
    with _open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON: {exc.msg}") from None
            for key in ("timestamp", "input_length", "output_length"):
                if key not in rec:
                    raise ValueError(f"{where}: {key}: missing")
            ts = rec["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise ValueError(f"{where}: timestamp: not a finite number: {ts!r}")
            hash_ids = rec.get("hash_ids", [])
            if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
                raise ValueError(f"{where}: hash_ids: must be a list of integers")
            absolute.append(ts / 1000.0)
            rows.append(
                TraceRequest(
                    arrival_s=0.0,
                    prompt_len=_parse_count("input_length", rec["input_length"], where),
                    output_len=_parse_count("output_length", rec["output_length"], where),
                    prefix_block_ids=tuple(hash_ids),
                    block_tokens=block_tokens,
                )
            )
    return _relative_sorted(rows, absolute)


def scale_lengths(
    requests: Iterable[TraceRequest],
    length_scale: float,
    min_prompt: int = 1,
    min_output: int = 1,
) -> list[TraceRequest]:
    """Multiply prompt/output lengths (and block size) by ``length_scale``, rounded and clamped.

    Lengths become ``max(min_*, round(len * length_scale))``; Mooncake blocks keep
    their ids but shrink to ``max(1, round(block_tokens * length_scale))`` tokens so
    prefix sharing survives the scaling. The factor is multiplied into
    ``length_scale`` on each request so it can be reported.
    """
    length_scale = float(length_scale)
    if not (length_scale > 0 and math.isfinite(length_scale)):
        raise ValueError(f"length_scale: must be a finite number > 0, got {length_scale!r}")
    if min_prompt < 0 or min_output < 0:
        raise ValueError("min_prompt/min_output: must be >= 0")
    return [
        replace(
            r,
            prompt_len=max(min_prompt, round(r.prompt_len * length_scale)),
            output_len=max(min_output, round(r.output_len * length_scale)),
            block_tokens=max(1, round(r.block_tokens * length_scale)) if r.block_tokens else 0,
            length_scale=r.length_scale * length_scale,
        )
        for r in requests
    ]


def limit(
    requests: Sequence[TraceRequest],
    n: int | None = None,
    duration_s: float | None = None,
) -> list[TraceRequest]:
    """Keep the first ``n`` requests and/or those arriving before ``duration_s``."""
    if n is not None and n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if duration_s is not None and not duration_s >= 0:
        raise ValueError(f"duration_s: must be >= 0, got {duration_s}")
    out = list(requests) if n is None else list(requests[:n])
    if duration_s is not None:
        out = [r for r in out if r.arrival_s < duration_s]
    return out
