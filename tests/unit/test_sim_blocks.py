"""The simulator's incremental `commit_computed` changes nothing but speed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import prefix_sharing_workload

from loadgen import arrivals
from services.planner import sim_worker
from services.planner.sim_blocks import UPSTREAM_DIGEST, IncrementalCommitBlockManager, upstream_digest
from services.planner.simulator import Simulator
from splitserve.perf_model import preset
from workers.engine.block_manager import BlockManager


def test_written_against_the_engines_current_commit_computed():
    # Fails when BlockManager.commit_computed changes: re-check the override, then update the digest.
    assert upstream_digest() == UPSTREAM_DIGEST


@pytest.mark.parametrize("policy,roles", [("least_loaded", None), ("pd_disaggregated", ("prefill", "decode", "decode"))])
def test_same_results_and_cache_state_as_the_engines_block_manager(monkeypatch, policy, roles):
    def run(cls):
        monkeypatch.setattr(sim_worker, "make_block_manager", lambda *a: cls(*a))
        sim = Simulator(3, preset("H100", "llama-3-8b"), num_kv_blocks=80, placement_policy=policy, roles=roles,
                        max_num_batched_tokens=512)
        outcome = sim.run(prefix_sharing_workload(), arrivals.poisson(200.0), seed=2)
        return [dataclasses.astuple(r) for r in outcome.results], dataclasses.asdict(outcome.stats)

    engine, incremental = run(BlockManager), run(IncrementalCommitBlockManager)
    assert incremental[0] == engine[0]
    for key in ("virtual_s", "events", "steps", "kv_transfers", "kv_recomputes", "preemptions"):
        assert incremental[1][key] == engine[1][key], key
    assert engine[1]["preemptions"] > 0  # a small cache: eviction, preemption and re-admission happened


def test_block_level_equivalence_under_eviction():
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.sequence import Sequence

    rng = np.random.default_rng(5)
    managers = [BlockManager(24, 4), IncrementalCommitBlockManager(24, 4)]
    seqs = [[], []]
    for step in range(3000):
        op = rng.integers(0, 4)
        live = seqs[0]
        if op == 0 or not live:
            n = int(rng.integers(1, 20))
            tokens = [int(t) for t in rng.integers(0, 3, n)]  # few distinct tokens: many equal hashes
            for m, ss in zip(managers, seqs):
                s = Sequence(f"q{step}", list(tokens), n, SamplingParams(), 0, 0.0)
                hits = m.cached_prefix_blocks(s)
                want = n - len(hits) * 4
                if m.admission_cost(s, hits, want) <= m.num_free_blocks:
                    m.admit(s, hits, want)
                    s.num_computed_tokens = n
                    m.commit_computed(s)
                    ss.append(s)
        elif op == 1:
            i = int(rng.integers(0, len(live)))
            for m, ss in zip(managers, seqs):
                m.free(ss.pop(i))
        else:
            i = int(rng.integers(0, len(live)))
            for m, ss in zip(managers, seqs):
                s = ss[i]
                if m.can_grow(s, 1):
                    m.grow(s, 1)
                    s.token_ids.append(int(step % 3))
                    s.num_computed_tokens += 1
                    m.commit_computed(s)
        a, b = managers
        assert [(x.ref_count, x.block_hash, x.token_ids) for x in a.blocks] == \
               [(x.ref_count, x.block_hash, x.token_ids) for x in b.blocks]
        assert a._hash_to_block == b._hash_to_block and list(a._free_cached) == list(b._free_cached)
