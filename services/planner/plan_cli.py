"""``splitserve plan``: AMPD's deployment planner (§5) for a GPU budget; see `deploy_plan`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from splitserve.perf.backends import PERF_BACKEND_HELP, PERF_DATABASE_VERSION_HELP, PERF_FRAMEWORK_HELP

__all__ = ["plan_command"]


def _option(default, flag: str, help: str = "", **kwargs):
    """A flag with its environment variable SPLITSERVE_PLAN_<FLAG> (every option is both)."""
    env = "SPLITSERVE_PLAN_" + flag.lstrip("-").upper().replace("-", "_")
    return typer.Option(default, flag, envvar=env, show_envvar=True, help=help, **kwargs)


def plan_command(
    gpus: int = _option(..., "--gpus", help="GPU budget N."),
    gpu: str = _option("H100", "--gpu", help="GPU preset: A100 | H100 | H200 | H20 | L40S | RTX4090."),
    model_preset: str = _option("Llama-3.1-70B", "--model-preset", help="Model preset, e.g. llama-3.1-70b, Qwen3-32B."),
    sessions: str = _option("toolbench", "--sessions", help="Session preset: toolbench | gaia | hotpotqa | dureader."),
    rate: float = _option(0.0, "--rate", help="Session arrival rate (sessions/s); 0: half of what half the budget "
                                              "could prefill."),
    slo_ttft_ms: float = _option(350.0, "--slo-ttft-ms", help="TTFT objective (ms)."),
    slo_itl_ms: float = _option(40.0, "--slo-itl-ms", help="ITL objective (ms)."),
    tp_degrees: str = _option("1,2,4,8", "--tp-degrees", help="TP degrees to consider (those the model fits at are "
                                                                "used)."),
    link: str = _option("rdma-400g", "--link", help="KV transfer link preset."),
    perf_backend: str = _option("auto", "--perf-backend", help=PERF_BACKEND_HELP),
    perf_framework: str = _option("vllm", "--perf-framework", help=PERF_FRAMEWORK_HELP),
    perf_database_version: Optional[str] = _option(None, "--perf-database-version", help=PERF_DATABASE_VERSION_HELP),
    top: int = _option(3, "--top", help="Configurations to list."),
    sim_sessions: int = _option(48, "--sim-sessions", help="Sessions per load-curve simulation, at least "
                                                            "(more where its steady state needs them)."),
    check: int = _option(0, "--check", help="> 0: also simulate the top configurations as whole clusters with at "
                                            "least that many sessions (more where their steady state needs them; "
                                            "the warm-up not measured) and rank them by SLO attainment (the paper's "
                                            "Table 2)."),
    processes: int = _option(2, "--processes", help="Simulation processes."),
    seed: int = _option(0, "--seed"),
    out: Optional[Path] = _option(None, "--out", help="Write the plan (and checks) as JSON here."),
    batch_policy: str = _option("", "--batch-policy", help="The simulated workers' local batch policy; '' = AMPD's "
                                "(prefill_reorder, with the ampd placement: the whole design); another (fcfs, ...) "
                                "plans an ablation."),
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
                            perf_backend=perf_backend, perf_framework=perf_framework,
                            perf_database_version=perf_database_version,
                            sim_sessions=sim_sessions, seed=seed, top=top, batch_policy=batch_policy)
        console.print(f"design: {inputs.design.describe()}")
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
    for column in ("rank", "deployment", "GPUs", "Z", "P95 TTFT (ms)", "P95 ITL (ms)", "local prefills"):
        table.add_column(column)
    for rank, cand in enumerate(result.candidates, 1):
        table.add_row(str(rank), cand.label, str(cand.gpus), f"{cand.z:.3f}", f"{cand.ttft_p95_ms:.0f}",
                      f"{cand.itl_p95_ms:.1f}", f"{cand.local_share:.0%}")
    console.print(table)
    console.print(f"planned in {elapsed:.2f} s ({result.simulate_s:.2f} s simulating {result.simulations} load-curve "
                  f"points, {result.refined} of them refined; {result.solve_s:.2f} s in the ILP)")
    if check:
        result.checks = check_plan(result, result.candidates, sessions=check, processes=processes)
        checked = Table(title="whole-cluster simulation (ampd, adaptive routing), by SLO attainment "
                              "(ties: the lower simulated Z)")
        for column in ("rank", "deployment", "attainment", "simulated Z", "local prefills", "planner's rank"):
            checked.add_column(column)
        for rank, row in enumerate(result.checks, 1):
            checked.add_row(str(rank), row["label"], f"{row['attainment']:.1%}", f"{row['z']:.3f}",
                            f"{row['local_share']:.0%}", str(row["planner_rank"]))
        console.print(checked)
    if out is not None:
        payload = result.to_dict()
        payload["wall_s"] = elapsed
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1, default=str))
        console.print(f"wrote {out}")
