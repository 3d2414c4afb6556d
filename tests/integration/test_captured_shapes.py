"""LAPS captured shapes on the CPU: a step of short prefills padded to its `(tokens, batch)`
bucket computes what the unpadded step computes (the same logits to float32 rounding: the
linear layers see more rows and a BLAS may round differently for another row count; the
same tokens), and never touches a sequence's KV cache with its pad tokens."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.core import StageKey, StageSpec
from splitserve.core.shapes import ShapeGrid
from workers.engine import LLM, SamplingParams
from workers.engine.captured_shapes import pad_prefill_batch, padded_shape


def _prompts(seed: int, lengths: list[int], vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_padded_step_gives_the_unpadded_logits_and_leaves_the_real_kv_alone(tiny_model_dirs, arch):
    llm = LLM(str(tiny_model_dirs[arch]), captured_shapes=True, shape_tokens="8,16,32", shape_batches="1,2,4,8")
    engine, runner = llm.engine, llm.engine.runner
    lengths = [5, 13, 7]  # buckets: L = 16, B = 4: 64 tokens, 39 of them padding
    for i, ids in enumerate(_prompts(1, lengths)):
        engine.add_stage(StageSpec(StageKey(f"r{i}"), tuple(ids), SamplingParams(max_tokens=2, temperature=0.0)))
    out = engine.scheduler.schedule()
    batch = runner.prepare(out.entries)
    padded = pad_prefill_batch(batch, runner.shapes, runner.num_blocks, runner.block_size)
    assert padded is not None and padded.input_ids.shape[0] == 16 * 4
    with torch.inference_mode():
        plain = runner.model(batch.input_ids, batch.positions, runner.layer_caches, batch.meta, batch.logits_indices)
        real_kv = runner.kv_cache[: runner.num_blocks].clone()
        scratch_before = runner.kv_cache[runner.num_blocks:].clone()
        bucketed = runner.model(padded.input_ids, padded.positions, runner.layer_caches, padded.meta,
                                padded.logits_indices)
    # Every real row as without padding, to float32 rounding (bit-identical for these shapes
    # today; a BLAS may choose another kernel for another row count), and the same tokens.
    assert torch.allclose(plain, bucketed, rtol=0.0, atol=1e-4)
    assert torch.equal(plain.argmax(-1), bucketed.argmax(-1))
    assert torch.allclose(runner.kv_cache[: runner.num_blocks], real_kv, rtol=0.0, atol=1e-5)
    # The pads wrote only the scratch block: no real KV slot they could reach changed.
    touched = set(padded.meta.slot_blocks[batch.input_ids.shape[0]:].tolist())
    assert touched == {runner.num_blocks}
    assert not torch.equal(runner.kv_cache[runner.num_blocks:], scratch_before)


def test_generation_with_captured_shapes_is_token_exact_and_pads_the_short_prefill_steps(tiny_model_dirs):
    prompts = _prompts(2, [3, 9, 17, 30, 6, 12, 70])  # 70 tokens fits no bucket: that step runs unpadded
    params = SamplingParams(max_tokens=12, temperature=0.0)
    plain = LLM(str(tiny_model_dirs["llama"])).generate(prompts, params)
    captured = LLM(str(tiny_model_dirs["llama"]), captured_shapes=True, max_num_seqs=4)
    bucketed = captured.generate(prompts, params)
    assert [o.token_ids for o in bucketed] == [o.token_ids for o in plain]
    assert captured.engine.runner.num_padded_steps >= 1


def test_only_prefill_steps_that_fit_a_bucket_are_padded():
    grid = ShapeGrid((8, 16), (1, 2, 4))
    assert padded_shape(grid, 0, [3, 9]) == (16, 2)
    assert padded_shape(grid, 1, [3]) is None  # decodes in the step: no captured shape
    assert padded_shape(grid, 0, [17]) is None  # longer than every length bucket
    assert padded_shape(grid, 0, [1] * 5) is None  # more requests than the largest batch
    assert padded_shape(grid, 0, []) is None
