"""``splitserve plan``: AMPD's deployment planner (§5) for a GPU budget; see `deploy_plan`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

__all__ = ["plan_command"]


def _env(name: str) -> str:
    return f"SPLITSERVE_PLAN_{name}"


def plan_command(
    gpus: int = typer.Option(..., "--gpus", envvar=_env("GPUS"), show_envvar=True, help="GPU budget N."),
    gpu: str = typer.Option("H100", "--gpu", envvar=_env("GPU"), show_envvar=True,
                            help="GPU preset: A100 | H100 | H200 | H20 | L40S | RTX4090."),
    model_preset: str = typer.Option("Llama-3.1-70B", "--model-preset", envvar=_env("MODEL_PRESET"),
                                     show_envvar=True, help="Model preset, e.g. llama-3.1-70b, Qwen3-32B."),
    sessions: str = typer.Option("toolbench", "--sessions", envvar=_env("SESSIONS"), show_envvar=True,
                                 help="Session preset: toolbench | gaia | hotpotqa | dureader."),
    rate: float = typer.Option(0.0, "--rate", envvar=_env("RATE"), show_envvar=True,
                               help="Session arrival rate (sessions/s); 0: half of what half the budget could "
                                    "prefill."),
    slo_ttft_ms: float = typer.Option(350.0, "--slo-ttft-ms", envvar=_env("SLO_TTFT_MS"), show_envvar=True,
                                      help="TTFT objective (ms)."),
    slo_itl_ms: float = typer.Option(40.0, "--slo-itl-ms", envvar=_env("SLO_ITL_MS"), show_envvar=True,
                                     help="ITL objective (ms)."),
    tp_degrees: str = typer.Option("1,2,4,8", "--tp-degrees", envvar=_env("TP_DEGREES"), show_envvar=True,
                                   help="TP degrees to consider (those the model fits at are used)."),
    link: str = typer.Option("rdma-400g", "--link", envvar=_env("LINK"), show_envvar=True,
                             help="KV transfer link preset."),
    top: int = typer.Option(3, "--top", envvar=_env("TOP"), show_envvar=True, help="Configurations to list."),
    sim_sessions: int = typer.Option(48, "--sim-sessions", envvar=_env("SIM_SESSIONS"), show_envvar=True,
                                     help="Sessions per load-curve simulation (resolution vs planning time)."),
    check: int = typer.Option(0, "--check", envvar=_env("CHECK"), show_envvar=True,
                              help="> 0: also simulate the top configurations as whole clusters with that many "
                                   "sessions and rank them by SLO attainment (the paper's Table 2)."),
    processes: int = typer.Option(2, "--processes", envvar=_env("PROCESSES"), show_envvar=True,
                                  help="Simulation processes."),
    seed: int = typer.Option(0, "--seed", envvar=_env("SEED"), show_envvar=True),
    out: Optional[Path] = typer.Option(None, "--out", envvar=_env("OUT"), show_envvar=True,
                                       help="Write the plan (and checks) as JSON here."),
) -> None:
    """Plan prefill/decode instance counts and TP degrees for a GPU budget (AMPD §5: an ILP over
    simulated per-replica P95 latencies, solved with HiGHS)."""
    from rich.console import Console
    from rich.table import Table

    from services.planner.deploy_plan import PlanInputs, check_plan, plan

    console = Console()
    started = time.perf_counter()
    try:
        degrees = tuple(int(x) for x in tp_degrees.split(",") if x.strip())
        inputs = PlanInputs(gpus=gpus, gpu=gpu, model=model_preset, sessions=sessions.lower(), rate=rate,
                            ttft_slo_ms=slo_ttft_ms, itl_slo_ms=slo_itl_ms, tp_degrees=degrees, link=link,
                            sim_sessions=sim_sessions, seed=seed, top=top)
        result = plan(inputs, processes=processes)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    elapsed = time.perf_counter() - started
    if not result.candidates:
        console.print(f"[red]no feasible deployment[/red] of {inputs.model} for {inputs.sessions} at "
                      f"{result.rate:.2f} sessions/s on {gpus} x {gpu}")
        raise typer.Exit(1)
    table = Table(title=f"{inputs.sessions} at {result.rate:.2f} sessions/s on {gpus} x {gpu}, {inputs.model} "
                        f"(TTFT <= {slo_ttft_ms:g} ms, ITL <= {slo_itl_ms:g} ms)")
    for column in ("rank", "deployment", "GPUs", "Z", "P95 TTFT (ms)", "P95 ITL (ms)"):
        table.add_column(column)
    for rank, cand in enumerate(result.candidates, 1):
        table.add_row(str(rank), cand.label, str(cand.gpus), f"{cand.z:.3f}", f"{cand.ttft_p95_ms:.0f}",
                      f"{cand.itl_p95_ms:.1f}")
    console.print(table)
    console.print(f"planned in {elapsed:.2f} s ({result.simulate_s:.2f} s simulating load curves, "
                  f"{result.solve_s:.2f} s in the ILP)")
    if check:
        result.checks = check_plan(result, result.candidates, sessions=check, processes=processes)
        checked = Table(title="whole-cluster simulation (ampd, adaptive routing), by SLO attainment")
        for column in ("rank", "deployment", "attainment", "planner's rank"):
            checked.add_column(column)
        for rank, row in enumerate(result.checks, 1):
            checked.add_row(str(rank), row["label"], f"{row['attainment']:.1%}", str(row["planner_rank"]))
        console.print(checked)
    if out is not None:
        payload = result.to_dict()
        payload["wall_s"] = elapsed
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1, default=str))
        console.print(f"wrote {out}")
