"""The reference generate when the mask predictor predicts the mask token (issue 37).

LLaDA's `generate` (github.com/ML-GSAI/LLaDA, generate.py) writes the argmax at the transferred
positions (`x[transfer_index] = x0[transfer_index]`), so a transfer whose argmax is the mask is
spent and leaves the position masked; it is a candidate again at every later step, in later
blocks too (only positions past the current block get `-inf` confidence). Positions still masked
at the end are what its decode (`skip_special_tokens=True`) drops."""

from __future__ import annotations

import torch

from workers.diffusion.reference import DiffusionParams, generate, step_positions

MASK = 9
VOCAB = 10
PROMPT = [1, 2]
# Output position -> the peak logit of token 3 there (its confidence order).
PEAKS = [0.0, 3.0, 2.0, 1.0, 10.0, 4.0, 5.0, 6.0]


class PredictsMaskUntilPosition4:
    """Token 3 everywhere (more confident the larger PEAKS), except output position 0: the mask,
    with near-certainty, while output position 4 is masked; then token 5, as certain."""

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*input_ids.shape, VOCAB)
        for position, peak in enumerate(PEAKS):
            logits[:, len(PROMPT) + position, 3] = peak
        first = len(PROMPT)
        for row in range(input_ids.shape[0]):
            logits[row, first, :] = 0.0
            logits[row, first, MASK if input_ids[row, first + 4] == MASK else 5] = 20.0
        return logits


def test_a_transfer_to_the_mask_is_spent_and_the_position_is_decided_again_in_a_later_block():
    params = DiffusionParams(gen_length=8, block_length=4, steps=4)  # 2 blocks x 2 steps, 2 transfers a step
    (out,) = generate(PredictsMaskUntilPosition4(), [PROMPT], params, mask_token_id=MASK)
    # Block 0: position 0 takes a transfer at both steps (the mask: spent), positions 1 and 2
    # the others; 0 and 3 stay masked. Block 1, step 2: position 0 (the mask again) and 4;
    # step 3: position 0, now 5 (position 4 is unmasked), and 7. Positions 3, 5, 6 never are.
    assert out.tokens == (5, 3, 3, MASK, 3, MASK, MASK, 3)
    assert out.commit_step == (3, 0, 1, -1, 2, -1, -1, 3)
    assert out.output_tokens == (5, 3, 3, 3, 3)


def test_step_positions_are_the_earlier_masked_positions_then_the_block():
    ids = torch.tensor([1, 2, MASK, 3, MASK, 4, MASK, MASK, MASK, MASK])
    assert step_positions(ids, 2, 6, 10, MASK).tolist() == [2, 4, 6, 7, 8, 9]
    assert step_positions(ids, 2, 6, 10, MASK, earlier=False).tolist() == [6, 7, 8, 9]
    assert step_positions(ids, 2, 2, 6, MASK).tolist() == [2, 3, 4, 5]
