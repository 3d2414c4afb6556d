"""Accuracy of the output-length predictor on real traces, replayed online.

Each trace is replayed in arrival order; every request is predicted before the predictor
learns its output length (online: nothing from the future). By default a request's
length is learned as soon as it arrives, the most optimistic feedback; `--tpot-ms` /
`--ttft-ms` learn it only once a request arriving later finds it finished (arrival + TTFT
+ output x TPOT), as a serving cluster would. Azure traces carry no `max_tokens`, so no
prediction is clamped.

Reported per trace and predictor variant: the share of predictions within ±100 tokens of
the actual output length (the figure DynaServe §5 gives: "over 95%"), the mean absolute
error, the share underestimated (prediction < actual: what overloads the decode side of
a split) and the share underestimated by more than 100 tokens. Variants: the prior alone
(cold start forever), one global window without prompt-length buckets, and the bucketed
model at the median and higher quantiles, each without and with the margin; `--sweep`
adds a grid over buckets per octave and window sizes at the default quantile.

    .venv/bin/python benchmarks/length_predictor_accuracy.py --out bench-results/length_predictor.json
    .venv/bin/python benchmarks/length_predictor_accuracy.py --trace path/to/AzureLLMInferenceTrace_conv.csv \
        --quantiles 0.5,0.75,0.9 --sweep --out bench-results/length_predictor.json   # writes a .png beside it
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads this file by path
from common import REPO  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from loadgen.traces import TraceRequest, read_trace  # noqa: E402
from services.global_scheduler.length_predictor import (  # noqa: E402
    DEFAULT_MARGIN,
    DEFAULT_PRIOR,
    DEFAULT_QUANTILE,
    OutputLengthPredictor,
)

console = Console(width=150)
SHARED_TRACES = REPO.parent / "shared" / "traces"
DEFAULT_TRACES = [SHARED_TRACES / "AzureLLMInferenceTrace_conv.csv", SHARED_TRACES / "AzureLLMInferenceTrace_code.csv"]
TOLERANCE = 100  # tokens: DynaServe's accuracy figure


@dataclass(frozen=True)
class Variant:
    """One predictor configuration to replay."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)  # OutputLengthPredictor keywords
    prior_only: bool = False  # never learn: the cold start forever
    bucketed: bool = True  # False: every prompt in one bucket (one global window)
    plotted: bool = False  # drawn in the error-CDF panel


@dataclass(frozen=True)
class Score:
    requests: int
    within_100: float
    mae: float
    underestimated: float
    under_by_more_than_100: float
    mean_error: float  # prediction - actual: negative means low on average


def variants(quantiles: list[float], margin: int, prior: int, sweep: bool) -> list[Variant]:
    """Prior only, one global window, then each quantile without and with the margin (and the sweep)."""
    out = [Variant(f"prior only ({prior})", {"prior": prior}, prior_only=True, plotted=True),
           Variant(f"global window, q{DEFAULT_QUANTILE:g} +{margin}",
                   {"prior": prior, "quantile": DEFAULT_QUANTILE, "margin": margin}, bucketed=False)]
    for q in quantiles:
        for m in (0, margin):
            default = q == DEFAULT_QUANTILE and m == DEFAULT_MARGIN
            out.append(Variant(f"buckets, q{q:g} +{m}" + (" (default)" if default else ""),
                               {"prior": prior, "quantile": q, "margin": m}, plotted=m == margin))
    if sweep:
        for per_octave in (1, 2, 4, 8):
            for window in (64, 128, 512):
                for min_samples in (4, 8, 32):
                    if min_samples > window:
                        continue
                    out.append(Variant(
                        f"sweep k={per_octave} w={window} min={min_samples}",
                        {"prior": prior, "quantile": DEFAULT_QUANTILE, "margin": margin,
                         "buckets_per_octave": per_octave, "window": window, "min_samples": min_samples}))
    return out


