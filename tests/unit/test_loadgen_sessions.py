"""Multi-round session generation against the published AMPD preset means."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.sessions import (
    PRESETS,
    Round,
    Session,
    SessionPreset,
    ToolDelay,
    generate_sessions,
    parse_tool_delay,
    session_stats,
)

PUBLISHED = {
    "toolbench": (3.96, 703.79, 50.39),
    "gaia": (11.32, 6161.02, 528.76),
    "hotpotqa": (3.0, 1569.8, 80.03),
    "dureader": (3.0, 3081.23, 150.10),
}


def test_presets_hold_the_published_means():
    for name, (rounds, prefill, decode) in PUBLISHED.items():
        p = PRESETS[name]
        assert (p.mean_rounds, p.mean_prefill_tokens, p.mean_decode_tokens) == (rounds, prefill, decode)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_large_sample_means_match_the_preset(name):
    rounds, prefill, decode = PUBLISHED[name]
    n = int(60_000 / rounds)
    stats = session_stats(generate_sessions(name, n, np.random.default_rng(11)))
    assert stats.n_sessions == n
    assert stats.mean_rounds == pytest.approx(rounds, rel=0.02)
    assert stats.mean_prefill_tokens == pytest.approx(prefill, rel=0.02)
    assert stats.mean_decode_tokens == pytest.approx(decode, rel=0.02)
    assert stats.mean_delay_s == pytest.approx(1.0, rel=0.03)


def test_integral_round_means_are_fixed():
    sessions = generate_sessions("hotpotqa", 200, np.random.default_rng(0))
    assert {len(s.rounds) for s in sessions} == {3}


def test_length_scale_scales_the_means():
    stats = session_stats(generate_sessions("dureader", 10_000, np.random.default_rng(5), length_scale=0.0625))
    assert stats.mean_prefill_tokens == pytest.approx(3081.23 * 0.0625, rel=0.02)
    assert stats.mean_decode_tokens == pytest.approx(150.10 * 0.0625, rel=0.02)


def test_deterministic_under_seed():
    a = generate_sessions("gaia", 50, np.random.default_rng(3))
    b = generate_sessions("gaia", 50, np.random.default_rng(3))
    c = generate_sessions("gaia", 50, np.random.default_rng(4))
    assert a == b and a != c


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(PRESETS)),
    n=st.integers(0, 30),
    seed=st.integers(0, 2**32 - 1),
    scale=st.floats(0.001, 2.0),
)
def test_sessions_are_well_formed(name, n, seed, scale):
    sessions = generate_sessions(name, n, np.random.default_rng(seed), length_scale=scale)
    assert len(sessions) == n
    assert len({s.session_id for s in sessions}) == n
    for s in sessions:
        assert len(s.rounds) >= 1
        assert s.rounds[0].delay_before_s == 0.0
        for r in s.rounds:
            assert r.incr_prompt_len >= 1 and r.output_len >= 1 and r.delay_before_s >= 0


def test_history_and_context_lengths():
    s = Session("s", [Round(100, 10, 0.0), Round(20, 5, 1.0), Round(7, 3, 0.5)])
    assert [s.history_len(i) for i in range(3)] == [0, 110, 135]
    assert [s.context_len(i) for i in range(3)] == [100, 130, 142]


def test_tool_delay_distributions():
    rng = np.random.default_rng(0)
    assert ToolDelay("constant", 0.25).sample(3, rng).tolist() == [0.25] * 3
    assert ToolDelay("none").sample(2, rng).tolist() == [0.0, 0.0]
    assert ToolDelay("exponential", 2.0).sample(50_000, rng).mean() == pytest.approx(2.0, rel=0.03)
    sessions = generate_sessions("toolbench", 100, rng, tool_delay=ToolDelay("constant", 0.5))
    assert {r.delay_before_s for s in sessions for r in s.rounds[1:]} == {0.5}
    assert parse_tool_delay("exponential:mean=1") == ToolDelay("exponential", 1.0)
    assert parse_tool_delay("constant:mean=0.5") == ToolDelay("constant", 0.5)
    assert parse_tool_delay("none") == ToolDelay("none", 0.0)
    with pytest.raises(ValueError, match="^kind:"):
        parse_tool_delay("pareto:mean=1")
    with pytest.raises(ValueError, match="^mean:"):
        parse_tool_delay("constant:mean=x")


def test_bad_arguments():
    with pytest.raises(ValueError, match="^preset:"):
        generate_sessions("nope", 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="^length_scale:"):
        generate_sessions("gaia", 1, np.random.default_rng(0), length_scale=0)
    with pytest.raises(ValueError, match="^mean_rounds:"):
        SessionPreset("x", 0.5, 10, 10)
    custom = SessionPreset("custom", 2.5, 100.0, 10.0, length_sigma=0.0)
    sessions = generate_sessions(custom, 5, np.random.default_rng(0))
    assert all(r.incr_prompt_len == 100 and r.output_len == 10 for s in sessions for r in s.rounds)
