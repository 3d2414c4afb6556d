"""Session history pinned on the bound worker between rounds (AMPD binding): the scheduler's
`SessionPins` — pinned prefixes hit, survive cache pressure from other requests, expire,
are released on close, and are evicted (least recently used first) only before a running
request would be preempted."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.core import FinishReason, SamplingParams, StageSpec
from splitserve.core.policies.fcfs import FcfsPolicy
from splitserve.core.sequence import SessionHold
from tests.unit.test_scheduler import Sim


def round_spec(rid: str, prompt: list[int], session: str, history: int = 0, ttl: float = 60.0, max_tokens: int = 4):
    return StageSpec.whole(rid, prompt, SamplingParams(max_tokens=max_tokens), session=SessionHold(session, ttl, history))


def run_round(sim: Sim, rid: str, prompt: list[int], session: str, history: int = 0, ttl: float = 60.0,
              max_tokens: int = 4):
    seq = sim.sched.add_stage(round_spec(rid, prompt, session, history, ttl, max_tokens))
    sim.seqs[rid] = seq
    sim.run()
    assert seq.is_finished and seq.finish_reason is FinishReason.LENGTH
    return seq


def test_second_round_hits_the_pinned_history():
    sim = Sim(64, 4, 64, 4)
    first = run_round(sim, "r0", list(range(100, 118)), "s")
    pins = sim.sched.session_pins
    # 18 prompt + 3 computed outputs (the last sampled token has no KV yet): 21 computed, 5 full blocks.
    assert "s" in pins and pins.pinned_tokens("s") == 20 and sim.bm.num_used_blocks == 5
    history = first.token_ids  # 22 tokens: the next prompt repeats them, then a new turn
    hits_before = sim.bm.prefix_hits_tokens
    second = run_round(sim, "r1", history + [7, 8, 9], "s", history=len(history))
    assert sim.bm.prefix_hits_tokens - hits_before == 20  # the whole pinned history, no recompute
    assert pins.history_hits == 2 - 1 and pins.history_lost == 0  # first round expected none
    assert pins.pinned_tokens("s") == (len(second.token_ids) - 1) // 4 * 4


def test_pinned_history_survives_other_requests_filling_the_cache():
    sim = Sim(16, 4, 64, 4)
    run_round(sim, "r0", list(range(100, 112)), "s", max_tokens=2)  # 13 computed: 3 pinned blocks
    assert sim.bm.num_used_blocks == 3
    for i in range(6):  # unrelated requests whose blocks cycle through the free LRU
        sim.add(f"x{i}", list(range(1000 + 20 * i, 1012 + 20 * i)), max_tokens=2)
        sim.run()
    assert sim.sched.session_pins.pinned_tokens("s") == 12 and sim.sched.session_pins.evictions == 0


def test_pin_is_evicted_before_a_running_request_is_preempted():
    sim = Sim(8, 4, 64, 4)
    run_round(sim, "r0", list(range(100, 112)), "s", max_tokens=2)  # 3 pinned blocks of 8
    a = sim.add("a", list(range(500, 520)), max_tokens=8)  # needs 7 blocks in all
    sim.run()
    assert a.is_finished and a.num_preemptions == 0
    assert "s" not in sim.sched.session_pins and sim.sched.session_pins.evictions == 1
    # The evicted history is recomputed: the next round counts as lost.
    run_round(sim, "r1", list(range(100, 112)) + [1, 2, 3, 4], "s", history=14)
    assert sim.sched.session_pins.history_lost == 1


def test_least_recently_used_pin_goes_first():
    sim = Sim(12, 4, 64, 4)
    run_round(sim, "a0", list(range(100, 108)), "old", max_tokens=1)  # 2 blocks each
    sim.now = 1.0
    run_round(sim, "b0", list(range(200, 208)), "new", max_tokens=1)
    sim.now = 2.0
    sim.add("x", list(range(900, 934)), max_tokens=2)  # 9 blocks of 12, 8 free: one pin must go
    sim.run()
    pins = sim.sched.session_pins
    assert "old" not in pins and "new" in pins and pins.evictions == 1


def test_pins_expire_after_their_idle_ttl_and_close_releases():
    sim = Sim(32, 4, 64, 4)
    run_round(sim, "a0", list(range(100, 110)), "a", ttl=5.0)
    run_round(sim, "b0", list(range(200, 210)), "b", ttl=50.0)
    sim.now += 6.0  # (steps advance the clock too)
    sim.sched.schedule()  # a step looks at expiry
    pins = sim.sched.session_pins
    assert "a" not in pins and "b" in pins and pins.expirations == 1
    assert sim.sched.release_session("b") and not sim.sched.release_session("b")
    assert sim.bm.num_used_blocks == 0 and pins.num_pinned_blocks == 0


def test_aborted_round_pins_nothing():
    sim = Sim(32, 4, 64, 4)
    seq = sim.sched.add_stage(round_spec("r0", list(range(100, 120)), "s"))
    sim.sched.schedule()
    sim.sched.abort(seq.key)
    assert "s" not in sim.sched.session_pins and sim.bm.num_used_blocks == 0


def test_session_hold_validates():
    with pytest.raises(ValueError, match="session_id"):
        SessionHold("", 1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        SessionHold("s", 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 24), st.integers(1, 6), st.booleans()),
                min_size=1, max_size=24))
def test_random_sessions_keep_block_accounting_consistent(rounds):
    """Rounds of a few sessions (each prompt its history plus new tokens), interleaved with
    closes, on a small cache: refcounts always match pins + sequences, and everything is
    free once all sessions close."""
    sim = Sim(24, 4, 32, 4)
    histories: dict[int, list[int]] = {}
    for i, (session, new_tokens, max_tokens, close) in enumerate(rounds):
        sim.now += 1.0
        if close and session in histories:
            sim.sched.release_session(f"s{session}")
            del histories[session]
            continue
        history = histories.get(session, [])
        prompt = history + [(session * 997 + len(history) + t) % 4000 for t in range(new_tokens)]
        if len(prompt) + max_tokens > 24 * 4:
            continue
        seq = sim.sched.add_stage(round_spec(f"r{i}", prompt, f"s{session}", len(history), max_tokens=max_tokens))
        sim.seqs[f"r{i}"] = seq
        sim.run()
        histories[session] = list(seq.token_ids)
        pins = sim.sched.session_pins
        held = sum(len(s.block_table) for s in sim.sched.sequences.values())
        assert pins.num_pinned_blocks + held >= sim.bm.num_used_blocks
        assert sum(sim.bm.ref_counts(list(range(24)))) == pins.num_pinned_blocks + held
    for session in list(histories):
        sim.sched.release_session(f"s{session}")
    assert sim.bm.num_used_blocks == 0


class _RecordingFcfs(FcfsPolicy):
    """fcfs that notes what each step reports as free KV, idle pins' blocks included."""

    def __init__(self) -> None:
        super().__init__()
        self.free_fractions: list[float] = []

    def next_batch(self, step, now) -> None:
        self.free_fractions.append(step.kv_free_fraction + step.kv_reclaimable_fraction)
        super().next_batch(step, now)


