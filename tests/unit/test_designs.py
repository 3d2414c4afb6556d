"""A design's name selects the whole design (placement and local batching) in `splitserve up`,
`serve` and `simulate`; a batch policy given beside it is an ablation, spelled out."""

from __future__ import annotations

import json
import signal

import pytest
from typer.testing import CliRunner

from services.global_scheduler.policy import known_policies
from splitserve.core import known_batch_policies
from splitserve.core.designs import DESIGNS, known_designs, resolve_design


# ---- the table -----------------------------------------------------------------------------------

def test_each_design_is_its_placement_and_its_local_batch_policy():
    pairs = {name: (d.placement, d.batch_policy) for name, d in DESIGNS.items()}
    assert pairs == {"dynaserve": ("dynaserve", "slo_aware"), "laps": ("laps", "laps"),
                     "ampd": ("ampd", "prefill_reorder")}
    for design in DESIGNS.values():  # every name is one the registries build
        assert design.placement in known_policies() and design.batch_policy in known_batch_policies()


@pytest.mark.parametrize("policy, batch_policy, design, expected", [
    ("laps", None, None, ("laps", "laps", "laps")),
    ("dynaserve", "", None, ("dynaserve", "dynaserve", "slo_aware")),
    ("ampd", None, "", ("ampd", "ampd", "prefill_reorder")),
    ("least_loaded", None, None, ("", "least_loaded", "fcfs")),  # a baseline: fcfs
    (None, None, None, ("", "least_loaded", "fcfs")),
    ("dynaserve", "fcfs", None, ("dynaserve", "dynaserve", "fcfs")),  # an explicit half wins: an ablation
    (None, None, "laps", ("laps", "laps", "laps")),  # serve: --design alone
    ("pd_disaggregated", None, "laps", ("laps", "pd_disaggregated", "laps")),
])
def test_resolution(policy, batch_policy, design, expected):
    choice = resolve_design(policy, batch_policy, design)
    assert (choice.design, choice.placement, choice.batch_policy) == expected


def test_ablations_are_spelled_out():
    assert resolve_design("laps").describe() == "laps (placement laps, local batching laps)"
    assert resolve_design("dynaserve", "fcfs").describe() == (
        "dynaserve (placement dynaserve, local batching fcfs; ablation: local batching fcfs instead of slo_aware)")
    assert resolve_design("round_robin", "slo_aware").describe() == "placement round_robin, local batching slo_aware"


def test_an_unknown_design_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"design must be one of ampd, dynaserve, laps \(or empty\), got 'dyna'"):
        resolve_design(design="dyna")
    assert known_designs() == ["ampd", "dynaserve", "laps"]


# ---- splitserve up ------------------------------------------------------------------------------

@pytest.fixture
def captured_up(monkeypatch, tmp_path):
    """Runs `splitserve up ARGS` up to the cluster's start, which it records instead of doing."""
    import splitserve.cli.launcher as launcher
    from splitserve.cli.app import app

    specs = []

    def record(spec, *args, **kwargs):
        specs.append(spec)
        raise ValueError("recorded, not started")

    monkeypatch.setattr(launcher, "start_cluster", record)
    previous = signal.getsignal(signal.SIGTERM)

    def run(*args):
        try:
            result = CliRunner().invoke(app, ["up", "--backend", "emulated", "--model", str(tmp_path / "m"),
                                              "--log-dir", str(tmp_path / "logs"), *args])
        finally:
            signal.signal(signal.SIGTERM, previous)  # `up` installs its own handler
        assert result.exit_code == 1 and "recorded, not started" in result.output, result.output
        return specs[-1]
    return run


@pytest.mark.parametrize("args, batch_policy", [
    (["--policy", "laps"], "laps"),
    (["--policy", "dynaserve"], "slo_aware"),
    (["--policy", "ampd", "--workers", "3", "--prefill-workers", "1"], "prefill_reorder"),
    (["--policy", "least_loaded"], "fcfs"),
    (["--policy", "laps", "--batch-policy", "fcfs"], "fcfs"),  # the ablation, explicit
])
def test_up_gives_the_workers_the_designs_local_policy_unless_overridden(captured_up, args, batch_policy):
    from splitserve.cli.launcher import worker_options

    spec = captured_up(*args)
    assert {worker_options(spec, i)["batch_policy"] for i in range(spec.workers)} == {batch_policy}
    assert spec.design.batch_policy == batch_policy


def test_up_passes_the_scheduling_policy_to_the_workers(captured_up):
    from splitserve.cli.launcher import worker_options

    spec = captured_up("--scheduling-policy", "priority")
    assert spec.scheduling_policy == "priority" and worker_options(spec, 0)["scheduling_policy"] == "priority"
    assert worker_options(captured_up(), 1)["scheduling_policy"] == "fcfs"