def replay(rows: list[TraceRequest], variant: Variant, ttft_s: float, tpot_s: float) -> list[int]:
    """One prediction per request, in arrival order, each made before that request is learned."""
    predictor = OutputLengthPredictor(**variant.params)
    finishing: list[tuple[float, int, int, int]] = []  # (finish time, order, prompt, output) not yet learned
    predictions = []
    for order, row in enumerate(rows):
        while finishing and finishing[0][0] <= row.arrival_s:
            _, _, prompt, output = heapq.heappop(finishing)
            predictor.observe(prompt, output)
        prompt = max(1, row.prompt_len) if variant.bucketed else 1
        predictions.append(predictor.predict(prompt))
        if not variant.prior_only:
            done = row.arrival_s + ttft_s + row.output_len * tpot_s
            if done <= row.arrival_s:  # immediate feedback: the next request already knows
                predictor.observe(prompt, row.output_len)
            else:
                heapq.heappush(finishing, (done, order, prompt, row.output_len))
    return predictions


def call_costs(rows: list[TraceRequest], repeat: int = 3) -> dict[str, float]:
    """Microseconds per `predict` and per `observe` of the default predictor over the trace (best of `repeat`)."""
    predict_us, observe_us = [], []
    for _ in range(repeat):
        predictor = OutputLengthPredictor()
        predict_s = observe_s = 0.0
        for row in rows:
            prompt = max(1, row.prompt_len)
            t0 = time.perf_counter()
            predictor.predict(prompt)
            t1 = time.perf_counter()
            predictor.observe(prompt, row.output_len)
            t2 = time.perf_counter()
            predict_s += t1 - t0
            observe_s += t2 - t1
        predict_us.append(predict_s / len(rows) * 1e6)
        observe_us.append(observe_s / len(rows) * 1e6)
    return {"predict_us": round(min(predict_us), 2), "observe_us": round(min(observe_us), 2)}


def score(predictions: list[int], rows: list[TraceRequest]) -> Score:
    errors = [p - r.output_len for p, r in zip(predictions, rows)]
    n = len(errors)
    return Score(requests=n,
                 within_100=sum(abs(e) <= TOLERANCE for e in errors) / n,
                 mae=sum(map(abs, errors)) / n,
                 underestimated=sum(e < 0 for e in errors) / n,
                 under_by_more_than_100=sum(e < -TOLERANCE for e in errors) / n,
                 mean_error=sum(errors) / n)


def print_table(trace: str, results: list[tuple[Variant, Score]]) -> None:
    table = Table(title=f"{trace}: {results[0][1].requests:,} requests, predicted online in arrival order")
    for column in ("predictor", "within ±100", "MAE", "underestimated", "under by >100", "mean error"):
        table.add_column(column, justify="left" if column == "predictor" else "right")
    for variant, s in results:
        table.add_row(variant.name, f"{s.within_100:.1%}", f"{s.mae:.1f}", f"{s.underestimated:.1%}",
                      f"{s.under_by_more_than_100:.1%}", f"{s.mean_error:+.1f}")
    console.print(table)


