"""A diffusion model that predicts its own mask token (issue 37): the engine must do what
LLaDA's reference does and never emit the mask.

LLaDA's `generate` (github.com/ML-GSAI/LLaDA, generate.py) writes `x0` (the argmax) at the
positions it transfers, so a transferred position whose argmax is the mask stays masked and is
a candidate again at every later step — in later blocks too, since only the positions *past*
the current block are excluded (`x0_p[:, prompt_len + (num_block + 1) * block_length:] =
-np.inf`). Positions still masked after the last step are in its returned `x`, and its
`tokenizer.batch_decode(..., skip_special_tokens=True)` shows nothing for them: the output
holds no mask. Fast-dLLM's dual cache (github.com/NVlabs/Fast-dLLM, llada/generate.py
`generate_with_dual_cache`) does the same at a block's first (Refresh) step, and only the
block's own positions at its Reuse steps.

The checkpoint: a random tiny LLaDA whose lm_head row for the mask id is made a close rival
of a token the model favours, so the mask wins the argmax at some positions and not others.
The loops below are straightforward transcriptions of those two references (batch of one,
greedy), compared token for token with the engine."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from splitserve.core.diffusion import DiffusionParams
from splitserve.cli.demo_model import MASK_ID, DemoModelSpec, build_demo_model
from workers.diffusion.reference import generate, generate_dual_cache
from workers.engine import LLM, SamplingParams
from workers.engine.models.llada import load_llada

TINY = dict(arch="llada", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
            vocab_size=300, max_position_embeddings=96, seed=3, initializer_range=0.2)
RIVAL = 13  # the token the unbiased model predicts most (its argmax at most masked positions)
LM_HEAD = "model.transformer.ff_out.weight"


@pytest.fixture(scope="module")
def mask_predicting_dir(tmp_path_factory):
    """The tiny LLaDA with the mask's lm_head row close to the rival's (scaled down, plus a random
    direction): the mask wins the argmax where the hidden state leans that way."""
    directory = build_demo_model(DemoModelSpec(**TINY), tmp_path_factory.mktemp("llada-predicts-mask"))
    weights = load_file(str(directory / "model.safetensors"))
    head = weights[LM_HEAD]
    generator = torch.Generator().manual_seed(1)
    head[MASK_ID] = 0.8 * head[RIVAL] + 0.15 * torch.randn(head.shape[1], generator=generator)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def model(mask_predicting_dir):
    return load_llada(mask_predicting_dir)


@dataclass
class Trace:
    """What the reference loop saw: the raw sequence and how the mask showed up in it."""

    x: list[int]
    mask_transfers: int = 0  # transferred positions whose argmax was the mask (kept masked)
    left_over_at_block_end: int = 0  # masked positions carried into a later block
    filled_from_an_earlier_block: int = 0  # positions unmasked during a later block's steps
    carried: set[int] = field(default_factory=set)  # output positions masked at the end of a block not the last
    remaining: list[int] = field(default_factory=list)  # still masked after the last step


def llada_generate(model, prompt: list[int], gen_length: int, block_length: int, steps: int,
                   mask_id: int, dual_cache: bool = False) -> Trace:
    """LLaDA's `generate` (temperature 0, low_confidence, no guidance) for one prompt; with
    `dual_cache`, Fast-dLLM's `generate_with_dual_cache` with LLaDA's fixed steps per block."""
    x = torch.full((1, len(prompt) + gen_length), mask_id, dtype=torch.long)
    x[:, :len(prompt)] = torch.tensor(prompt)
    num_blocks = gen_length // block_length
    steps = steps // num_blocks
    trace = Trace([])
    with torch.no_grad():
        for num_block in range(num_blocks):
            start, end = len(prompt) + num_block * block_length, len(prompt) + (num_block + 1) * block_length
            mask_num = int((x[:, start:end] == mask_id).sum())
            base, remainder = divmod(mask_num, steps)
            num_transfer_tokens = [base + 1 if i < remainder else base for i in range(steps)]
            cache = None
            for i in range(steps):
                mask_index = x == mask_id
                if dual_cache and i > 0:  # Reuse: the block's queries against the cached keys/values
                    logits = torch.full((1, x.shape[1], model.config.vocab_size), 0.0)
                    logits[:, start:end] = model.forward_queries(x[:, start:end], torch.arange(start, end)[None],
                                                                 cache).logits
                    mask_index[:, :start] = False
                else:
                    output = model.forward_with_kv(x)
                    cache, logits = output.kv, output.logits
                x0 = torch.argmax(logits, dim=-1)
                p = F.softmax(logits.to(torch.float64), dim=-1)
                x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
                x0_p[:, end:] = -torch.inf
                x0 = torch.where(mask_index, x0, x)
                confidence = torch.where(mask_index, x0_p, -torch.inf)
                _, select_index = torch.topk(confidence[0], k=num_transfer_tokens[i])
                trace.mask_transfers += int((x0[0, select_index] == mask_id).sum())
                filled = (select_index < start) & (x0[0, select_index] != mask_id)
                trace.filled_from_an_earlier_block += int(filled.sum())
                x[0, select_index] = x0[0, select_index]
            if num_block < num_blocks - 1:
                carried = (x[0, len(prompt):end] == mask_id).nonzero().flatten().tolist()
                trace.left_over_at_block_end += len(carried)
                trace.carried.update(carried)
    trace.x = x[0, len(prompt):].tolist()
    trace.remaining = [i for i, t in enumerate(trace.x) if t == mask_id]
    return trace


def _prompts(lengths) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _without_mask(tokens) -> list[int]:
    """LLaDA's output as its decode shows it (skip_special_tokens): the positions left masked dropped."""
    return [t for t in tokens if t != MASK_ID]


