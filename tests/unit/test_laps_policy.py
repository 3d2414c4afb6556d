"""LAPS' temporal disaggregation (AWD batching + long chunks) on the real core `Scheduler`
(no fakes), and the captured-shape grid as plain data."""

from __future__ import annotations

import itertools

import pytest
from conftest import add_request, policy_scheduler, run_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.core import build_batch_policy, known_batch_policies, step_time
from splitserve.core.policies import LapsPolicy
from splitserve.core.shapes import ShapeGrid
from splitserve.perf.presets import preset

MODEL = preset("H100", "Llama-3-8B")
L_M = MODEL.prefill_boundary(0)


def make(policy, *, budget=4096, max_num_seqs=256):
    return policy_scheduler(policy, budget=budget, max_num_seqs=max_num_seqs)


def add(sched, rid, prompt_len, ttft_s=None, max_tokens=1):
    add_request(sched, rid, prompt_len, ttft_s, max_tokens)


def step(sched):
    return run_step(sched, MODEL)


def prefills(out):
    """(request id, new tokens) of the step's prefill entries."""
    return [(e.seq.request_id, e.num_new_tokens) for e in out.entries if e.start < e.seq.prompt_len]


# ---- classification ------------------------------------------------------------------------------


def test_the_boundary_comes_from_the_perf_model_and_moves_with_history():
    policy = LapsPolicy(perf_model=MODEL)
    assert 150 <= policy.boundary(0) <= 512  # §2.1: on current GPUs the boundary is 150-512 tokens
    assert policy.boundary(0) == MODEL.prefill_boundary(0)
    # A re-prefill's boundary moves with its history (§2.1, re-prefill).
    assert policy.boundary(8192) == MODEL.prefill_boundary(8192) != policy.boundary(0)
    assert LapsPolicy(perf_model=MODEL, boundary_tokens=100).boundary(8192) == 100  # a fixed L_m overrides
    assert LapsPolicy().boundary(0) == 256  # no model, no option: the middle of the paper's range


def test_a_re_prefill_is_classified_with_its_history():
    """The same new tokens are short on one history and long on another when L_m(H) moves."""
    policy = LapsPolicy(perf_model=MODEL)
    lo, hi = sorted((policy.boundary(0), policy.boundary(4096)))
    new = int((lo + hi) / 2)
    fresh = policy.is_short(_queued(new, 0))
    resumed = policy.is_short(_queued(new, 4096))
    assert fresh != resumed


def _queued(new_tokens, history):
    from splitserve.core.policy import QueuedRequest
    from splitserve.core.sequence import StageKey
    return QueuedRequest(StageKey(f"x{new_tokens}-{history}"), 0.0, history + new_tokens, history + new_tokens, history)


# ---- mutual exclusion and long chunks -----------------------------------------------------------


def test_short_and_long_prefills_never_share_a_step():
    sched = make(LapsPolicy(perf_model=MODEL, shape_batches="1,2,4", wait_max_ms=0))
    add(sched, "long", 3000)
    for i in range(6):
        add(sched, f"s{i}", 40)
    kinds = []
    for _ in range(40):
        if not sched.waiting and not sched.running:
            break
        out = step(sched)
        names = {rid for rid, _ in prefills(out)}
        assert not ("long" in names and names - {"long"}), names
        if names:
            kinds.append("long" if "long" in names else "short")
    assert "long" in kinds and "short" in kinds
    assert not sched.waiting and not sched.running


def test_a_long_prefill_advances_by_fixed_chunks_one_request_at_a_time():
    policy = LapsPolicy(perf_model=MODEL, long_chunk_tokens=512)
    policy.short_arrivals.append(-1.0)  # a short request arrived within the rate window
    sched = make(policy)
    add(sched, "a", 1500)
    add(sched, "b", 1500)
    seen = [prefills(step(sched)) for _ in range(6)]
    assert seen == [[("a", 512)], [("a", 512)], [("a", 476)], [("b", 512)], [("b", 512)], [("b", 476)]]


