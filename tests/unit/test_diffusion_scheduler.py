"""The diffusion step scheduler (dLLM-Serve §4.4), pure: query-token budget, phases, admission."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.core.diffusion import (DiffusionParams, DiffusionScheduler, DiffusionSchedulerConfig,
                                       DiffusionSequence, Phase, retained_tokens, transfer_token_schedule)


def seq(key: str, prompt: int = 32, gen: int = 64, block: int = 16, steps: int = 16, **extra) -> DiffusionSequence:
    return DiffusionSequence(key, prompt, DiffusionParams(gen_length=gen, block_length=block, steps=steps, **extra))


def scheduler(**options) -> DiffusionScheduler:
    return DiffusionScheduler(DiffusionSchedulerConfig(**options))


def test_params_errors_name_the_field():
    for bad, name in ((dict(gen_length=0), "gen_length"), (dict(gen_length=10, block_length=4), "block_length"),
                      (dict(gen_length=8, block_length=4, steps=3), "steps"), (dict(temperature=-1), "temperature"),
                      (dict(remasking="greedy"), "remasking"), (dict(retention_ratio=0), "retention_ratio"),
                      (dict(retention_ratio=1.5), "retention_ratio")):
        with pytest.raises(ValueError, match=name):
            DiffusionParams(**bad)
    for bad, name in ((dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(cache="half"), "dllm_cache"),
                      (dict(policy="lifo"), "policy")):
        with pytest.raises(ValueError, match=name):
            DiffusionSchedulerConfig(**bad)


def test_the_transfer_schedule_spreads_a_block_over_its_steps():
    assert transfer_token_schedule(16, 4) == [4, 4, 4, 4]
    assert transfer_token_schedule(10, 4) == [3, 3, 2, 2]
    assert sum(transfer_token_schedule(37, 9)) == 37


def test_a_request_refreshes_at_each_block_start_and_reuses_within_it():
    s = seq("a", prompt=10, gen=32, block=16, steps=8)  # 2 blocks of 4 steps
    phases, costs = [], []
    while not s.finished:
        phases.append(s.phase("dual"))
        costs.append(s.query_tokens("dual"))
        s.advance()
    assert phases == [Phase.REFRESH, Phase.REUSE, Phase.REUSE, Phase.REUSE] * 2
    assert costs == [42, 16, 16, 16] * 2
    assert seq("b").phase("none") is Phase.REFRESH  # no cache: every step recomputes the sequence
    assert seq("c", retention_ratio=0.5).kv_tokens("dual") == retained_tokens(96 - 16, 0.5) == 40
    assert seq("d").kv_tokens("dual") == 96 and seq("d").kv_tokens("none") == 0


def test_new_requests_fill_the_headroom_that_requests_in_reuse_free():
    sched = scheduler(max_num_batched_tokens=200, cache="dual")
    for key in "abcd":
        sched.add(seq(key))  # 96 tokens to refresh, 16 to reuse
    first = sched.schedule()
    assert [w.seq.key for w in first.entries] == ["a", "b"] and first.num_query_tokens == 192
    sched.finish_step(first)
    second = sched.schedule()  # a and b in Reuse (32): c refreshes in the freed headroom, d does not fit
    assert [(w.seq.key, w.phase) for w in second.entries] == [("a", Phase.REUSE), ("b", Phase.REUSE),
                                                               ("c", Phase.REFRESH)]
    assert [w.admitted for w in second.entries] == [False, False, True]
    sched.finish_step(second)
    third = sched.schedule()
    assert [w.seq.key for w in third.entries] == ["a", "b", "c", "d"] and third.num_query_tokens == 144


def test_the_static_baseline_admits_a_new_batch_only_when_the_last_one_drained():
    sched = scheduler(max_num_batched_tokens=200, cache="dual", policy="static", static_batch_size=2)
    for key in "abc":
        sched.add(seq(key, gen=16, block=16, steps=2))
    keys = []
    while sched.has_unfinished():
        batch = sched.schedule()
        keys.append("".join(w.seq.key for w in batch.entries))
        sched.finish_step(batch)
    assert keys == ["ab", "ab", "c", "c"]


def test_kv_pool_limits_admission_and_is_returned_on_finish_and_abort():
    sched = scheduler(max_num_batched_tokens=1000, kv_capacity_tokens=200, cache="dual")
    for key in "abc":
        sched.add(seq(key))
    batch = sched.schedule()
    assert [w.seq.key for w in batch.entries] == ["a", "b"] and sched.kv_used_tokens == 192
    assert sched.abort("a") and sched.kv_used_tokens == 96
    assert [w.seq.key for w in sched.schedule().entries] == ["b", "c"]
    assert sched.stop_early("b") and sched.kv_used_tokens == 96
    assert not sched.abort("zzz")


def test_a_request_that_could_never_run_is_refused_naming_the_limit():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        scheduler(max_num_batched_tokens=64).add(seq("a"))
    with pytest.raises(ValueError, match="KV pool"):
        scheduler(kv_capacity_tokens=50, cache="dual").add(seq("a"))
    scheduler(kv_capacity_tokens=50, cache="none").add(seq("a"))  # no cache: no KV held


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.sampled_from([(16, 16, 4), (32, 8, 8), (24, 24, 24)]),
                          st.sampled_from([1.0, 0.5])), min_size=1, max_size=12),
       st.integers(100, 400), st.integers(100, 2000), st.sampled_from(["dual", "none"]),
       st.sampled_from(["phase_multiplexed", "static"]), st.integers(1, 6))
def test_every_step_keeps_the_budgets_and_every_request_finishes(requests, budget, kv, cache, policy, max_seqs):
    sched = scheduler(max_num_batched_tokens=budget, kv_capacity_tokens=kv, cache=cache, policy=policy,
                      max_num_seqs=max_seqs, static_batch_size=3)
    accepted = []
    for i, (prompt, (gen, block, steps), ratio) in enumerate(requests):
        s = seq(f"r{i}", prompt, gen, block, steps, retention_ratio=ratio)
        try:
            sched.add(s)
            accepted.append(s)
        except ValueError:
            assert s.length > budget or s.kv_tokens(cache) > kv
    finished = []
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch.entries, "a step with work waiting ran nothing"
        assert batch.num_query_tokens <= budget
        assert sched.kv_used_tokens <= kv and len(sched.running) <= max_seqs
        assert len({w.seq.key for w in batch.entries}) == len(batch.entries)
        finished += sched.finish_step(batch)[1]
    assert sorted(s.key for s in finished) == sorted(s.key for s in accepted)
    assert sched.kv_used_tokens == 0
    assert all(s.steps_done == s.params.steps for s in finished)
