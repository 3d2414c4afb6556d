"""The reference masked-diffusion generate (LLaDA's semantics) on toy mask predictors:
the transfer schedule, block order, remasking, guidance and validation."""

from __future__ import annotations

import pytest
import torch

from workers.diffusion.reference import (
    DiffusionParams,
    add_gumbel_noise,
    generate,
    transfer_token_schedule,
)

MASK = 9
VOCAB = 10


class PositionTable:
    """A mask predictor whose logits depend on the position only; records every input."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # [T, VOCAB]
        self.calls: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.calls.append(input_ids.clone())
        return self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1).clone()


def _peaked(candidates: list[int], peaks: list[float]) -> torch.Tensor:
    """Logits with `candidates[t]` the argmax at position t, more probable the larger `peaks[t]`."""
    table = torch.zeros(len(candidates), VOCAB)
    for position, (token, peak) in enumerate(zip(candidates, peaks)):
        table[position, token] = peak
    return table


@pytest.mark.parametrize("count, steps, expected", [
    (10, 4, [3, 3, 2, 2]),
    (4, 4, [1, 1, 1, 1]),
    (3, 5, [1, 1, 1, 0, 0]),
    (0, 2, [0, 0]),
    (32, 1, [32]),
])
def test_transfer_token_schedule(count, steps, expected):
    assert transfer_token_schedule(count, steps) == expected


def test_transfer_token_schedule_is_even_and_complete():
    for count in range(0, 40):
        for steps in range(1, 12):
            schedule = transfer_token_schedule(count, steps)
            assert sum(schedule) == count
            assert max(schedule) - min(schedule) <= 1
            assert schedule == sorted(schedule, reverse=True)


def test_positions_past_the_current_block_are_never_unmasked():
    prompt = [1, 2]
    gen_length, block_length, steps = 8, 4, 4  # 2 blocks of 2 steps, 2 tokens per step
    # Later positions are the most confident: without the block limit they would go first.
    table = _peaked([3] * 10, [float(t) for t in range(10)])
    model = PositionTable(table)
    params = DiffusionParams(gen_length=gen_length, block_length=block_length, steps=steps)
    (out,) = generate(model, [prompt], params, mask_token_id=MASK)

    assert out.commit_step == (1, 1, 0, 0, 3, 3, 2, 2)
    assert len(model.calls) == steps
    for call, ids in enumerate(model.calls):
        block = call // params.steps_per_block
        block_end = len(prompt) + (block + 1) * block_length
        assert (ids[0, block_end:] == MASK).all()
        unmasked = int((ids[0, len(prompt):block_end] != MASK).sum())
        assert unmasked == block * block_length + 2 * (call % params.steps_per_block)
    assert out.tokens == (3,) * gen_length
    assert out.sequence == (1, 2) + (3,) * gen_length


def test_low_confidence_unmasks_the_most_probable_candidates_first():
    candidates = [0, 0, 4, 5, 6, 7, 1, 2, 8, 3]  # positions 0-1 are the prompt
    peaks = [0, 0, 2.0, 9.0, 1.0, 5.0, 7.0, 3.0, 8.0, 4.0]
    model = PositionTable(_peaked(candidates, peaks))
    params = DiffusionParams(gen_length=8, block_length=8, steps=4)
    (out,) = generate(model, [[1, 2]], params, mask_token_id=MASK)
    assert out.tokens == tuple(candidates[2:])
    # Two per step by descending peak: 9, 8 | 7, 5 | 4, 3 | 2, 1.
    assert out.commit_step == (3, 0, 3, 1, 1, 2, 0, 2)


def test_equal_confidences_unmask_the_lower_position_first():
    model = PositionTable(torch.zeros(6, VOCAB))
    (out,) = generate(model, [[1, 2]], DiffusionParams(gen_length=4, block_length=4, steps=4), mask_token_id=MASK)
    assert out.commit_step == (0, 1, 2, 3)
    assert out.tokens == (0, 0, 0, 0)  # the first maximal id


def test_random_remasking_is_reproducible_from_the_generator_alone():
    model = PositionTable(_peaked([5] * 18, [float(t) for t in range(18)]))
    params = DiffusionParams(gen_length=16, block_length=16, steps=16, remasking="random")

    def run(seed: int):
        (out,) = generate(model, [[1, 2]], params, mask_token_id=MASK,
                          generators=[torch.Generator().manual_seed(seed)])
        return out

    torch.manual_seed(0)
    before = torch.rand(3)
    first = run(7)
    torch.manual_seed(0)
    again = run(7)
    assert torch.equal(torch.rand(3), before)  # the global RNG is neither used nor moved
    assert first == again
    orders = {run(seed).commit_step for seed in range(6)}
    assert len(orders) > 1
    # Confidence-ordered (low_confidence) would follow the peaks: last position first.
    assert any(order != tuple(range(15, -1, -1)) for order in orders)


def test_temperature_samples_reproducibly_and_needs_a_generator():
    table = torch.zeros(10, VOCAB)
    table[:, :4] = 1.0  # four equally likely candidates everywhere
    model = PositionTable(table)
    params = DiffusionParams(gen_length=8, block_length=4, steps=8, temperature=1.0)
    outs = [generate(model, [[1, 2]], params, mask_token_id=MASK,
                     generators=[torch.Generator().manual_seed(seed)])[0] for seed in (3, 3, 4)]
    assert outs[0] == outs[1]
    assert outs[0].tokens != outs[2].tokens
    assert set(outs[0].tokens) <= {0, 1, 2, 3} and len(set(outs[0].tokens)) > 1
    with pytest.raises(ValueError, match="generators"):
        generate(model, [[1, 2]], params, mask_token_id=MASK)


def test_gumbel_noise_samples_the_softmax_in_float64():
    logits = torch.log(torch.tensor([0.7, 0.3])).expand(4000, 2)
    assert add_gumbel_noise(logits, 0.0, torch.Generator()) is logits
    noisy = add_gumbel_noise(logits, 1.0, torch.Generator().manual_seed(0))
    assert noisy.dtype == torch.float64
    share = (noisy.argmax(dim=-1) == 0).double().mean().item()
    assert 0.67 < share < 0.73


def test_cfg_scale_zero_is_no_guidance_and_guidance_uses_the_masked_prompt():
    prompt = [1, 2]

    class PromptSensitive:
        """cond favours token 0 slightly over 1; without the prompt token 1 is far behind."""

        def __init__(self):
            self.calls = []

        def __call__(self, ids):
            self.calls.append(ids.clone())
            sees_prompt = (ids[:, :2] != MASK).all(dim=1)
            logits = torch.zeros(ids.shape[0], ids.shape[1], VOCAB)
            logits[..., 0] = 2.0
            logits[..., 1] = torch.where(sees_prompt, 1.5, 0.5)[:, None]
            return logits

    plain, zero, guided = PromptSensitive(), PromptSensitive(), PromptSensitive()
    base = dict(gen_length=4, block_length=4, steps=2)
    (out_plain,) = generate(plain, [prompt], DiffusionParams(**base), mask_token_id=MASK)
    (out_zero,) = generate(zero, [prompt], DiffusionParams(**base, cfg_scale=0.0), mask_token_id=MASK)
    (out_guided,) = generate(guided, [prompt], DiffusionParams(**base, cfg_scale=1.0), mask_token_id=MASK)

    assert out_zero == out_plain and out_plain.tokens == (0, 0, 0, 0)
    assert all(c.shape[0] == 1 for c in zero.calls)
    # uncond + 2 * (cond - uncond) = [2.0, 2.5]: guidance flips the argmax to token 1.
    assert out_guided.tokens == (1, 1, 1, 1)
    for call in guided.calls:
        cond, uncond = call
        assert cond[:2].tolist() == prompt and (uncond[:2] == MASK).all()
        assert torch.equal(cond[2:], uncond[2:])


def test_prompts_are_generated_independently():
    """Each prompt's output is the one it gets alone, whatever its length or batch position."""

    def model(ids):  # logits depend on the whole sequence: its token sum and the position
        total = ids.sum(dim=1, keepdim=True).float()
        positions = torch.arange(ids.shape[1]).float()[None]
        logits = torch.stack([torch.sin(total * (k + 1) + positions * 0.7) for k in range(VOCAB)], dim=-1)
        return logits

    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 1]]
    params = DiffusionParams(gen_length=6, block_length=3, steps=4, temperature=0.5, remasking="random")
    seeds = [11, 12, 13]
    batch = generate(model, prompts, params, mask_token_id=MASK,
                     generators=[torch.Generator().manual_seed(s) for s in seeds])
    alone = [generate(model, [p], params, mask_token_id=MASK, generators=[torch.Generator().manual_seed(s)])[0]
             for p, s in zip(prompts, seeds)]
    assert batch == alone
    assert [out.prompt for out in batch] == [tuple(p) for p in prompts]