def test_without_short_arrivals_in_the_window_a_long_chunk_takes_the_whole_step_budget():
    # An instance of the long pool: cutting the prefill into C_l chunks would only add steps.
    sched = make(LapsPolicy(perf_model=MODEL, long_chunk_tokens=512), budget=1024)
    add(sched, "a", 1500)
    add(sched, "b", 700)
    seen = [prefills(step(sched)) for _ in range(4)]
    assert seen == [[("a", 1024)], [("a", 476)], [("b", 700)], []]


def test_a_long_chunk_is_cut_to_end_before_held_short_requests_must_go():
    policy = LapsPolicy(perf_model=MODEL, long_chunk_tokens=4096, wait_min_ms=20, wait_max_ms=20,
                        head_wait_max_ms=1000)
    sched = make(policy, budget=8192)
    add(sched, "long", 8000)
    add(sched, "short", 40)  # held: depth 64 is far, the window is 20 ms
    out = step(sched)
    assert [rid for rid, _ in prefills(out)] == ["long"]
    chunk = prefills(out)[0][1]
    assert 16 <= chunk < 4096
    assert MODEL.prefill_time(0, chunk) <= 0.020 + 1e-9
    assert out.hold_until == pytest.approx(0.020)


def test_when_no_useful_long_chunk_fits_the_window_the_held_shorts_go_first():
    # 8B on an H100: any step costs ~6 ms (the weight read); a 3 ms window holds no chunk.
    policy = LapsPolicy(perf_model=MODEL, long_chunk_tokens=512, wait_min_ms=3, wait_max_ms=3,
                        head_wait_max_ms=1000)
    sched = make(policy)
    add(sched, "long", 2000)
    add(sched, "short", 40)
    assert prefills(step(sched)) == [("short", 40)]
    assert prefills(step(sched)) == [("long", 512)]


def test_a_long_request_is_not_starved_by_a_stream_of_short_ones():
    policy = LapsPolicy(perf_model=MODEL, long_chunk_tokens=512, wait_min_ms=3, wait_max_ms=3,
                        head_wait_max_ms=20)
    sched = make(policy)
    add(sched, "long", 1024)
    served_long = 0
    for i in range(30):
        add(sched, f"s{i}", 40)  # a short one before every step
        if any(rid == "long" for rid, _ in prefills(step(sched))):
            served_long += 1
    assert served_long == 2  # both chunks ran within the 30 steps


def test_a_long_request_runs_within_t_max_when_a_full_short_batch_is_ready_every_step():
    """A short batch that is due every step (its depth reached) must not keep the long head
    out: the T_max guard is checked before the shorts are dispatched (issue 34, LAPS re-run:
    long throughput fell to zero with 64 short clients)."""
    policy = LapsPolicy(perf_model=MODEL, long_chunk_tokens=512, head_wait_max_ms=20)
    sched = make(policy)
    add(sched, "long", 1024)
    long_steps, short_steps = [], 0
    for i in range(12):
        for j in range(64):  # a whole captured batch (depth 64) of shorts before every step
            add(sched, f"s{i}-{j}", 40)
        ran = prefills(step(sched))
        if any(rid == "long" for rid, _ in ran):
            long_steps.append(i)
        elif ran:
            short_steps += 1
    assert len(long_steps) == 2, long_steps  # both chunks ran
    assert long_steps[-1] <= 4 and short_steps == 10  # within T_max, and shorts went between


def test_a_long_chunk_as_long_as_t_max_does_not_starve_the_shorts():
    """T_max bounds the long head's *wait*: counted from its chunk's start, a chunk lasting
    T_max or more made the head "starved" again at every step, and due short batches ran only
    once the long request was done (measured: 32B temporal, short p90 39 s)."""
    chunk_s = MODEL.prefill_time(0, 2048)
    policy = LapsPolicy(perf_model=MODEL, long_chunk_tokens=2048, head_wait_max_ms=chunk_s * 1000 / 2)
    sched = make(policy)
    add(sched, "long", 8192)
    kinds = []
    for i in range(6):
        for j in range(64):
            add(sched, f"s{i}-{j}", 40)
        ran = prefills(step(sched))
        kinds.append("long" if any(rid == "long" for rid, _ in ran) else "short" if ran else "")
    assert kinds == ["short", "long"] * 3, kinds  # alternating: neither class waits out the other


# ---- AWD ---------------------------------------------------------------------------------------------