def test_idle_pins_count_as_free_kv_for_the_pressure_signal():
    """A worker whose blocks are held by idle session pins is not under KV pressure (the pins
    give way to any request), but blocks a running round shares with its pin are in use."""
    policy = _RecordingFcfs()
    sim = Sim(16, 4, 64, 4, policy=policy)
    first = run_round(sim, "r0", list(range(100, 132)), "s", max_tokens=2)  # 33 computed: 8 pinned blocks
    assert sim.bm.num_free_blocks == 8 and sim.sched.session_pins.num_pinned_blocks == 8
    other = sim.add("x", list(range(500, 504)), max_tokens=2)
    sim.step()
    assert policy.free_fractions[-1] == 1.0  # only pins hold blocks: all of them are room
    sim.run()
    assert other.is_finished
    # The next round shares the pinned blocks: those are in use while it runs.
    history = first.token_ids
    sim.seqs["r1"] = sim.sched.add_stage(round_spec("r1", history + [7, 8, 9, 10], "s", history=len(history),
                                                    max_tokens=2))
    sim.step()  # admits r1 on the pinned prefix and prefills the rest
    in_use = sim.bm.num_used_blocks  # the 8 pinned blocks, shared, and r1's own
    assert in_use > 8
    sim.step()
    assert policy.free_fractions[-1] == pytest.approx((16 - in_use) / 16)


def test_the_next_round_takes_its_history_hashes_from_the_pin_and_they_equal_hashing():
    # A long history is hashed once per round, not once per round and worker step: the next
    # round's prompt starts with the pinned history, so its hashes are the pin's (checked token
    # for token), which are exactly what hashing the prompt gives.
    sim = Sim(64, 4, 64, 4)
    first = run_round(sim, "r0", list(range(100, 118)), "s")
    prompt = first.token_ids + [7, 8, 9]
    pinned = sim.sched.session_pins.pinned_tokens("s") // 4
    seq = sim.sched.add_stage(round_spec("r1", prompt, "s", history=len(first.token_ids)))
    assert pinned == 5 and seq.block_hashes == first.block_hashes[:pinned]  # seeded before anything hashed it
    fresh = Sim(64, 4, 64, 4).sched.add_stage(round_spec("x", prompt, "t"))
    assert fresh.block_hashes == [] and sim.bm.update_block_hashes(seq) == Sim(64, 4, 64, 4).bm.update_block_hashes(fresh)
    # A prompt that does not repeat the history (one token differs) is not seeded.
    other = sim.sched.add_stage(round_spec("r2", [0] + prompt[1:], "s", history=len(first.token_ids)))
    assert other.block_hashes == []


def test_a_stage_takes_the_hashes_of_the_prompt_its_lease_hashed():
    sim = Sim(64, 4, 64, 4)
    run_round(sim, "r0", list(range(100, 118)), "s")
    prompt = list(range(100, 118)) + [5, 6, 7, 8, 9]
    held = sim.sched.hold_cached_prefix(prompt, 16)
    assert len(held) == 4
    seq = sim.add("lent", prompt, max_tokens=2)
    assert seq.block_hashes == Sim(64, 4, 64, 4).bm.update_block_hashes(
        Sim(64, 4, 64, 4).sched.add_stage(StageSpec.whole("y", prompt, SamplingParams(max_tokens=2))))
    assert len(seq.block_hashes) == 5 and not sim.sched._leased_prompts  # taken once
    sim.sched.release_lease(held)
    sim.run()
