"""The `splitserve chaos` command (mounted by splitserve/cli/app.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from loadgen.targets import target_tls
from splitserve.cli.chaos.options import ChaosError, ChaosOptions
from splitserve.cli.chaos.report import render_report, write_json
from splitserve.cli.chaos.run import run_chaos

if TYPE_CHECKING:  # splitserve.tls imports grpc; `splitserve simulate` mounts this module without it
    from splitserve.tls import ClientTls


# ---- the command (mounted by splitserve/cli/app.py) -----------------------------------------


def _internal_tls(ca_file: str, cert_file: str, key_file: str, server_name: str) -> ClientTls | None:
    """The services' mTLS (the same three files as the cluster's); ValueError naming an option."""
    if not (ca_file or cert_file or key_file):
        if server_name:
            raise ValueError("mtls_server_name: needs --mtls-ca-file, --mtls-cert-file and --mtls-key-file")
        return None
    if not (ca_file and cert_file and key_file):
        missing = next(name for name, value in (("mtls_ca_file", ca_file), ("mtls_cert_file", cert_file),
                                                ("mtls_key_file", key_file)) if not value)
        raise ValueError(f"{missing}: mTLS needs --mtls-ca-file, --mtls-cert-file and --mtls-key-file together")
    from splitserve.tls import ClientTls, channel_credentials

    channel_credentials(ca_file, cert_file, key_file, fields=("mtls_ca_file", "mtls_cert_file", "mtls_key_file"))
    return ClientTls(ca_file, cert_file, key_file, server_name)


def _pair(text: str, name: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(",")
    try:
        values = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ValueError(f"{name}: expected MIN,MAX (integers), got {text!r}") from None
    return values


def chaos_command(
    target: str = typer.Option("127.0.0.1:50051", "--target", help="The gateway's gRPC address (loopback only)."),
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", "--redis-url", envvar="SPLITSERVE_REDIS_URL",
                                   help="The cluster's Redis (loopback only)."),
    redis_prefix: str = typer.Option("ss:", "--redis-prefix", envvar="SPLITSERVE_REDIS_PREFIX",
                                      help="The cluster's Redis prefix: it names the cluster's processes."),
    seed: int = typer.Option(0, "--seed", help="Seeds the cases, the arrivals and the fault schedule."),
    duration_s: float = typer.Option(60.0, "--duration-s", help="Seconds of traffic; every fault falls within."),
    warmup_s: float = typer.Option(3.0, "--warmup-s", help="No fault before this many seconds of traffic."),
    settle_s: float = typer.Option(5.0, "--settle-s", help="No fault planned in the last this many seconds."),
    worker_kills: int = typer.Option(3, "--worker-kills", help="Workers to SIGKILL (a random live one each time)."),
    coordinator_kills: int = typer.Option(0, "--coordinator-kills", help="Times to SIGKILL the coordinator."),
    redis_kills: int = typer.Option(0, "--redis-kills", help="Times to SIGKILL Redis (restarted by `splitserve up` "
                                     "when it started it, else by this command; refused unless the Redis holds only "
                                     "this cluster's keys)."),
    rate: float = typer.Option(4.0, "--rate", help="Requests per second (Poisson)."),
    cases: int = typer.Option(12, "--cases", help="Distinct requests (half greedy, half sampled with a fixed seed)."),
    max_tokens: str = typer.Option("16,48", "--max-tokens", help="MIN,MAX tokens per case."),
    prompt_words: str = typer.Option("4,24", "--prompt-words", help="MIN,MAX words per prompt."),
    max_attempts: int = typer.Option(6, "--max-attempts", help="Attempts per request (retriable errors only)."),
    attempt_timeout_s: float = typer.Option(60.0, "--attempt-timeout-s", help="Deadline of one attempt."),
    recovery_timeout_s: float = typer.Option(90.0, "--recovery-timeout-s",
                                              help="A killed service must be back within this."),
    min_live_workers: int = typer.Option(1, "--min-live-workers",
                                         help="Kill a worker only while more than this many others are up."),
    drain_timeout_s: float = typer.Option(120.0, "--drain-timeout-s",
                                           help="After the traffic, the longest wait for requests still running."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPLITSERVE_API_KEY",
                                           help="API key for the gateway."),
    tls: bool = typer.Option(False, "--tls/--no-tls", envvar="SPLITSERVE_TLS", show_envvar=True,
                             help="TLS to the gateway (implied by any --tls-* option)."),
    tls_ca_file: str = typer.Option("", "--tls-ca-file", envvar="SPLITSERVE_TLS_CA_FILE", show_envvar=True,
                                    help="The CA (PEM) that signed the gateway's certificate."),
    tls_cert_file: str = typer.Option("", "--tls-cert-file", envvar="SPLITSERVE_TLS_CLIENT_CERT_FILE",
                                      show_envvar=True, help="A client certificate (PEM) for the gateway."),
    tls_key_file: str = typer.Option("", "--tls-key-file", envvar="SPLITSERVE_TLS_CLIENT_KEY_FILE",
                                     show_envvar=True, help="The private key (PEM) of --tls-cert-file."),
    tls_server_name: str = typer.Option("", "--tls-server-name", envvar="SPLITSERVE_TLS_SERVER_NAME",
                                        show_envvar=True, help="Check the gateway's certificate against this name."),
    mtls_ca_file: str = typer.Option("", "--mtls-ca-file", envvar="SPLITSERVE_MTLS_CA_FILE", show_envvar=True,
                                     help="The cluster's mTLS CA: health checks of restarted services dial with it."),
    mtls_cert_file: str = typer.Option("", "--mtls-cert-file", envvar="SPLITSERVE_MTLS_CERT_FILE",
                                       show_envvar=True, help="mTLS: the certificate presented to the services."),
    mtls_key_file: str = typer.Option("", "--mtls-key-file", envvar="SPLITSERVE_MTLS_KEY_FILE", show_envvar=True,
                                      help="mTLS: the private key of --mtls-cert-file."),
    mtls_server_name: str = typer.Option("", "--mtls-server-name", envvar="SPLITSERVE_MTLS_SERVER_NAME",
                                         show_envvar=True, help="mTLS: the name services' certificates are "
                                         "checked against."),
    out: Path = typer.Option(Path(".splitserve/chaos-report.json"), "--out", help="JSON report ('-': stdout)."),
) -> None:
    """Kill workers (and optionally the coordinator and Redis) of a running `splitserve up` cluster on a
    seeded schedule while requests with known outputs run; report completed, retried, failed, mismatched."""
    import typer
    from rich.console import Console

    console = Console(stderr=str(out) == "-")
    try:
        options = ChaosOptions(
            target=target, redis_url=redis_url, redis_prefix=redis_prefix, seed=seed, duration_s=duration_s,
            warmup_s=warmup_s, settle_s=settle_s,
            worker_kills=worker_kills, coordinator_kills=coordinator_kills, redis_kills=redis_kills, rate=rate,
            cases=cases, max_tokens=_pair(max_tokens, "--max-tokens"),
            prompt_words=_pair(prompt_words, "--prompt-words"), max_attempts=max_attempts,
            attempt_timeout_s=attempt_timeout_s, recovery_timeout_s=recovery_timeout_s,
            min_live_workers=min_live_workers, drain_timeout_s=drain_timeout_s, api_key=api_key,
            gateway_tls=target_tls(tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name),
            internal_tls=_internal_tls(mtls_ca_file, mtls_cert_file, mtls_key_file, mtls_server_name))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    try:
        report = run_chaos(options, log=lambda line: console.print(line, highlight=False))
    except ChaosError as err:
        console.print(f"[red]chaos: {err}[/red]")
        raise typer.Exit(2)
    console.print(render_report(report))
    write_json(report, out)
    if str(out) != "-":
        console.print(f"JSON report: {out}")
    if report.redis_started_by_chaos:
        console.print(f"redis-server restarted by chaos (pids {report.redis_started_by_chaos}) keeps running for the "
                      f"cluster; `splitserve up` does not stop it")
    if not report.ok:
        raise typer.Exit(1)