def plot(path: Path, traces: dict[str, list[tuple[Variant, Score]]], errors: dict[str, dict[str, list[int]]]) -> None:
    """Per trace: within ±100 / underestimated bars per variant, and the CDF of prediction errors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 2, figsize=(14, 4.2 * len(traces)), squeeze=False)
    for (trace, results), (bars, cdf) in zip(traces.items(), axes):
        shown = [(v, s) for v, s in results if not v.name.startswith("sweep ")]
        y = range(len(shown))
        bars.barh([i - 0.2 for i in y], [s.within_100 for _, s in shown], height=0.4, label="within ±100")
        bars.barh([i + 0.2 for i in y], [s.underestimated for _, s in shown], height=0.4, label="underestimated")
        bars.set_yticks(list(y), [v.name for v, _ in shown], fontsize=8)
        bars.invert_yaxis()
        bars.set_xlim(0, 1)
        bars.set_title(trace)
        bars.legend(loc="lower right", fontsize=8)
        for name, errs in errors[trace].items():
            ordered = sorted(errs)
            cdf.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
        cdf.axvspan(-TOLERANCE, TOLERANCE, color="grey", alpha=0.15)
        cdf.axvline(0, color="black", linewidth=0.5)
        cdf.set_xlim(-600, 600)
        cdf.set_xlabel("prediction - actual output tokens")
        cdf.set_ylabel("share of requests")
        cdf.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="append", type=Path,
                        help="trace file (Azure CSV or Mooncake JSONL); repeat for several. Default: the Azure "
                             "conversation and code traces in ../shared/traces")
    parser.add_argument("--quantiles", default="0.5,0.75,0.9", help="comma-separated quantiles to compare")
    parser.add_argument("--margin", type=int, default=DEFAULT_MARGIN, help="tokens added to learned predictions")
    parser.add_argument("--prior", type=int, default=DEFAULT_PRIOR, help="cold-start prediction")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="learn a request this long after it arrives ...")
    parser.add_argument("--tpot-ms", type=float, default=0.0, help="... plus this per output token (0/0: at once)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N requests of each trace")
    parser.add_argument("--sweep", action="store_true", help="also sweep buckets per octave, window, min samples")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (and the plot beside it)")
    parser.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    args = parser.parse_args(argv)

    paths = args.trace or DEFAULT_TRACES
    missing = [p for p in paths if not p.exists()]
    if missing:
        parser.error(f"trace not found: {missing[0]} (pass --trace PATH)")
    try:
        quantiles = [float(q) for q in args.quantiles.split(",") if q.strip()]
    except ValueError:
        parser.error(f"--quantiles must be comma-separated numbers, got {args.quantiles!r}")
    try:
        chosen = variants(quantiles, args.margin, args.prior, args.sweep)
        OutputLengthPredictor(**chosen[-1].params)  # bad parameters fail before the replay
    except ValueError as err:
        parser.error(str(err))

    started = time.perf_counter()
    results: dict[str, list[tuple[Variant, Score]]] = {}
    errors: dict[str, dict[str, list[int]]] = {}
    costs: dict[str, dict[str, float]] = {}
    for path in paths:
        rows = read_trace(path)
        if args.limit:
            rows = rows[:args.limit]
        trace = path.name.split(".")[0]
        results[trace], errors[trace] = [], {}
        for variant in chosen:
            predictions = replay(rows, variant, args.ttft_ms / 1000, args.tpot_ms / 1000)
            results[trace].append((variant, score(predictions, rows)))
            if variant.plotted:
                errors[trace][variant.name] = [p - r.output_len for p, r in zip(predictions, rows)]
        print_table(trace, results[trace])
        costs[trace] = call_costs(rows)
        console.print(f"default predictor: predict {costs[trace]['predict_us']:.1f} us, "
                      f"observe {costs[trace]['observe_us']:.1f} us per call (best of 3 passes)")
    elapsed = time.perf_counter() - started
    console.print(f"{sum(len(v) for v in results.values())} replays in {elapsed:.1f} s")

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "benchmark": "length_predictor_accuracy",
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "processor": platform.processor()},
            "feedback": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
            "predictor_defaults": {name: getattr(OutputLengthPredictor(), name) for name in (
                "prior", "margin", "quantile", "window", "buckets_per_octave", "min_samples", "max_tags")},
            "tolerance_tokens": TOLERANCE,
            "wall_s": round(elapsed, 2),
            "call_costs": costs,
            "traces": {trace: [{"variant": asdict(v), **asdict(s)} for v, s in rows]
                       for trace, rows in results.items()},
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.out}")
    plot_path = args.plot or (args.out.with_suffix(".png") if args.out else None)
    if plot_path:
        plot(plot_path, results, errors)
        console.print(f"wrote {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