def test_start_cluster_refuses_an_unknown_scheduling_policy_before_starting_anything():
    from splitserve.cli.launcher import ClusterSpec, start_cluster

    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs | priority, got 'lifo'"):
        start_cluster(ClusterSpec(model="m", scheduling_policy="lifo", redis_url="redis://127.0.0.1:1/0"))


# ---- splitserve serve worker / scheduler ---------------------------------------------------------

@pytest.fixture
def captured_serve(monkeypatch):
    """Runs `splitserve serve SERVICE ARGS` and returns the config its main would have run with."""
    import splitserve.cli.serve as serve
    from splitserve.cli.app import app

    configs = []
    for service in ("worker", "scheduler"):
        monkeypatch.setitem(serve._SERVICE_MAINS, service, lambda: configs.append)

    def run(service, *args, env=None):
        result = CliRunner().invoke(app, ["serve", service, *args], env=env)
        assert result.exit_code == 0, result.output
        return configs[-1]
    return run


@pytest.mark.parametrize("args, env, batch_policy", [
    (["--design", "laps"], None, "laps"),
    ([], {"SPLITSERVE_DESIGN": "dynaserve"}, "slo_aware"),  # one variable for every service
    (["--design", "ampd"], None, "prefill_reorder"),
    ([], None, "fcfs"),
    (["--design", "dynaserve", "--batch-policy", "fcfs"], None, "fcfs"),  # the ablation, explicit
    ([], {"SPLITSERVE_DESIGN": "laps", "SPLITSERVE_WORKER_BATCH_POLICY": "fcfs"}, "fcfs"),
])
def test_serve_worker_takes_the_designs_local_policy_unless_overridden(captured_serve, args, env, batch_policy):
    from workers.server import batch_policy_of, engine_config_from

    config = captured_serve("worker", "--model", "m", *args, env=env)
    assert batch_policy_of(config) == batch_policy and engine_config_from(config).batch_policy == batch_policy


def test_serve_worker_hands_the_scheduling_policy_to_its_batch_policy(captured_serve):
    from workers.server import batch_policy_options_from

    config = captured_serve("worker", "--model", "m", "--scheduling-policy", "priority")
    assert batch_policy_options_from(config) == {"scheduling_policy": "priority"}
    assert batch_policy_options_from(captured_serve("worker", "--model", "m")) == {}
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs | priority, got 'lifo'"):
        batch_policy_options_from(captured_serve("worker", "--model", "m", "--scheduling-policy", "lifo"))
    twice = captured_serve("worker", "--model", "m", "--scheduling-policy", "priority",
                           "--batch-policy-options", json.dumps({"scheduling_policy": "priority"}))
    with pytest.raises(ValueError, match="scheduling_policy is given twice"):
        batch_policy_options_from(twice)


@pytest.mark.parametrize("args, env, placement", [
    (["--design", "dynaserve"], None, "dynaserve"),
    ([], {"SPLITSERVE_DESIGN": "laps"}, "laps"),
    ([], None, "least_loaded"),
    (["--design", "laps", "--policy", "pd_disaggregated"], None, "pd_disaggregated"),
])
def test_serve_scheduler_takes_the_designs_placement_unless_overridden(captured_serve, args, env, placement):
    config = captured_serve("scheduler", *args, env=env)
    assert resolve_design(config.policy, design=config.design).placement == placement


# ---- splitserve simulate -------------------------------------------------------------------------

def _simulated(tmp_path, *args):
    from services.planner.cli import simulate_app

    out = tmp_path / "sim"
    result = CliRunner().invoke(simulate_app, ["--workers", "2", "--shape", "P64/D4", "-n", "4", "--arrival",
                                               "poisson:rate=20", "--out-dir", str(out), *args])
    assert result.exit_code == 0, result.output
    target = json.loads((out / "simulate.json").read_text())["config"]["target"]
    return target, result.output


@pytest.mark.parametrize("args, batch_policy, design", [
    (["--policy", "dynaserve"], "slo_aware", "dynaserve (placement dynaserve, local batching slo_aware)"),
    (["--policy", "ampd"], "prefill_reorder", "ampd (placement ampd, local batching prefill_reorder)"),
    (["--policy", "least_loaded"], "fcfs", "placement least_loaded, local batching fcfs"),
    (["--policy", "dynaserve", "--batch-policy", "fcfs"], "fcfs",
     "dynaserve (placement dynaserve, local batching fcfs; ablation: local batching fcfs instead of slo_aware)"),
])
def test_simulate_runs_the_designs_local_policy_unless_overridden(tmp_path, args, batch_policy, design):
    target, output = _simulated(tmp_path, *args)
    assert target["simulator"]["batch_policy"] == target["cluster"]["batch_policy"] == batch_policy
    assert target["cluster"]["design"] == target["simulator"]["design"] == design and f"design: {design[:20]}" in output  # rich wraps long lines
