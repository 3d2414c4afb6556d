"""The simulator covers what issue 5 asks of it: every registered placement policy, 1 to 256 workers.

"Any policy the services run must run here too": the list is read from the scheduler's own
registry (`known_policies`), so a policy added there without simulator support fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

from loadgen import arrivals
from loadgen.metrics import Slo, summarize
from services.global_scheduler.policy import known_policies
from services.planner.sim_workload import SimRequestSpec
from services.planner.simulator import Simulator, pd_roles
from splitserve.perf.presets import preset

PERF = preset("H100", "llama-3-8b")


def _items(n: int) -> list[SimRequestSpec]:
    rng = np.random.default_rng(3)
    return [SimRequestSpec(f"r{i}", int(rng.integers(64, 2048)), int(rng.integers(4, 96))) for i in range(n)]


def _run(policy: str, workers: int, roles=None, n: int = 40):
    sim = Simulator(workers, PERF, num_kv_blocks=4096, placement_policy=policy, roles=roles)
    return sim.run(_items(n), arrivals.poisson(20.0 * workers), seed=1)


@pytest.mark.parametrize("policy", known_policies())
def test_every_registered_policy_runs_in_the_simulator(policy):
    outcome = _run(policy, 4)
    if not all(r.ok for r in outcome.results):  # a policy that needs role pools (prefill / decode)
        outcome = _run(policy, 4, pd_roles(4, 2))
    failed = [r.error for r in outcome.results if not r.ok]
    assert not failed, f"{policy}: {failed[:3]}"
    assert all(len(r.token_times_s) == r.output_len for r in outcome.results)


@pytest.mark.parametrize("workers", [1, 256])
def test_one_to_256_workers(workers):
    outcome = _run("least_loaded", workers, n=300)
    summary = summarize(outcome.results, Slo(2.0, 0.2))
    assert summary.n_ok == 300
    assert len({r.request_id for r in outcome.results}) == 300  # every request accounted for once
    # least_loaded spreads 300 requests over the workers: at least min(workers, 300) / 2 of them stepped.
    assert outcome.stats.steps >= min(workers, 300) // 2 and outcome.stats.worker_busy_fraction > 0
