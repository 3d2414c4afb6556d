"""LAPS captured shapes on the CPU: a step of short (re-)prefills run as its `(L, B, K)` bucket
computes what the unpadded step computes (the same logits to float32 rounding: the linear
layers see more rows and attention runs as one masked batched call, so a BLAS may round
differently; the same tokens), through static buffers whose addresses never change, and
never touches a sequence's KV cache with its pad tokens."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.core import StageKey, StageSpec
from splitserve.core.shapes import ShapeGrid
from workers.engine import LLM, SamplingParams
from workers.engine.captured_shapes import BucketKey, BucketRunner, build_bucket_step, context_blocks_bucket


def _prompts(seed: int, lengths: list[int], vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


class _Seq:
    """The fields of a `Sequence` that `build_bucket_step` reads."""

    def __init__(self, n):
        self.token_ids, self.block_table = list(range(3, 3 + n)), list(range(8))


class _Entry:
    """The fields of a `ScheduledEntry` that `build_bucket_step` reads: n new tokens after `start`."""

    def __init__(self, n, start=0):
        self.seq, self.start, self.num_new_tokens, self.samples = _Seq(start + n), start, n, True


def _unpadded_logits(runner, entries) -> torch.Tensor:
    batch = runner.prepare(entries)
    with torch.inference_mode():
        return runner.model(batch.input_ids, batch.positions, runner.layer_caches, batch.meta, batch.logits_indices)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bucketed_step_gives_the_unpadded_logits_and_leaves_the_real_kv_alone(tiny_model_dirs, arch):
    llm = LLM(str(tiny_model_dirs[arch]), captured_shapes=True, shape_tokens="8,16,32", shape_batches="1,2,4,8")
    engine, runner = llm.engine, llm.engine.runner
    lengths = [5, 13, 7]  # bucket L = 16, B = 4: 64 tokens, 39 of them padding, one empty row
    for i, ids in enumerate(_prompts(1, lengths)):
        engine.add_stage(StageSpec(StageKey(f"r{i}"), tuple(ids), SamplingParams(max_tokens=2, temperature=0.0)))
    out = engine.scheduler.schedule()
    step = build_bucket_step(out.entries, runner.shapes, runner.block_size, runner.num_blocks, runner.max_blocks_per_seq)
    assert step is not None and step.key.tokens == 16 and step.key.batch == 4
    plain = _unpadded_logits(runner, out.entries)
    real_kv = runner.kv_cache[: runner.num_blocks].clone()
    scratch_before = runner.kv_cache[runner.num_blocks:].clone()
    with torch.inference_mode():
        bucketed = runner.buckets.run(step)[torch.tensor(step.sample_rows)]
    # Every real row as without padding, to float32 rounding, and the same tokens.
    assert torch.allclose(plain, bucketed, rtol=0.0, atol=1e-4)
    assert torch.equal(plain.argmax(-1), bucketed.argmax(-1))
    # The real KV is what the unpadded step wrote (same values, to rounding), and the pads
    # wrote only the scratch block.
    assert torch.allclose(runner.kv_cache[: runner.num_blocks], real_kv, rtol=0.0, atol=1e-5)
    pad_blocks = {int(b) for row in range(4) for b in step.slot_blocks[row * 16 + (lengths + [0])[row]:(row + 1) * 16]}
    assert pad_blocks == {runner.num_blocks}
    assert not torch.equal(runner.kv_cache[runner.num_blocks:], scratch_before)


def test_short_re_prefills_with_a_history_run_as_a_bucket_with_their_context(tiny_model_dirs):
    """A second round whose new tokens are few but whose history is long (LAPS' short
    re-prefill) reads its history's KV through the bucket's K blocks."""
    llm = LLM(str(tiny_model_dirs["llama"]), captured_shapes=True, shape_tokens="8,16", shape_batches="1,2,4",
              block_size=16)
    engine, runner = llm.engine, llm.engine.runner
    histories = _prompts(3, [48, 80])  # whole blocks: the prefix cache reuses whole blocks
    for i, ids in enumerate(histories):  # first rounds: long prompts, unpadded (longer than every bucket)
        engine.add_stage(StageSpec(StageKey(f"h{i}"), tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
    while engine.has_unfinished():
        engine.step()
    second = [h + extra for h, extra in zip(histories, _prompts(4, [6, 11]))]
    for i, ids in enumerate(second):  # the prefix cache holds the histories: only the new tokens run
        engine.add_stage(StageSpec(StageKey(f"s{i}"), tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
    out = engine.scheduler.schedule()
    assert sorted(e.num_new_tokens for e in out.entries) == [6, 11]  # the histories are reused
    step = build_bucket_step(out.entries, runner.shapes, runner.block_size, runner.num_blocks, runner.max_blocks_per_seq)
    assert step is not None and step.key.context_blocks == 8  # 91 tokens = 6 blocks -> the next power of two
    plain = _unpadded_logits(runner, out.entries)
    with torch.inference_mode():
        bucketed = runner.buckets.run(step)[torch.tensor(step.sample_rows)]
    assert torch.allclose(plain, bucketed, rtol=0.0, atol=1e-4)
    assert torch.equal(plain.argmax(-1), bucketed.argmax(-1))


def test_a_bucket_keeps_its_static_buffers_and_runs_new_contents_in_them(tiny_model_dirs):
    """What a CUDA graph replay relies on: one bucket, one set of input buffers at fixed
    addresses, each step's inputs copied in; a bucket past `max_buckets` is a miss."""
    llm = LLM(str(tiny_model_dirs["llama"]), captured_shapes=True, shape_tokens="8,16", shape_batches="2,4",
              max_num_seqs=2)
    engine, runner = llm.engine, llm.engine.runner
    runner.buckets.max_buckets = 1
    addresses = None
    for round_, lengths in enumerate(([5, 9], [12, 3], [10, 4])):  # all three: L = 16, B = 2, K = 1
        keys = []
        for i, ids in enumerate(_prompts(10 + round_, lengths)):
            key = StageKey(f"b{round_}-{i}")
            keys.append(key)
            engine.add_stage(StageSpec(key, tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
        out = engine.scheduler.schedule()
        step = build_bucket_step(out.entries, runner.shapes, runner.block_size, runner.num_blocks,
                                 runner.max_blocks_per_seq)
        plain = _unpadded_logits(runner, out.entries)
        with torch.inference_mode():
            bucketed = runner.buckets.run(step)[torch.tensor(step.sample_rows)]
        assert torch.allclose(plain, bucketed, rtol=0.0, atol=1e-4)
        bucket = runner.buckets.buckets[step.key]
        now = [t.data_ptr() for t in bucket.buffers()]
        assert addresses is None or now == addresses
        addresses = now
        other = build_bucket_step(out.entries, ShapeGrid((32,), (2,)), runner.block_size, runner.num_blocks,
                                  runner.max_blocks_per_seq)
        for key in keys:
            engine.abort(key)
        engine.step()
    assert (runner.buckets.hits, runner.buckets.misses) == (2, 0)
    assert other.key == BucketKey(32, 2, -(-32 // runner.block_size))
    assert runner.buckets.run(other) is None and runner.buckets.misses == 1  # past max_buckets: unpadded


def test_generation_with_captured_shapes_is_token_exact_and_runs_the_short_prefill_steps_as_buckets(tiny_model_dirs):
    prompts = _prompts(2, [3, 9, 17, 30, 6, 12, 70])  # 70 tokens fits no bucket: that step runs unpadded
    params = SamplingParams(max_tokens=12, temperature=0.0)
    plain = LLM(str(tiny_model_dirs["llama"])).generate(prompts, params)
    captured = LLM(str(tiny_model_dirs["llama"]), captured_shapes=True, max_num_seqs=4)
    bucketed = captured.generate(prompts, params)
    assert [o.token_ids for o in bucketed] == [o.token_ids for o in plain]
    assert captured.engine.runner.num_padded_steps >= 1


def test_only_prefill_steps_that_fit_a_bucket_are_laid_out_as_one():
    grid = ShapeGrid((8, 16), (1, 2, 4))
    build = lambda entries: build_bucket_step(entries, grid, 16, 99, 8)  # noqa: E731
    assert build([_Entry(3), _Entry(9)]).key == BucketKey(16, 2, 1)
    assert build([_Entry(3), _Entry(1)]) is None  # a decode in the step: no captured shape
    assert build([_Entry(17)]) is None  # longer than every length bucket
    assert build([_Entry(2)] * 5) is None  # more requests than the largest batch
    assert build([]) is None
    assert build([_Entry(4, start=100)]).key == BucketKey(8, 1, 8)  # 104 tokens: 7 blocks -> 8
    assert build([_Entry(4, start=200)]) is None  # past a sequence's most blocks


def test_the_context_bucket_is_the_next_power_of_two_within_a_sequence():
    assert context_blocks_bucket(1, 1, 64) == 1
    assert context_blocks_bucket(5, 1, 64) == 8
    assert context_blocks_bucket(3, 4, 64) == 4  # a row must hold its L tokens
    assert context_blocks_bucket(40, 1, 48) == 48  # capped at a sequence's blocks
    assert context_blocks_bucket(49, 1, 48) is None


def test_executor_choices_are_checked():
    forward = lambda *a: None  # noqa: E731
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        BucketRunner(forward, 16, torch.device("cpu"), "cuda_graph")
    with pytest.raises(ValueError, match="executor must be one of"):
        BucketRunner(forward, 16, torch.device("cpu"), "graphs")
    with pytest.raises(ValueError, match="max_captured_buckets"):
        BucketRunner(forward, 16, torch.device("cpu"), "eager", 0)


def test_a_bucket_that_ends_a_prefill_reports_every_layer_kv_after_the_step(tiny_model_dirs):
    """A PD prefill pushes KV layer by layer; a bucket (a graph on CUDA) cannot call back
    between layers, so it reports every layer, in order, once the step has run."""
    llm = LLM(str(tiny_model_dirs["llama"]), captured_shapes=True, shape_tokens="8,16", shape_batches="1,2")
    engine, runner = llm.engine, llm.engine.runner
    for i, ids in enumerate(_prompts(5, [6, 9])):
        engine.add_stage(StageSpec(StageKey(f"p{i}"), tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
    out = engine.scheduler.schedule()
    plain = _unpadded_logits(runner, out.entries).argmax(-1).tolist()
    layers: list[int] = []
    sampled = runner.execute(out, on_layer_kv=layers.append)
    assert runner.num_padded_steps == 1
    assert layers == list(range(runner.spec.num_layers))
    assert [sampled[e.seq.key] for e in out.entries] == plain


def test_a_step_of_decodes_only_takes_the_next_decode_batch_size():
    """Decode graphs (EngineConfig.decode_graphs): one token per row, the batch padded to
    the next captured decode size; a step mixing decodes and chunks has no bucket."""
    sizes = ShapeGrid((1,), (1, 2, 4, 8))
    build = lambda entries, grid=None: build_bucket_step(entries, grid, 16, 99, 8, sizes)  # noqa: E731
    step = build([_Entry(1, start=20), _Entry(1, start=40), _Entry(1, start=3)])
    assert step.key == BucketKey(1, 4, 4)  # 41 tokens: 3 blocks -> 4
    assert step.positions.tolist() == [20, 40, 3, 0]
    assert step.slot_blocks.tolist() == [1, 2, 0, 99] and step.slot_offsets.tolist() == [4, 8, 3, 0]
    assert step.context_lens.tolist() == [21, 41, 4, 1] and step.sample_rows == [0, 1, 2]
    assert build([_Entry(1, start=5)] * 9) is None  # more than the largest decode size
    assert build([_Entry(1, start=5), _Entry(4)], ShapeGrid((8,), (1, 2))) is None  # mixed: none
    assert build_bucket_step([_Entry(1, start=5)], None, 16, 99, 8) is None  # decode graphs off


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generation_with_decode_graphs_is_token_exact_and_runs_its_decode_steps_as_buckets(tiny_model_dirs, arch):
    prompts = _prompts(11, [5, 12, 9, 3, 20])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_model_dirs[arch]))
    assert plain.engine.runner.decode_batches == ()  # auto: off on the CPU (nothing to save)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    graphs = LLM(str(tiny_model_dirs[arch]), decode_graphs="on", decode_graph_batches="1,2,4,8")
    assert [o.token_ids for o in graphs.generate(prompts, params)] == expected
    runner = graphs.engine.runner
    assert runner.num_padded_steps >= 11  # the decode steps (each of 5 sequences' last 11 tokens)
    assert {key.tokens for key in runner.buckets.buckets} == {1}  # no prefill step was bucketed


def test_decode_graph_options_are_checked(tiny_model_dirs):
    with pytest.raises(ValueError, match="decode_graphs must be auto, on or off"):
        LLM(str(tiny_model_dirs["llama"]), decode_graphs="yes")
    with pytest.raises(ValueError, match="decode_graph_batches"):
        LLM(str(tiny_model_dirs["llama"]), decode_graphs="on", decode_graph_batches="1,x")