@pytest.mark.parametrize("kwargs, field", [
    ({"gen_length": 10, "block_length": 4}, "block_length"),
    ({"gen_length": 8, "block_length": 4, "steps": 3}, "steps"),
    ({"gen_length": 0}, "gen_length"),
    ({"steps": 0}, "steps"),
    ({"block_length": 2.0}, "block_length"),
    ({"temperature": -0.5}, "temperature"),
    ({"cfg_scale": -1.0}, "cfg_scale"),
    ({"remasking": "top_k"}, "remasking"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DiffusionParams(**kwargs)


def test_bad_generate_arguments_are_refused():
    model = PositionTable(torch.zeros(12, VOCAB))
    params = DiffusionParams(gen_length=4, block_length=4, steps=4, remasking="random")
    with pytest.raises(ValueError, match="generators"):
        generate(model, [[1]], params, mask_token_id=MASK)
    with pytest.raises(ValueError, match="generators has 1 entries"):
        generate(model, [[1], [2]], params, mask_token_id=MASK, generators=[torch.Generator()])
    with pytest.raises(ValueError, match=r"prompts\[1\] contains the mask token"):
        generate(model, [[1], [2, MASK]], DiffusionParams(gen_length=4, block_length=4, steps=4),
                 mask_token_id=MASK)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(model, [[1]], DiffusionParams(gen_length=4, block_length=4, steps=4), mask_token_id=VOCAB + 3)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        transfer_token_schedule(3, 0)
