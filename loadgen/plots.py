"""PNG plots of a run (matplotlib, Agg backend): latency CDFs, timelines, attainment vs rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.metrics import RequestResult, Slo, meets_slo  # noqa: E402

__all__ = ["plot_latency_cdfs", "plot_timeline", "plot_attainment_vs_rate", "timeline_bins"]


def _cdf(ax: Any, values_ms: np.ndarray, label: str) -> None:
    if values_ms.size == 0:
        return
    x = np.sort(values_ms)
    ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=f"{label} (n={x.size})")


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(results: Sequence[RequestResult], slo: Slo, path: str | Path) -> Path:
    """TTFT CDF (initial and incremental rounds apart when both exist) and pooled ITL CDF, in ms."""
    ok = [r for r in results if r.ok]
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    initial = np.array([r.ttft_s for r in ok if r.ttft_s is not None and r.round_index == 0]) * 1000
    incremental = np.array([r.ttft_s for r in ok if r.ttft_s is not None and r.round_index > 0]) * 1000
    if incremental.size:
        _cdf(ax_ttft, initial, "initial")
        _cdf(ax_ttft, incremental, "incremental")
    else:
        _cdf(ax_ttft, initial, "TTFT")
    ax_ttft.axvline(slo.ttft_s * 1000, color="grey", linestyle="--", label="SLO")
    ax_ttft.set(title="TTFT", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
    itls = np.concatenate([r.itls_s for r in ok]) * 1000 if ok else np.zeros(0)
    _cdf(ax_itl, itls, "ITL")
    ax_itl.axvline(slo.itl_s * 1000, color="grey", linestyle="--", label="SLO")
    ax_itl.set(title="inter-token latency", xlabel="ms", ylabel="fraction of gaps", ylim=(0, 1.02))
    for ax in (ax_ttft, ax_itl):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    return _save(fig, path)


def timeline_bins(results: Sequence[RequestResult], slo: Slo, bin_s: float = 1.0) -> dict[str, np.ndarray]:
    """Per-bin output tokens/s (by token arrival) and SLO attainment of requests arriving in the bin."""
    if not results:
        return {"start_s": np.zeros(0), "tokens_per_s": np.zeros(0), "attainment": np.zeros(0)}
    end = max(r.end_s for r in results)
    n_bins = max(1, int(np.ceil(end / bin_s)))
    tokens = np.zeros(n_bins)
    arrived = np.zeros(n_bins)
    met = np.zeros(n_bins)
    for r in results:
        if r.ok and r.token_times_s:
            idx = np.minimum((np.asarray(r.token_times_s) / bin_s).astype(int), n_bins - 1)
            np.add.at(tokens, np.maximum(idx, 0), 1)
        b = min(max(int(r.arrival_s / bin_s), 0), n_bins - 1)
        arrived[b] += 1
        met[b] += meets_slo(r, slo)
    with np.errstate(invalid="ignore", divide="ignore"):
        attainment = np.where(arrived > 0, met / np.maximum(arrived, 1), np.nan)
    return {"start_s": np.arange(n_bins) * bin_s, "tokens_per_s": tokens / bin_s, "attainment": attainment}


def plot_timeline(results: Sequence[RequestResult], slo: Slo, path: str | Path, bin_s: float = 1.0) -> Path:
    """Output throughput and SLO attainment over the run, in ``bin_s`` bins."""
    bins = timeline_bins(results, slo, bin_s)
    fig, (ax_tp, ax_slo) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax_tp.bar(bins["start_s"], bins["tokens_per_s"], width=bin_s, align="edge", alpha=0.8)
    ax_tp.set(title=f"output throughput ({bin_s:g} s bins)", ylabel="tokens / s")
    ax_slo.plot(bins["start_s"] + bin_s / 2, bins["attainment"], marker="o", markersize=3)
    ax_slo.set(title="SLO attainment of requests arriving in each bin", xlabel="time since start (s)",
               ylabel="attainment", ylim=(-0.02, 1.02))
    for ax in (ax_tp, ax_slo):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_attainment_vs_rate(points: Sequence[dict[str, Any]], path: str | Path,
                            target_attainment: float | None = None) -> Path:
    """SLO attainment (and goodput) against the offered request rate of a sweep or capacity search."""
    points = sorted(points, key=lambda p: p["rate"])
    rates = [p["rate"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [p["attainment"] for p in points], marker="o", label="SLO attainment")
    if target_attainment is not None:
        ax.axhline(target_attainment, color="grey", linestyle="--", label=f"target {target_attainment:g}")
    ax.set(xlabel="request rate (/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02), title="attainment vs rate")
    ax.grid(alpha=0.3)
    if any(p.get("goodput_tokens_per_s") is not None for p in points):
        ax2 = ax.twinx()
        ax2.plot(rates, [p.get("goodput_tokens_per_s") or np.nan for p in points], marker="s", color="tab:orange",
                 label="goodput")
        ax2.set_ylabel("goodput (tokens / s)")
        handles = ax.get_legend_handles_labels()
        handles2 = ax2.get_legend_handles_labels()
        ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="lower left")
    else:
        ax.legend(loc="lower left")
    return _save(fig, path)
