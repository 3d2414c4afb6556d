"""The slo_aware batch policy (DynaServe Alg. 2) on the real core `Scheduler` (no fakes).

Steps are executed with the latency an A100 running Qwen2.5-14B takes (the preset), so
the policy's prediction can be checked against what the step then costs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest

from splitserve.core import (BlockManager, DecodeRun, FcfsPolicy, KvInBlocks, SamplingParams, Scheduler, SchedulerConfig,
                             SloAwarePolicy, StageKey, StageSlo, StageSpec, build_batch_policy, known_batch_policies,
                             make_batch_policy, step_time, takes_option)
from splitserve.perf.model import PerfModel
from splitserve.perf.presets import preset

MODEL = preset("A100", "Qwen2.5-14B")
SLO = StageSlo(itl_s=0.1)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(policy=None, *, budget=2048, max_num_seqs=256, num_blocks=20_000, block_size=16, caching=False):
    policy = policy if policy is not None else SloAwarePolicy(MODEL)
    sched = Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len=1 << 20, vocab_size=None),
                      BlockManager(num_blocks, block_size, caching), policy, Clock())
    return sched, policy


_tokens = itertools.count(1000)


def add(sched, rid, prompt_len, max_tokens=100, slo=SLO):
    prompt = [next(_tokens) for _ in range(prompt_len)]
    return sched.add_stage(StageSpec.whole(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                           slo=slo))


def step(sched, model=MODEL):
    """Schedule one step and execute it in `model`'s time."""
    out = sched.schedule()
    latency = step_time(model, out.shape)
    sched.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, latency)
    sched.clock.now += latency
    return out, latency


def decoding(sched, n, prompt_len=1000, slo=SLO, max_tokens=400):
    """n requests past their prompts, decoding."""
    for i in range(n):
        add(sched, f"d{i}", prompt_len, max_tokens=max_tokens, slo=slo)
    while sched.waiting or any(s.in_prefill for s in sched.running):
        step(sched)
    assert len(sched.running) == n


def kinds(out):
    return ["decode" if e.num_new_tokens == 1 and e.start >= e.seq.prompt_len else "prefill" for e in out.entries]


# ---- Alg. 2 ------------------------------------------------------------------------------------


def test_decodes_first_then_prefill_up_to_max_prefill_allowed():
    sched, policy = make()
    decoding(sched, 32)
    add(sched, "long", 6000)
    ctx = sum(s.num_computed_tokens + 1 for s in sched.running) / 32
    out, latency = step(sched)
    assert kinds(out) == ["decode"] * 32 + ["prefill"]
    chunk = out.entries[-1]
    expected = policy.table.max_prefill(0.1 * 0.9, ctx, 32)
    assert chunk.seq.request_id == "long" and chunk.start == 0 and chunk.num_new_tokens == expected
    assert 400 < expected < 2048 - 32  # the SLO, not the step budget, bounds the prefill
    # Seeded from the model the steps run at, refined by the steps run so far: on target.
    assert 0.085 < latency <= 0.09 * (1 + 1e-3)
    # The next chunk reads the first one's KV: it takes fewer tokens for the same target.
    out, latency = step(sched)
    assert kinds(out) == ["decode"] * 32 + ["prefill"]
    assert out.entries[-1].start == expected and out.entries[-1].num_new_tokens < expected
    assert policy.table.predict_shape(out.shape) <= 0.09 * (1 + 1e-6) and latency <= 0.09 * (1 + 1e-3)


def test_prefill_budget_is_filled_in_arrival_order_running_chunks_first():
    sched, policy = make()
    decoding(sched, 16)
    add(sched, "a", 300)
    step(sched)  # a is admitted whole (300 < M)
    add(sched, "b", 3000)
    add(sched, "c", 50)
    out, _ = step(sched)
    m = policy.last_prefill_budget
    assert [e.seq.request_id for e in out.entries[16:]] == ["a", "b"]  # a decodes now, b takes all of M
    assert out.entries[-1].num_new_tokens == m
    while sched.sequences[StageKey("b", 0)].in_prefill:
        out, _ = step(sched)
        assert out.shape.num_prefill_tokens <= policy.last_prefill_budget
    # b's last chunk leaves room: c, next in arrival order, takes the rest of M.
    assert [e.seq.request_id for e in out.entries if e.seq.request_id in "bc"] == ["b", "c"]


