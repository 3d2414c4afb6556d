"""Request shapes, synthetic prompt tokens and Mooncake prefix-block tokens."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.traces import TraceRequest, scale_lengths
from loadgen.workloads import (
    DYNASERVE_SHAPES,
    PrefixBlockTokens,
    RequestShape,
    make_prompt_tokens,
    parse_shape,
    parse_shapes,
)


def test_parse_dynaserve_shapes():
    assert parse_shapes("P8192/D32, P2048/D512,P219/D1467") == list(DYNASERVE_SHAPES)
    assert parse_shape("p219/d1467") == RequestShape(219, 1467)
    assert str(RequestShape(8192, 32)) == "P8192/D32"
    assert RequestShape(8192, 32).scaled(0.0625) == RequestShape(512, 2)


@pytest.mark.parametrize(
    "spec, field",
    [("P8192", "shape"), ("X1/D2", "shape"), ("Pabc/D32", "prompt_len"), ("P10/D-3", "output_len"),
     ("P0/D5", "prompt_len"), ("P5/D0", "output_len"), ("P1.5/D2", "prompt_len")],
)
def test_parse_shape_errors_name_the_field(spec, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        parse_shape(spec)


@settings(max_examples=50, deadline=None)
@given(prompt=st.integers(1, 10**6), output=st.integers(1, 10**6))
def test_shape_string_round_trip(prompt, output):
    shape = RequestShape(prompt, output)
    assert parse_shape(str(shape)) == shape


def test_make_prompt_tokens_length_range_prefix_and_determinism():
    tokens = make_prompt_tokens(100, np.random.default_rng(3), 10, 20, shared_prefix=[1, 2, 3])
    assert len(tokens) == 100 and tokens[:3] == [1, 2, 3]
    assert all(10 <= t < 20 for t in tokens[3:])
    assert tokens == make_prompt_tokens(100, np.random.default_rng(3), 10, 20, shared_prefix=[1, 2, 3])
    assert make_prompt_tokens(2, np.random.default_rng(0), 10, 20, shared_prefix=[1, 2, 3]) == [1, 2]
    assert make_prompt_tokens(0, np.random.default_rng(0), 10, 20) == []
    with pytest.raises(ValueError, match="vocab"):
        make_prompt_tokens(5, np.random.default_rng(0), 20, 20)


def test_equal_hash_ids_give_identical_token_blocks():
    blocks = PrefixBlockTokens(vocab_lo=5, vocab_hi=1000, seed=7)
    a = TraceRequest(0.0, 1000, 10, (0, 1), 512)
    b = TraceRequest(0.0, 1100, 10, (0, 2, 3), 512)
    ta = blocks.prompt_tokens(a, np.random.default_rng(1))
    tb = blocks.prompt_tokens(b, np.random.default_rng(2))
    assert len(ta) == 1000 and len(tb) == 1100
    assert ta[:512] == tb[:512]  # shared hash id 0
    assert ta[512:1000] != tb[512:1000]
    # Another instance (another process) with the same seed makes the same blocks.
    again = PrefixBlockTokens(vocab_lo=5, vocab_hi=1000, seed=7)
    assert again.prompt_tokens(a, np.random.default_rng(99)) == ta
    assert PrefixBlockTokens(5, 1000, seed=8).block(0, 512) != blocks.block(0, 512)


def test_prefix_blocks_follow_the_length_scale():
    blocks = PrefixBlockTokens(0, 50_000)
    a, b = scale_lengths([TraceRequest(0.0, 6758, 500, tuple(range(14)), 512),
                          TraceRequest(1.0, 7322, 490, (0, *range(14, 28)), 512)], 0.0625)
    ta = blocks.prompt_tokens(a, np.random.default_rng(0))
    tb = blocks.prompt_tokens(b, np.random.default_rng(0))
    assert (len(ta), len(tb)) == (422, 458)
    assert ta[:32] == tb[:32] and ta[32:64] != tb[32:64]


def test_prompt_longer_than_its_blocks_is_filled_with_fresh_tokens():
    blocks = PrefixBlockTokens(0, 100)
    r = TraceRequest(0.0, 10, 1, (4,), 3)
    tokens = blocks.prompt_tokens(r, np.random.default_rng(0))
    assert len(tokens) == 10 and tokens[:3] == blocks.block(4, 3)
    azure = TraceRequest(0.0, 7, 1)
    assert len(blocks.prompt_tokens(azure, np.random.default_rng(0))) == 7
