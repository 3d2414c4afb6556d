"""``splitserve bench``: run, sweep or capacity-search a benchmark; compare two runs.

Mounted by ``splitserve.cli.app`` (``LAZY_COMMANDS["bench"]``, loaded when looked up); also runnable
alone: ``python -c "from loadgen.cli import bench_app; bench_app()" --help``. The options it
shares with ``splitserve simulate`` (and what both do with them) are in :mod:`loadgen.options`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import typer
from rich.console import Console

from loadgen.arrivals import ArrivalProcess
from loadgen.bench_config import (
    DEFAULT_VOCAB_SIZE,
    BenchOptions,
    Workload,
    build_workload,
    describe_arrival,
    resolve_arrival,
)
from loadgen.metrics import RequestResult
from loadgen.options import build_slo, check_rate_options, report_run, run_command, run_rates, with_shared_options
from loadgen.report import LiveProgress, compare, write_json
from loadgen.runner import run_benchmark
from loadgen.targets import check_reachable, make_target, parse_target, target_tls, vocab_size_of_model

if TYPE_CHECKING:
    from splitserve.tls import ClientTls

__all__ = ["bench_app", "run_bench"]

bench_app = typer.Typer(help="Benchmark a splitserve gateway (gRPC) or any OpenAI-compatible server (HTTP).",
                        add_completion=False)
console = Console()


def _new_target(opts: BenchOptions, model: str | None = None) -> Any:
    send = opts.send_slo
    return make_target(opts.target, api_key=opts.api_key, model=opts.model or model,
                       slo_ttft_ms=round(opts.slo_ttft_ms) if send else None,
                       slo_itl_ms=round(opts.slo_itl_ms) if send else None, tls=_tls(opts), api=opts.api)


def _tls(opts: BenchOptions) -> ClientTls | None:
    return target_tls(opts.tls, opts.tls_ca_file, opts.tls_cert_file, opts.tls_key_file, opts.tls_server_name)


async def _target_info(opts: BenchOptions) -> dict[str, Any]:
    target = _new_target(opts)
    try:
        return await target.info()
    finally:
        await target.aclose()


async def _run_once(opts: BenchOptions, model: str | None, items: list, arrival: ArrivalProcess | None,
                    title: str) -> list[RequestResult]:
    target = _new_target(opts, model)  # the model id is known: no lookup inside the first request's timing
    try:
        with LiveProgress(title=title) as live:
            progress = live if opts.progress else None
            return await run_benchmark(target, items, arrival, opts.max_concurrency, opts.duration_limit_s,
                                       progress, concurrency=opts.concurrency,
                                       rng=np.random.default_rng([opts.seed, 2]))
    finally:
        await target.aclose()


def _measure(opts: BenchOptions, info: dict[str, Any], workload: Workload, vocab_size: int,
             arrival: ArrivalProcess | None, title: str, count: int | None = None) -> list[RequestResult]:
    # A fresh run tag per run: session ids never collide with an earlier run's on the server.
    items = workload.make_items(uuid.uuid4().hex[:8], vocab_size, count)
    return asyncio.run(_run_once(opts, info.get("model"), items, arrival, title))


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run what ``opts`` asks (one run, a rate sweep or a capacity search); returns the JSON record."""
    # Options are checked before the target is contacted.
    check_rate_options(opts)
    slo = build_slo(opts)
    target = parse_target(opts.target)
    make_target(opts.target, tls=_tls(opts), api=opts.api)  # options and TLS files checked before anything is sent
    workload = build_workload(opts)
    arrival = resolve_arrival(opts, workload)
    check_reachable(target)  # seconds, not a whole run of failed requests, when nothing is there
    info = asyncio.run(_target_info(opts))
    if "error" in info:
        console.print(f"[yellow]warning: cannot describe the target: {info['error']}[/]")
    vocab_size = opts.vocab_size or vocab_size_of_model(opts.model or info.get("model")) or DEFAULT_VOCAB_SIZE
    config = {"options": opts.to_dict(), "target": info, "vocab_size": vocab_size, "workload_kind": workload.kind,
              "workload": workload.description, "arrival": describe_arrival(arrival, opts.concurrency)}

    if not (opts.sweep_rates or opts.find_capacity):
        results = _measure(opts, info, workload, vocab_size, arrival, "bench")
        return report_run(opts, config, slo, "bench", results, "benchmark summary")

    def at_rate(rate: float, arrival_now: ArrivalProcess, count: int) -> tuple[list[RequestResult], dict[str, Any], str]:
        return _measure(opts, info, workload, vocab_size, arrival_now, f"rate {rate:g}/s", count), {}, ""

    return run_rates(opts, config, slo, arrival, at_rate, workload)