def test_the_tightest_objective_among_the_decodes_is_the_target():
    sched, policy = make()
    add(sched, "loose", 500, slo=StageSlo(itl_s=0.3))
    add(sched, "tight", 500, slo=StageSlo(itl_s=0.06))
    add(sched, "none", 500, slo=StageSlo())
    step(sched)
    add(sched, "p", 5000)
    out, latency = step(sched)
    ctx = out.shape.mean_decode_context
    assert out.shape.num_decodes == 3
    assert out.shape.num_prefill_tokens == policy.table.max_prefill(0.06 * 0.9, ctx, 3) == policy.last_prefill_budget
    assert latency <= 0.054


def test_without_an_objective_on_the_decodes_the_default_applies_and_without_either_fcfs_does():
    budgets = {}
    for itl_slo_ms in (None, 80):
        sched, policy = make(SloAwarePolicy(MODEL, itl_slo_ms=itl_slo_ms))
        decoding(sched, 8, slo=StageSlo())
        add(sched, "p", 5000, slo=StageSlo())
        out, _ = step(sched)
        budgets[itl_slo_ms] = out.shape.num_prefill_tokens
        if itl_slo_ms:
            assert budgets[itl_slo_ms] == policy.table.max_prefill(0.08 * 0.9, out.shape.mean_decode_context, 8)
        else:
            assert policy.last_prefill_budget is None
    assert budgets[None] == 2048 - 8  # the whole step budget, as fcfs
    assert 0 < budgets[80] < 600


def test_without_decodes_prefill_takes_the_whole_step_budget():
    sched, policy = make()
    add(sched, "a", 1500)
    add(sched, "b", 1500)
    out, _ = step(sched)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.entries] == [("a", 1500), ("b", 548)]
    # No token's gap depends on a step without decodes; a's first decode then bounds the next step.
    out, _ = step(sched)
    assert out.shape.num_decodes == 1 and out.shape.num_prefill_tokens == policy.last_prefill_budget < 952


