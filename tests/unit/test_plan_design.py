"""`splitserve plan` simulates the whole AMPD design (ampd placement and prefill_reorder local
batching) unless `--batch-policy` spells out an ablation."""

from __future__ import annotations

import types

import pytest
from typer.testing import CliRunner

from services.planner import deploy_plan
from services.planner.deploy_plan import PlanInputs, pool_simulator


def test_the_plan_simulates_ampds_placement_and_local_batching():
    inputs = PlanInputs(gpus=4, model="Llama-3-8B")
    config = pool_simulator(inputs, [("prefill", 1, 1), ("decode", 1, 1)]).config
    assert (config.placement_policy, config.batch_policy) == ("ampd", "prefill_reorder")
    ablation = PlanInputs(gpus=4, model="Llama-3-8B", batch_policy="fcfs")
    assert pool_simulator(ablation, [("prefill", 1, 1), ("decode", 1, 1)]).config.batch_policy == "fcfs"
    assert "ablation: local batching fcfs instead of prefill_reorder" in ablation.design.describe()
    with pytest.raises(ValueError, match="batch_policy must be one of .*got 'lifo'"):
        PlanInputs(gpus=4, batch_policy="lifo")


@pytest.mark.parametrize("args, batch_policy", [([], "prefill_reorder"), (["--batch-policy", "fcfs"], "fcfs")])
def test_plan_command_runs_the_design_unless_overridden(monkeypatch, args, batch_policy):
    from splitserve.cli.app import app

    seen = []

    def record(inputs, processes=1):
        seen.append(inputs)
        return types.SimpleNamespace(candidates=[], rate=1.0)

    monkeypatch.setattr(deploy_plan, "plan", record)
    result = CliRunner().invoke(app, ["plan", "--gpus", "4", "--model-preset", "Llama-3-8B", *args])
    assert result.exit_code == 1 and "no feasible deployment" in result.output, result.output
    assert seen[-1].design.batch_policy == batch_policy
    assert f"local batching {batch_policy}" in result.output