PROMPTS = _prompts([5, 13, 9, 31])
CASES = [  # gen_length, block_length, steps
    (16, 4, 8),
    (16, 8, 16),
    (24, 8, 6),
]


SEEDS = (11, 12, 13, 14)


def test_the_checkpoint_predicts_the_mask_at_some_positions_and_not_others(model):
    """The case the engine must handle does occur: transfers whose argmax is the mask, masked
    positions carried into a later block and filled there, some never filled, and output left."""
    traces = [llada_generate(model, prompt, *case, MASK_ID, dual_cache=dual)
              for case in CASES for prompt in PROMPTS for dual in (False, True)]
    assert sum(t.mask_transfers for t in traces) > 0
    assert sum(t.left_over_at_block_end for t in traces) > 0
    assert sum(t.filled_from_an_earlier_block for t in traces) > 0
    assert any(t.remaining for t in traces)
    assert any(_without_mask(t.x) for t in traces)
    assert any(t.filled_from_an_earlier_block for t in traces[1::2])  # with the dual cache too


def _engine_outputs(directory, knobs: DiffusionParams, cache: str, **fields):
    llm = LLM(str(directory), dllm_cache=cache, max_num_logits=5, max_num_batched_tokens=2 * (31 + knobs.gen_length))
    params = [SamplingParams(max_tokens=knobs.gen_length, block_length=knobs.block_length, steps=knobs.steps,
                             temperature=knobs.temperature, remasking=knobs.remasking, seed=seed, **fields)
              for seed in SEEDS[: len(PROMPTS)]]
    return llm, llm.generate(PROMPTS, params)


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_engine_never_emits_the_mask_and_equals_llada_token_for_token(mask_predicting_dir, model, cache, case):
    gen, block, steps = case
    expected = [_without_mask(llada_generate(model, prompt, gen, block, steps, MASK_ID, dual_cache=cache == "dual").x)
                for prompt in PROMPTS]
    knobs = DiffusionParams(gen_length=gen, block_length=block, steps=steps)
    reference = generate if cache == "none" else generate_dual_cache
    assert [list(o.output_tokens) for o in reference(model, PROMPTS, knobs, mask_token_id=MASK_ID)] == expected
    llm, outs = _engine_outputs(mask_predicting_dir, knobs, cache, ignore_eos=True)
    assert [list(o.token_ids) for o in outs] == expected
    assert all(MASK_ID not in o.token_ids and o.finish_reason == "length" for o in outs)
    assert llm.engine.runner.peak_logit_rows <= 5
    assert not llm.engine.scheduler.has_unfinished() and not llm.engine.runner.states