@pytest.mark.parametrize("floor", [0, 16, 48])
def test_a_prefill_never_starves_below_its_floor(floor):
    # 10 ms objective: the decodes alone (about 18 ms: the weights are read once a step) exceed it.
    sched, policy = make(SloAwarePolicy(MODEL, min_prefill_tokens=floor))
    decoding(sched, 8, prompt_len=200, slo=StageSlo(itl_s=0.01), max_tokens=60)  # one step: no decodes yet
    assert policy.table.max_prefill(0.009, 201, 8) == 0
    add(sched, "p", 200)
    out, _ = step(sched)
    assert kinds(out) == ["decode"] * 8 + ["prefill"] * (floor > 0)
    assert out.shape.num_prefill_tokens == floor
    if floor:  # p progresses a floor a step until its prompt is done
        steps = 1
        while sched.sequences[StageKey("p", 0)].in_prefill:
            out, _ = step(sched)
            steps += 1
        assert steps == -(-200 // floor)
    else:  # Alg. 2 to the letter: p waits until decodes finish
        assert [s.request_id for s in sched.waiting] == ["p"]


def test_every_decode_runs_even_when_they_alone_exceed_the_objective():
    sched, _ = make(SloAwarePolicy(MODEL, min_prefill_tokens=0))
    decoding(sched, 40, prompt_len=50, slo=StageSlo(itl_s=0.005), max_tokens=30)
    for _ in range(5):
        out, latency = step(sched)
        assert out.shape.num_decodes == 40 and latency > 0.005


def test_a_hand_off_goes_with_the_decodes_ahead_of_queued_prefills():
    """A split request's second stage with its KV in place and one token to go is a decode whose
    gap began on the other worker: it must not wait behind the prefills queued before it (in the
    simulator every DynaServe miss on the Azure traces was a gap > 100 ms at the hand-off)."""
    sched, policy = make()
    decoding(sched, 8)
    add(sched, "queued", 6000)  # arrived first: takes the whole prefill budget M
    prompt = tuple(next(_tokens) for _ in range(500))
    outputs = (7, 8, 9)  # sampled on the first stage's worker; the last has no KV yet
    computed = len(prompt) + len(outputs) - 1
    blocks = sched.reserve_kv(computed)
    sched.add_stage(StageSpec(StageKey("split", 1), prompt, SamplingParams(max_tokens=50, ignore_eos=True),
                              output_ids=outputs, kv=KvInBlocks(tuple(blocks), computed), slo=SLO))
    out, latency = step(sched)
    assert [e.seq.request_id for e in out.entries] == [f"d{i}" for i in range(8)] + ["split", "queued"]
    hand_off = out.entries[8]
    assert hand_off.start == computed and hand_off.num_new_tokens == 1  # samples the 4th output token
    assert len(hand_off.seq.token_ids) == len(prompt) + len(outputs) + 1
    assert out.shape.num_decodes == 9  # counted as a decode: the step is sized for its gap too
    assert latency <= 0.09 * (1 + 1e-3)


@pytest.mark.parametrize("num_blocks, shrinks", [(2600, True), (20_000, False)])
@pytest.mark.parametrize("objective", ["request", "worker default"])
def test_under_kv_pressure_the_steps_get_shorter(num_blocks, shrinks, objective):
    """32 decodes of ~1,000 tokens hold ~2,050 blocks: 21% of 2,600 free (below the 40% where
    pressure starts: the target shrinks to about half) or 90% of 20,000 (no change); the
    objective the requests carry, or the worker's --itl-slo-ms when they carry none."""
    budgets, latencies = {}, {}
    for below in (0.4, 0.0):
        default = 100 if objective == "worker default" else None
        sched, policy = make(SloAwarePolicy(MODEL, itl_slo_ms=default, kv_pressure_below=below),
                             num_blocks=num_blocks)
        decoding(sched, 32, slo=SLO if objective == "request" else StageSlo())
        add(sched, "long", 6000)
        out, latencies[below] = step(sched)
        assert out.shape.num_decodes == 32
        budgets[below] = policy.last_prefill_budget
    if shrinks:
        assert budgets[0.4] < 0.7 * budgets[0.0]
        assert latencies[0.4] < 0.7 * latencies[0.0]
    else:
        assert budgets[0.4] == budgets[0.0]


def test_kv_pressure_options_are_checked():
    with pytest.raises(ValueError, match="kv_pressure_below"):
        SloAwarePolicy(MODEL, kv_pressure_below=1.5)
    with pytest.raises(ValueError, match="kv_pressure_min_scale"):
        SloAwarePolicy(MODEL, kv_pressure_min_scale=0)


def test_a_stage_cut_just_inside_the_prompt_goes_with_the_decodes_too():
    """DynaServe cuts short outputs at P - 1: the second stage's one token is the prompt's last,
    and it samples the first output token; it must not wait behind the queued prefills."""
    sched, _ = make()
    decoding(sched, 8)
    add(sched, "queued", 6000)
    prompt = tuple(next(_tokens) for _ in range(500))
    blocks = sched.reserve_kv(499)
    sched.add_stage(StageSpec(StageKey("cut", 1), prompt, SamplingParams(max_tokens=20, ignore_eos=True),
                              kv=KvInBlocks(tuple(blocks), 499), slo=SLO))
    out, _ = step(sched)
    assert [e.seq.request_id for e in out.entries][:9] == [f"d{i}" for i in range(8)] + ["cut"]
    assert out.entries[8].num_new_tokens == 1 and len(out.entries[8].seq.token_ids) == 501  # sampled


def test_a_waiting_request_without_memory_blocks_those_behind_it():
    # 24 blocks of 16 tokens: 'run' holds 9 once decoding; 'big' needs 13 of the 15 left; 'small' 1.
    sched, _ = make(num_blocks=24, block_size=16)
    add(sched, "run", 130, max_tokens=40)
    step(sched)
    add(sched, "big", 300, max_tokens=2)
    add(sched, "small", 10, max_tokens=2)
    out, _ = step(sched)
    assert [e.seq.request_id for e in out.entries] == ["run"]  # big does not fit: small does not overtake it
    assert [s.request_id for s in sched.waiting] == ["big", "small"]
    while sched.has_unfinished():
        step(sched)
    assert sched.block_manager.num_free_blocks == 24


def test_decodes_take_memory_from_running_prefills_not_the_other_way_round():
    # A decode that needs a block preempts the newest running request not in the step: with
    # decodes added first, that is a prefill in progress, never a decode.
    sched, _ = make(num_blocks=40, block_size=16)
    decoding(sched, 4, prompt_len=15, max_tokens=200)  # one block each, a new one every 16 tokens
    add(sched, "long", 560, max_tokens=2)  # 35 blocks: all that is left
    preempted = []
    for _ in range(40):
        out, _ = step(sched)
        preempted += [s.request_id for s in out.preempted]
        assert out.shape.num_decodes == 4
    assert preempted and set(preempted) == {"long"}


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_the_contract_and_finish(seed):
    rng = random.Random(seed)
    policy = SloAwarePolicy(MODEL if seed % 2 else None, itl_slo_ms=rng.choice([None, 50, 100]),
                            min_prefill_tokens=rng.choice([0, 16, 64]), learning_rate=rng.choice([0.05, 0.2, 1.0]))
    sched, _ = make(policy, budget=rng.choice([256, 2048]), max_num_seqs=rng.choice([4, 64]),
                    num_blocks=rng.choice([120, 2000]), block_size=16, caching=bool(seed % 3))
    n = 0
    for _ in range(400):
        if rng.random() < 0.15 and n < 60:
            slo = rng.choice([StageSlo(), StageSlo(itl_s=0.05), StageSlo(itl_s=0.2)])
            add(sched, f"r{n}", rng.randint(1, 1200), max_tokens=rng.randint(1, 60), slo=slo)
            n += 1
        if not sched.has_unfinished():
            continue
        out, _ = step(sched)  # a contract breach raises PolicyContractError
        seen_prefill = False
        for kind in kinds(out):  # decodes first
            assert not (seen_prefill and kind == "decode")
            seen_prefill |= kind == "prefill"
        if policy.last_prefill_budget is not None and out.shape.num_decodes:
            assert out.shape.num_prefill_tokens <= policy.last_prefill_budget
    while sched.has_unfinished():
        step(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert policy.table.is_monotone()


# ---- learning on the scheduler ------------------------------------------------------------


def scaled(model: PerfModel, factor: float) -> PerfModel:
    def scale(coeffs):
        return dataclasses.replace(coeffs, **{f.name: getattr(coeffs, f.name) * factor
                                              for f in dataclasses.fields(coeffs)})
    return dataclasses.replace(model, prefill=scale(model.prefill), decode=scale(model.decode))


def test_a_wrong_prior_is_corrected_by_the_steps_that_run():
    # Seeded with a model twice too fast, the first mixed steps overshoot the objective;
    # the steps it measures correct the table, and the steps that follow keep to the target.
    sched, policy = make(SloAwarePolicy(scaled(MODEL, 0.5)))
    decoding(sched, 24, prompt_len=80, max_tokens=1000)  # short prompts: no large prefill measured yet
    for i in range(16):
        add(sched, f"long{i}", 4000, max_tokens=2)
    latencies = [step(sched)[1] for _ in range(120)]
    assert max(latencies[:3]) > 0.13  # the prior promised twice the room there is
    later = latencies[30:]
    # The target is 90 ms; the chunks of a prompt read ever more history, whose cost comes
    # from the (wrong) prior's attention coefficient: a few percent either way, under the SLO.
    assert max(later) <= 0.09 * 1.06 < 0.1
    assert sum(later) / len(later) > 0.085  # and the room there is gets used
    assert policy.table.num_observations >= 120


# ---- what drivers rely on ---------------------------------------------------------------------


def test_only_decodes_and_nothing_admissible_is_a_steady_run():
    sched, policy = make()
    assert SloAwarePolicy.steady_decodes and SloAwarePolicy.observes_steps
    decoding(sched, 5, max_tokens=50)
    run = DecodeRun.find(sched, sched.schedule(), 1)
    assert run is not None and run.steps >= 40
    # With a request it could admit, no run (the next step takes it).
    sched2, _ = make()
    decoding(sched2, 5, max_tokens=50)
    add(sched2, "w", 100)
    assert DecodeRun.find(sched2, sched2.schedule(), 1) is None


def test_the_choice_does_not_depend_on_the_time():
    # The simulator schedules the step in progress again after applying part of a decode
    # run, later in virtual time: it must make the same choice.
    plans = []
    for later in (0.0, 123.0):
        sched, _ = make()
        decoding(sched, 6, max_tokens=50)
        add(sched, "w", 3000)
        sched.clock.now += later
        plans.append([(e.seq.request_id, e.start, e.num_new_tokens) for e in sched.schedule().entries])
    assert plans[0] == plans[1] and plans[0][-1][0] == "w"


def test_registry_options_from_strings_and_the_drivers_perf_model():
    assert "slo_aware" in known_batch_policies()
    policy = make_batch_policy("slo_aware", itl_slo_ms="100", target_fraction="0.8", min_prefill_tokens="32",
                               learning_rate="0.5", perf_model=MODEL.to_json())
    assert isinstance(policy, SloAwarePolicy)
    assert (policy.default_itl_slo_s, policy.target_fraction, policy.min_prefill_tokens) == (0.1, 0.8, 32)
    assert policy.table.learning_rate == 0.5 and policy.table.prior_label == MODEL.label
    assert make_batch_policy("slo_aware", perf_model=MODEL.to_dict(), itl_slo_ms="").default_itl_slo_s is None
    assert make_batch_policy("slo_aware", itl_slo_ms=0).default_itl_slo_s is None
    for bad, message in [({"itl_slo_ms": "fast"}, "itl_slo_ms must be a number"),
                         ({"target_fraction": "1.5"}, r"target_fraction must be a number in \[0.001, 1\]"),
                         ({"min_prefill_tokens": "2.5"}, "min_prefill_tokens must be an integer"),
                         ({"learning_rate": 0}, "learning_rate"),
                         ({"perf_model": "{"}, "perf_model: not a perf model's JSON text"),
                         ({"perf_model": {"format": "x"}}, "perf_model: not a splitserve.perf.model"),
                         ({"perf_model": 3}, "perf_model must be a PerfModel"),
                         ({"window": 3}, "unexpected keyword")]:
        with pytest.raises(ValueError, match="bad options for batch policy 'slo_aware': .*" + message):
            make_batch_policy("slo_aware", **bad)
    # Drivers hand their model to a policy that takes one, unless its options name one.
    assert build_batch_policy("slo_aware", {}, perf_model=MODEL).table.prior_label == MODEL.label
    other = dataclasses.replace(MODEL, label="fitted")
    assert build_batch_policy("slo_aware", {"perf_model": other.to_dict()},
                              perf_model=MODEL).table.prior_label == "fitted"
    assert build_batch_policy("slo_aware", None).table.prior_label == ""  # learns from scratch
    assert isinstance(build_batch_policy("fcfs", {}, perf_model=MODEL), FcfsPolicy)  # fcfs takes none
    assert takes_option("slo_aware", "itl_slo_ms") and not takes_option("fcfs", "itl_slo_ms")
    assert not takes_option("nope", "perf_model")
    json.dumps({"perf_model": MODEL.to_dict(), "itl_slo_ms": 100})  # what the simulator's config holds
