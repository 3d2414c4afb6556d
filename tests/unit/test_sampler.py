"""Counter-based seeded sampling: mix_seed, greedy, batch invariance, top-k/top-p, distribution."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from workers.engine.sampler import counter_uniform, mix_seed, sample
from splitserve.core import SamplingParams


def rand_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float32) * 3.0


def draw_many(logits_row: torch.Tensor, params: SamplingParams, seed: int, indices) -> list[int]:
    """One sample per output index for the same row, all in one batch."""
    indices = list(indices)
    batch = logits_row.unsqueeze(0).expand(len(indices), -1).contiguous()
    return sample(batch, [params] * len(indices), [seed] * len(indices), indices)


# ---- mix_seed ------------------------------------------------------------------------


def test_mix_seed_is_deterministic_and_in_range():
    for seed, index in [(0, 0), (1, 0), (0, 1), (2**63 - 1, 10**6), (12345, 678)]:
        v = mix_seed(seed, index)
        assert v == mix_seed(seed, index)
        assert isinstance(v, int) and 0 <= v < 2**63


def test_mix_seed_no_collisions_over_10k_pairs():
    values = {mix_seed(s, i) for s in range(100) for i in range(100)}
    assert len(values) == 10_000
    # nearby seeds / indices and "swapped" pairs do not collide either
    more = {mix_seed(s, i) for s in (2**62, 2**62 + 1, 2**63 - 1) for i in range(1000)}
    assert len(more) == 3000
    assert mix_seed(1, 2) != mix_seed(2, 1)


def test_mix_seed_is_well_spread():
    vals = [mix_seed(7, i) for i in range(2000)]
    # every one of the 63 bits is set about half the time
    for bit in range(63):
        frac = sum((v >> bit) & 1 for v in vals) / len(vals)
        assert 0.42 < frac < 0.58, (bit, frac)
    # consecutive indices differ in about half their bits (avalanche)
    flips = [bin(a ^ b).count("1") for a, b in zip(vals, vals[1:])]
    assert 28 < sum(flips) / len(flips) < 35
    # the top bits are used: values are not confined to a small range
    assert max(vals) > 2**62 and min(vals) < 2**60


# ---- greedy -------------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    logits = rand_logits(16, 50, seed=1)
    params = [SamplingParams(temperature=0.0)] * 16
    got = sample(logits, params, list(range(16)), [0] * 16)
    assert got == logits.argmax(dim=-1).tolist()
    assert all(isinstance(t, int) for t in got)


def test_greedy_ignores_seed_index_top_k_and_top_p():
    logits = rand_logits(4, 30, seed=2)
    params = [
        SamplingParams(temperature=0.0, top_k=5),
        SamplingParams(temperature=0.0, top_p=0.1),
        SamplingParams(temperature=0.0, seed=3),
        SamplingParams(temperature=0.0),
    ]
    a = sample(logits, params, [1, 2, 3, 4], [0, 5, 9, 11])
    b = sample(logits, params, [99, 98, 97, 96], [7, 7, 7, 7])
    assert a == b == logits.argmax(dim=-1).tolist()



@pytest.mark.parametrize("temperature", [1e-46, 1e-40, 1e-12, 9.9e-6])
def test_tiny_temperature_is_greedy_not_nan(temperature):
    # In float32, 1e-46 is 0 and 1e-40 subnormal: logits / it are inf and the softmax NaN (what
    # sampling them did); any temperature below the threshold takes the argmax.
    logits = rand_logits(4, 40, seed=5) * 50
    params = [SamplingParams(temperature=temperature, top_p=p) for p in (1.0, 0.9, 1.0, 0.5)]
    assert all(p.greedy for p in params)
    assert sample(logits, params, [1, 2, 3, 4], [0, 1, 2, 3]) == logits.argmax(dim=-1).tolist()


def test_small_temperature_above_the_threshold_samples_near_argmax():
    logits = rand_logits(8, 40, seed=6) * 50
    params = [SamplingParams(temperature=1e-4)] * 8
    assert not params[0].greedy
    got = sample(logits, params, list(range(8)), [0] * 8)
    assert got == logits.argmax(dim=-1).tolist()  # logit gaps / 1e-4: the argmax's mass is ~1

# ---- batch invariance -----------------------------------------------------------------


def test_seeded_sampling_independent_of_row_order_and_batch_composition():
    vocab = 64
    logits = rand_logits(8, vocab, seed=3)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=20, top_p=0.95),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0.0),
    ]
    seeds = [11, 22, 33, 44, 55, 66, 77, 88]
    idx = [0, 3, 1, 4, 1, 5, 9, 2]
    full = sample(logits, params, seeds, idx)
    # each row alone
    alone = [sample(logits[i : i + 1], [params[i]], [seeds[i]], [idx[i]])[0] for i in range(8)]
    assert full == alone
    # permuted batch
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    permuted = sample(logits[perm], [params[i] for i in perm], [seeds[i] for i in perm], [idx[i] for i in perm])
    assert permuted == [full[i] for i in perm]
    # mixed into a bigger batch with unrelated rows
    noise = rand_logits(5, vocab, seed=4)
    big = torch.cat([noise[:2], logits, noise[2:]])
    big_params = [SamplingParams()] * 2 + params + [SamplingParams(temperature=0.0)] * 3
    got = sample(big, big_params, [1, 2] + seeds + [3, 4, 5], [0, 0] + idx + [0, 0, 0])
    assert got[2:10] == full


def test_same_seed_and_index_give_the_same_token_in_one_batch():
    logits = torch.zeros(6, 1000)
    got = sample(logits, [SamplingParams()] * 6, [42] * 6, [5] * 6)
    assert len(set(got)) == 1


def test_different_index_usually_different_draws():
    vocab = 1000
    row = torch.zeros(vocab)  # uniform: collisions only by chance
    draws = draw_many(row, SamplingParams(), seed=7, indices=range(200))
    assert len(set(draws)) > 150
    # different seeds at the same index too
    logits = row.unsqueeze(0).expand(200, -1).contiguous()
    by_seed = sample(logits, [SamplingParams()] * 200, list(range(200)), [0] * 200)
    assert len(set(by_seed)) > 150


def test_reproducible_across_calls():
    logits = rand_logits(3, 40, seed=5)
    params = [SamplingParams(temperature=0.9, top_p=0.8)] * 3
    assert sample(logits, params, [1, 2, 3], [4, 5, 6]) == sample(logits.clone(), params, [1, 2, 3], [4, 5, 6])


# ---- top-k / top-p -------------------------------------------------------------------


def test_top_k_one_equals_greedy():
    logits = rand_logits(50, 100, seed=6)
    greedy = logits.argmax(dim=-1).tolist()
    got = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 50, list(range(50)), list(range(50)))
    assert got == greedy


def test_tiny_top_p_equals_greedy():
    logits = rand_logits(50, 100, seed=7)
    greedy = logits.argmax(dim=-1).tolist()
    got = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 50, list(range(50)), [3] * 50)
    assert got == greedy


def test_top_k_masks_tokens_outside_the_top_k():
    vocab = 20
    logits = torch.linspace(0.0, 1.9, vocab)  # distinct, nearly flat: every token likely
    logits = logits[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    draws = draw_many(logits, SamplingParams(temperature=5.0, top_k=3), seed=1, indices=range(1500))
    assert set(draws) == top3
    # without top-k, the same draws range over (almost) the whole vocabulary
    free = draw_many(logits, SamplingParams(temperature=5.0), seed=1, indices=range(1500))
    assert len(set(free)) >= vocab - 1


def test_top_k_not_smaller_than_vocab_is_a_noop():
    logits = rand_logits(1, 10, seed=8)[0]
    a = draw_many(logits, SamplingParams(top_k=10), seed=3, indices=range(100))
    b = draw_many(logits, SamplingParams(top_k=0), seed=3, indices=range(100))
    c = draw_many(logits, SamplingParams(top_k=50), seed=3, indices=range(100))
    assert a == b == c


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    draws = draw_many(logits, SamplingParams(top_p=0.75), seed=5, indices=range(2000))
    assert set(draws) == {1, 3}  # 0.5 + 0.3 reaches 0.75
    # kept tokens keep their relative weights: 0.5 : 0.3
    frac1 = draws.count(1) / len(draws)
    assert abs(frac1 - 0.5 / 0.8) < 0.04
    draws = draw_many(logits, SamplingParams(top_p=0.85), seed=5, indices=range(2000))
    assert set(draws) == {1, 2, 3}
    draws = draw_many(logits, SamplingParams(top_p=0.4), seed=5, indices=range(500))
    assert set(draws) == {1}


def test_top_k_and_top_p_combine():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()
    # top_k=3 leaves [0.4, 0.3, 0.2] / 0.9; top_p=0.7 then needs 0.444 + 0.333 -> {0, 1}
    draws = draw_many(logits, SamplingParams(top_k=3, top_p=0.7), seed=9, indices=range(1500))
    assert set(draws) == {0, 1}


# ---- distribution --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_empirical_distribution_matches_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25])
    n = 4000
    draws = draw_many(logits, SamplingParams(temperature=temperature), seed=2024, indices=range(n))
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    expected = expected / expected.sum()
    counts = torch.bincount(torch.tensor(draws), minlength=len(logits)).double()
    freq = counts / n
    # max abs diff: ~4 standard errors of the largest probability
    se = math.sqrt(0.25 / n)
    assert (freq - expected).abs().max().item() < 4 * se
    # chi-square goodness of fit
    stat, p = chisquare(counts.numpy(), (expected * n).numpy())
    assert p > 1e-3, (stat, p, freq.tolist(), expected.tolist())


def test_masked_logits_are_never_sampled():
    logits = torch.tensor([0.0, float("-inf"), 1.0, float("-inf"), 0.5])
    draws = draw_many(logits, SamplingParams(temperature=1.0), seed=3, indices=range(1000))
    assert set(draws) == {0, 2, 4}
    draws = draw_many(logits, SamplingParams(temperature=0.3, top_p=0.99), seed=3, indices=range(500))
    assert 1 not in draws and 3 not in draws


def test_low_temperature_concentrates_on_the_argmax():
    logits = torch.tensor([1.0, 1.2, 0.9, 1.1])
    draws = draw_many(logits, SamplingParams(temperature=0.01), seed=1, indices=range(300))
    assert set(draws) == {1}


# ---- the counter-based noise (computed on the logits' device) ---------------------------


def _lowbias32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _uniform_reference(key: int, token: int) -> float:
    low, high = key & 0xFFFFFFFF, key >> 32
    h = _lowbias32_reference(token ^ low)
    h = _lowbias32_reference(h ^ high)
    h = _lowbias32_reference((h + low) & 0xFFFFFFFF)
    return ((h >> 9) + 0.5) / (1 << 23)


def test_counter_uniform_is_exact_integer_arithmetic_without_overflow():
    """The int64 tensor ops equal unbounded Python integers (no signed overflow anywhere):
    the same numbers on any device that does int64 arithmetic."""
    keys = [0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1, mix_seed(7, 3)]
    got = counter_uniform(torch.tensor(keys, dtype=torch.int64), 300)
    for r, key in enumerate(keys):
        for token in (0, 1, 2, 77, 255, 299):
            assert got[r, token].item() == _uniform_reference(key, token), (key, token)


def test_counter_uniform_depends_only_on_key_and_token():
    keys = torch.tensor([mix_seed(s, i) for s in range(6) for i in range(3)], dtype=torch.int64)
    full = counter_uniform(keys, 500)
    assert torch.equal(counter_uniform(keys[5:6], 500), full[5:6])
    assert torch.equal(counter_uniform(keys[[3, 0]], 500), full[[3, 0]])
    assert torch.equal(counter_uniform(keys, 200), full[:, :200])  # a token's noise ignores the vocabulary size
    assert ((full > 0) & (full < 1)).all()


def test_counter_uniform_is_uniform_and_uncorrelated():
    from scipy.stats import kstest

    keys = torch.tensor([mix_seed(11, i) for i in range(64)], dtype=torch.int64)
    u = counter_uniform(keys, 4096)
    assert kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    # neighbouring tokens and neighbouring output indices are not correlated
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]) < 0.02
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 0.02


def test_a_plain_row_samples_the_same_token_whether_or_not_filtered_rows_share_its_step():
    logits = rand_logits(4, 3000, seed=12)
    plain = [SamplingParams(temperature=1.0)] * 2
    alone = sample(logits[:2], plain, [5, 6], [1, 2])
    mixed = sample(logits, plain + [SamplingParams(top_k=40), SamplingParams(top_p=0.5)], [5, 6, 7, 8], [1, 2, 3, 4])
    assert mixed[:2] == alone


def test_a_batch_larger_than_one_noise_chunk_samples_each_row_as_alone():
    from workers.engine.sampler import NOISE_ROWS

    rows = 2 * NOISE_ROWS + 3
    logits = rand_logits(rows, 500, seed=13)
    params = [SamplingParams(temperature=0.8, top_k=50 if i % 3 == 0 else 0) for i in range(rows)]
    seeds, idx = list(range(rows)), [i % 4 for i in range(rows)]
    full = sample(logits, params, seeds, idx)
    assert full == [sample(logits[i:i + 1], [params[i]], [seeds[i]], [idx[i]])[0] for i in range(rows)]


def test_argmax_rows_equals_torch_argmax_with_ties_and_nan():
    from workers.engine.sampler import argmax_rows

    logits = rand_logits(6, 300, seed=9)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1.0  # a tie: the first index wins
    logits[2, 40] = float("nan")  # NaN counts as the largest in both
    logits[3] = 0.0  # a row of equal values: index 0
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[1].item() == 7 and got[3].item() == 0
    strided = logits.t().contiguous().t()  # a non-contiguous view gives the same answer
    assert argmax_rows(strided).tolist() == got.tolist()


def test_argmax_rows_on_inf_rows_float64_and_the_bfloat16_fallback():
    from workers.engine.sampler import argmax_rows

    logits = rand_logits(3, 50, seed=11)
    logits[0] = float("-inf")  # every token masked: index 0, as torch
    for scores in (logits, logits.double(), logits.bfloat16()):
        with torch.inference_mode():
            got = argmax_rows(scores.clone())
        assert got.dtype == torch.int64 and got.tolist() == scores.argmax(dim=-1).tolist()