@with_shared_options
def bench(
    ctx: typer.Context,
    *,
    target: str = typer.Option("127.0.0.1:50051", "--target", help="gRPC gateway host:port (or grpc://host:port), "
                               "or an http(s) URL ending in /v1 for any OpenAI-compatible server. Checked before "
                               "the run: nothing answering there in 2 s is an error."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPLITSERVE_API_KEY", help="Bearer API key."),
    tls: bool = typer.Option(False, "--tls/--no-tls", envvar="SPLITSERVE_TLS", show_envvar=True,
                             help="TLS to a gRPC target, trusting the system roots unless --tls-ca-file (an https:// "
                             "URL is always TLS). Implied by any --tls-* option."),
    tls_ca_file: str = typer.Option("", "--tls-ca-file", envvar="SPLITSERVE_TLS_CA_FILE", show_envvar=True,
                                    help="The CA (PEM) that signed the server's certificate."),
    tls_cert_file: str = typer.Option("", "--tls-cert-file", envvar="SPLITSERVE_TLS_CLIENT_CERT_FILE",
                                      show_envvar=True, help="A client certificate (PEM), for a gateway run with "
                                      "--tls-client-ca-file; with --tls-key-file."),
    tls_key_file: str = typer.Option("", "--tls-key-file", envvar="SPLITSERVE_TLS_CLIENT_KEY_FILE",
                                     show_envvar=True, help="The private key (PEM) of --tls-cert-file."),
    tls_server_name: str = typer.Option("", "--tls-server-name", envvar="SPLITSERVE_TLS_SERVER_NAME",
                                        show_envvar=True, help="gRPC: check the server's certificate against this "
                                        "name instead of the target's host."),
    model: Optional[str] = typer.Option(None, "--model", help="Model id (default: the first the server lists)."),
    api: str = typer.Option("completions", "--api", envvar="SPLITSERVE_BENCH_API", show_envvar=True,
                            help="http(s) targets: completions (token-id prompts where the server takes them) | "
                            "chat (/chat/completions, the prompt as one user message's text)."),
    opts: BenchOptions,  # the options shared with `splitserve simulate` (loadgen.options) stand here
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Synthetic token ids in [0, V) (default: "
                                             "the model's when it is a local directory, else 256)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Live progress on a terminal."),
) -> None:
    """Run a benchmark (the default command)."""
    if ctx.invoked_subcommand is not None:
        return
    opts = dataclasses.replace(opts, target=target, api_key=api_key, model=model, api=api, vocab_size=vocab_size,
                               progress=progress, tls=tls, tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file,
                               tls_key_file=tls_key_file, tls_server_name=tls_server_name)
    run_command(lambda: run_bench(opts))


# The run is both the group's default (`splitserve bench ...`) and an explicit `run` command.
bench_app.callback(invoke_without_command=True)(bench)
bench_app.command("run")(bench)


@bench_app.command("compare")
def compare_command(
    a_json: Path = typer.Argument(..., exists=True, dir_okay=False, help="Baseline run JSON (A)."),
    b_json: Path = typer.Argument(..., exists=True, dir_okay=False, help="Run JSON to compare (B)."),
    json_out: Optional[Path] = typer.Option(None, "--json-out", help="Also write the ratios as JSON."),
) -> None:
    """Print every headline metric of A and B and the ratio B/A."""
    try:
        table, rows = compare(a_json, b_json)
    except ValueError as err:
        console.print(f"[red]error:[/] {err}")
        raise typer.Exit(2) from None
    console.print(table)
    if json_out:
        write_json(json_out, {"a": str(a_json), "b": str(b_json), "metrics": rows})
        console.print(f"wrote {json_out}")