SAMPLED = [  # gen_length, block_length, steps, remasking, temperature
    (16, 4, 8, "random", 0.0),
    (16, 4, 8, "low_confidence", 0.7),
    (24, 8, 6, "random", 1.0),
]


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("case", SAMPLED, ids=lambda c: "-".join(map(str, c)))
def test_sampled_runs_draw_the_references_randomness_over_the_masked_rows(mask_predicting_dir, model, cache, case):
    """With a generator the step's rows (the earlier blocks' masked positions, then the block)
    draw their noise in the reference's order, in logit chunks smaller than a block."""
    gen, block, steps, remasking, temperature = case
    knobs = DiffusionParams(gen_length=gen, block_length=block, steps=steps, remasking=remasking,
                            temperature=temperature)
    reference = generate if cache == "none" else generate_dual_cache
    expected = reference(model, PROMPTS, knobs, mask_token_id=MASK_ID,
                         generators=[torch.Generator().manual_seed(s) for s in SEEDS])
    assert any(MASK_ID in e.tokens for e in expected)  # the mask was predicted and left
    _, outs = _engine_outputs(mask_predicting_dir, knobs, cache, ignore_eos=True)
    assert [list(o.token_ids) for o in outs] == [list(e.output_tokens) for e in expected]
    assert all(MASK_ID not in o.token_ids for o in outs)


def test_streamed_blocks_hold_no_mask_and_a_stop_token_after_a_masked_position_waits_for_it(mask_predicting_dir,
                                                                                             model):
    """Each block event streams up to the first position still masked. The stop token: what a
    position masked at its block's end is filled with later, and which its block also holds
    further on — the output must end at the filled position, not at the later one."""
    from splitserve.core import StageKey
    from workers.diffusion.engine import DiffusionEngine
    from workers.engine.config import EngineConfig

    gen, block, steps = 24, 8, 6
    traces = [llada_generate(model, prompt, gen, block, steps, MASK_ID) for prompt in PROMPTS]
    index, held, stop = next((i, c, t.x[c]) for i, t in enumerate(traces) if t.carried for c in [min(t.carried)]
                             if t.x[c] != MASK_ID and t.x[c] in t.x[c + 1:(c // block + 1) * block])
    engine = DiffusionEngine(EngineConfig(model=str(mask_predicting_dir), kv_cache_memory_bytes=1 << 20,
                                          dllm_cache="none"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(StageKey(f"r{i}", 0), prompt, SamplingParams(
            max_tokens=gen, block_length=block, steps=steps, temperature=0.0,
            **({"stop_token_ids": [stop]} if i == index else {"ignore_eos": True})))
    streamed: dict[str, list[list[int]]] = {}
    finals = {}
    while engine.has_unfinished():
        for event in engine.step():
            assert MASK_ID not in event.token_ids and "<|mdm_mask|>" not in event.text
            assert event.token_ids or event.finish_reason  # no empty in-between events
            streamed.setdefault(event.key.request_id, []).append(list(event.token_ids))
            if event.finish_reason:
                finals[event.key.request_id] = event
    for i, t in enumerate(traces):
        want = _without_mask(t.x)
        reason = "length"
        if i == index:
            want, reason = want[: want.index(stop) + 1], "stop"
        got = [tok for chunk in streamed.get(f"r{i}", []) for tok in chunk]
        assert got == want
        assert (finals[f"r{i}"].finish_reason, finals[f"r{i}"].num_output_tokens) == (reason, len(want))
    # The stream paused at the masked position: its block's event ended just before it.
    assert held % block and held in itertools.accumulate(len(chunk) for chunk in streamed[f"r{index}"])
    assert not engine.runner.states