def test_a_lone_short_request_waits_its_window_then_goes():
    policy = LapsPolicy(perf_model=MODEL, wait_min_ms=0, wait_max_ms=20, head_wait_max_ms=1000)
    sched = make(policy)
    add(sched, "s", 40)
    out = sched.schedule()
    assert not out.entries and out.hold_until == pytest.approx(0.020)  # W_GR is huge: W = W_max
    sched.clock.now = 0.010
    assert not sched.schedule().entries  # still inside the window
    sched.clock.now = 0.020
    assert prefills(sched.schedule()) == [("s", 40)]
    assert policy.num_short_batches == 1


def test_a_full_target_depth_goes_at_once_and_raises_the_depth():
    policy = LapsPolicy(perf_model=MODEL, shape_batches="1,2,4,8", wait_max_ms=1000, head_wait_max_ms=1000)
    sched = make(policy)
    for i in range(8):
        add(sched, f"s{i}", 32)
    out = sched.schedule()
    assert len(prefills(out)) == 8 and policy.target_depth == 8  # the largest captured size: stays
    policy.target_depth = 4
    sched2 = make(policy)
    for i in range(4):
        add(sched2, f"t{i}", 32)
    assert len(prefills(sched2.schedule())) == 4 and policy.target_depth == 8  # filled: D goes up


def test_a_batch_forced_early_lowers_the_depth_to_what_it_reached():
    policy = LapsPolicy(perf_model=MODEL, wait_max_ms=1000, head_wait_max_ms=10)
    sched = make(policy)
    for i in range(3):
        add(sched, f"s{i}", 32)
    assert not sched.schedule().entries
    sched.clock.now = 0.010  # T_max: the head waited long enough
    assert len(prefills(sched.schedule())) == 3
    assert policy.target_depth == 2  # the largest captured size the batch reached


def test_a_request_near_its_deadline_goes_at_once():
    policy = LapsPolicy(perf_model=MODEL, wait_max_ms=1000, head_wait_max_ms=1000, slack_ms=5)
    sched = make(policy)
    add(sched, "relaxed", 32, ttft_s=10.0)
    assert not sched.schedule().entries
    service = MODEL.step_time([(0, 32), (0, 32)])
    add(sched, "urgent", 32, ttft_s=service + 0.004)  # slack 4 ms <= σ
    out = sched.schedule()
    assert sorted(rid for rid, _ in prefills(out)) == ["relaxed", "urgent"]


def test_the_sla_window_holds_no_longer_than_the_deadline_allows():
    policy = LapsPolicy(perf_model=MODEL, wait_max_ms=1000, head_wait_max_ms=1000, slack_ms=1, margin_ms=2)
    sched = make(policy)
    add(sched, "s", 32, ttft_s=0.050)
    out = sched.schedule()
    service = MODEL.step_time([(0, 32)])
    assert not out.entries
    assert out.hold_until == pytest.approx(min(0.050 - service - 0.002, 0.050 - service - 0.001))


def test_batches_group_by_length_bucket_around_the_most_urgent_request():
    policy = LapsPolicy(perf_model=MODEL, shape_batches="1,2,4", wait_max_ms=0)
    sched = make(policy)
    add(sched, "a8", 8)
    add(sched, "b200", 200 if 200 < L_M else int(L_M) - 1)
    add(sched, "c10", 10)
    add(sched, "d12", 12)
    add(sched, "e100", 100)
    out = sched.schedule()
    assert sorted(rid for rid, _ in prefills(out)) == ["a8", "c10", "d12", "e100"]


def test_deadline_free_mode_fills_to_the_token_target():
    policy = LapsPolicy(perf_model=MODEL, deadline_free=True, short_token_target=120, head_wait_max_ms=1000)
    sched = make(policy)
    add(sched, "a", 50)
    add(sched, "b", 50)
    assert not sched.schedule().entries
    add(sched, "c", 50)  # 150 tokens >= M_s
    assert len(prefills(sched.schedule())) == 3


def test_decodes_run_in_every_step_beside_either_mode():
    policy = LapsPolicy(perf_model=MODEL, wait_max_ms=0)
    sched = make(policy)
    add(sched, "d", 20, max_tokens=50)
    step(sched)  # its prefill
    add(sched, "long", 2000)
    for _ in range(4):
        out = step(sched)
        assert any(e.seq.request_id == "d" and e.num_new_tokens == 1 for e in out.entries)


def test_without_a_perf_model_it_learns_the_short_batch_time():
    policy = LapsPolicy(wait_max_ms=0)
    sched = make(policy)
    add(sched, "s", 32)
    step(sched)
    assert policy.short_step_s == pytest.approx(MODEL.step_time([(0, 32)]))


def test_the_policy_is_registered_and_takes_the_drivers_model():
    assert "laps" in known_batch_policies()
    policy = build_batch_policy("laps", {"long_chunk_tokens": "256", "shape_batches": "1,4"}, perf_model=MODEL)
    assert isinstance(policy, LapsPolicy) and policy.perf_model is MODEL
    assert policy.long_chunk_tokens == 256 and policy.shapes.batches == (1, 4)


@pytest.mark.parametrize("options,message", [
    ({"long_chunk_tokens": 0}, "long_chunk_tokens"),
    ({"wait_min_ms": 10, "wait_max_ms": 5}, "wait_max_ms"),
    ({"shape_batches": "1,x"}, "shape_batches"),
    ({"deadline_free": "maybe"}, "deadline_free"),
    ({"boundary_tokens": -3}, "boundary_tokens"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        build_batch_policy("laps", options)


# ---- every request finishes, and the modes never mix ----------------------------------------------


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 1500), min_size=1, max_size=12),
       gaps_ms=st.lists(st.floats(0, 30), min_size=12, max_size=12),
       slo_ms=st.one_of(st.none(), st.floats(20, 2000)), deadline_free=st.booleans())
def test_every_request_finishes_and_no_step_mixes_short_and_long(lengths, gaps_ms, slo_ms, deadline_free):
    policy = LapsPolicy(perf_model=MODEL, deadline_free=deadline_free, long_chunk_tokens=256)
    sched = make(policy, budget=1024, max_num_seqs=8)
    arrivals = list(itertools.accumulate(g / 1000 for g in gaps_ms))[:len(lengths)]
    pending = list(zip(arrivals, lengths))
    done: set[str] = set()
    for _ in range(5000):
        while pending and pending[0][0] <= sched.clock.now:
            _, n = pending.pop(0)
            add(sched, f"r{len(lengths) - len(pending)}", n, ttft_s=None if slo_ms is None else slo_ms / 1000)
        if not pending and not sched.waiting and not sched.running:
            break
        out = sched.schedule()
        classes = {policy._short_class[e.seq.key] for e in out.entries if e.start < e.seq.prompt_len}
        assert len(classes) <= 1, "a step mixed a short and a long prefill"
        if out.entries:
            sampled = {e.seq.key: 1 for e in out.entries if e.samples}
            done |= {key.request_id for key in sampled}
            latency = step_time(MODEL, out.shape)
            sched.update_from_output(out, sampled, latency)
            sched.clock.now += latency
        else:  # held (or waiting for the next arrival): jump to whichever comes first
            wake = [t for t in (out.hold_until, pending[0][0] if pending else None) if t is not None]
            assert wake, "nothing runs, nothing is held, nothing arrives: a stall"
            sched.clock.now = max(sched.clock.now, min(wake))
    assert len(done) == len(lengths)


def test_the_shape_grid():
    grid = ShapeGrid("8,16,32", "1,2,4")
    assert (grid.token_bucket(1), grid.token_bucket(16), grid.token_bucket(17), grid.token_bucket(33)) == (8, 16, 32, None)
    assert (grid.batch_bucket(3), grid.batch_bucket(5)) == (4, None)
    assert (grid.depth_at_most(0), grid.depth_at_most(3), grid.depth_at_most(9)) == (1, 2, 4)
    assert (grid.next_depth(1), grid.next_depth(2), grid.next_depth(4)) == (2, 4, 4)
    assert grid.padded([5, 9, 3]) == (16, 4) and grid.padded([40]) is None and grid.padded([]) is None
    with pytest.raises(ValueError, match="shape_tokens"):
        ShapeGrid("0,8", "1")
