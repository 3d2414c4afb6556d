"""Reference masked-diffusion generation with the semantics of LLaDA's public `generate`.

Plain PyTorch, the whole sequence recomputed at every step, no cache: this is the definition a
Refresh/Reuse engine (dLLM-Serve §2.3) is checked against. Per prompt:

* the sequence is the prompt followed by `gen_length` mask tokens;
* the generated region is decoded in `gen_length / block_length` blocks, left to right
  (semi-autoregressive), with `steps / num_blocks` denoising steps each;
* a block's step `i` unmasks `transfer_token_schedule(block_length, steps_per_block)[i]`
  tokens (LLaDA's `get_num_transfer_tokens`: LLaDA's noise schedule is linear, so every step
  of a block unmasks the same number of tokens, the remainder going to the first steps);
* the candidate at each position is the argmax of the logits, after Gumbel noise (float64,
  LLaDA's `add_gumbel_noise`) when `temperature > 0`;
* of the still-masked positions up to the end of the current block, the step's
  `num_transfer` with the highest confidence are transferred: the softmax probability of
  the candidate (`low_confidence`, computed from the logits without the noise) or a uniform
  draw (`random`); positions past the current block are never unmasked, and unmasked tokens
  never change again;
* **a candidate may be the mask token itself** (a mask predictor can predict its mask). LLaDA
  writes the candidate at the transferred positions all the same (`x[transfer_index] =
  x0[transfer_index]`), so such a position stays masked — its transfer is spent — and is a
  candidate again at every later step, in later blocks too: LLaDA excludes only the positions
  *past* the current block (`x0_p[:, prompt_len + (num_block + 1) * block_length:] = -inf`),
  not the earlier blocks' positions still masked. Positions still masked after the last step
  are in LLaDA's returned sequence, and its `batch_decode(..., skip_special_tokens=True)`
  shows nothing for them: `DiffusionOutput.output_tokens` drops them, and no engine may emit
  the mask token;
* with `cfg_scale > 0` (classifier-free guidance) the logits are
  `uncond + (cfg_scale + 1) * (cond - uncond)`, `uncond` from the same sequence with the
  prompt masked.

Where this definition is more precise than LLaDA's code:

* **Prompts of different lengths**: each prompt's output is, by definition, what it gives
  run alone — prompts are generated independently, one sequence at a time, so no padding,
  attention mask or position shift enters the definition (LLaDA left-pads a batch; with its
  RoPE positions counted from the padding, a padded prompt's output differs from the
  prompt's own). A batched engine must reproduce each prompt's solo output.
* **Randomness** comes only from an explicit `torch.Generator` per prompt (so a prompt's
  draws do not depend on the others in the batch), consumed in a fixed order: at each step,
  first the Gumbel noise for the step's rows, `[rows, vocab]` float64 uniforms (when
  `temperature > 0`), then `[rows]` float32 uniforms for `random` remasking. The step's rows
  are the earlier blocks' positions still masked (ascending; none unless the model predicted
  the mask) followed by the current block's `block_length` positions. LLaDA draws the same
  distributions from the global RNG over the whole sequence; only those rows' draws can
  matter, so only they are drawn.
* **Ties**: the candidate is the first maximal vocabulary id (torch.argmax); among equal
  confidences the lower position is unmasked first (LLaDA's topk leaves ties unspecified).
* The dual cache (`generate_dual_cache`) follows Fast-dLLM's `generate_with_dual_cache`: a
  block's first step (the Refresh, which computes every position) considers the earlier
  blocks' positions still masked as LLaDA does; its Reuse steps compute the block alone and
  consider only the block's positions. The block has LLaDA's fixed `steps_per_block` steps
  (Fast-dLLM loops until the block holds no mask).
* A prompt may not contain the mask token (LLaDA would count it as a position to fill and
  give it one of the current block's transfer slots).
* LLaDA's `logits_eos_inf` / `confidence_eos_eot_inf` (EOS suppression options, off by
  default) are not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from splitserve.core.diffusion import REMASKING_STRATEGIES, DiffusionParams, transfer_token_schedule

__all__ = ["REMASKING_STRATEGIES", "DiffusionOutput", "DiffusionParams", "add_gumbel_noise", "denoise_block_step",
           "generate", "generate_dual_cache", "step_positions", "transfer_token_schedule"]

# input_ids [B, T] -> logits [B, T, vocab] (LladaModel.__call__ is one).
MaskPredictor = Callable[[torch.Tensor], torch.Tensor]

@dataclass(frozen=True)
class DiffusionOutput:
    """One prompt's generation: `gen_length` positions (the mask token where a position was
    still masked after the last step), and for each the step that unmasked it (-1: none)."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    commit_step: tuple[int, ...]  # 0-based global step (block * steps_per_block + step in block)
    mask_token_id: int | None = None

    @property
    def sequence(self) -> tuple[int, ...]:
        return self.prompt + self.tokens

    @property
    def output_tokens(self) -> tuple[int, ...]:
        """The output as LLaDA's decode shows it (`skip_special_tokens=True`): `tokens` without
        the positions left masked. What an engine emits (before any stop token cuts it)."""
        return tuple(t for t in self.tokens if t != self.mask_token_id)


def add_gumbel_noise(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """Logits whose argmax is a sample at `temperature` (Gumbel-max, as LLaDA's
    `add_gumbel_noise`: `exp(logits) / (-log u) ** temperature`, in float64 because low-precision
    Gumbel noise degrades generation quality, arXiv:2409.02908). Unchanged at temperature 0."""
    if temperature == 0:
        return logits
    uniform = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=generator.device)
    gumbel = (-torch.log(uniform.to(logits.device))) ** temperature
    return logits.to(torch.float64).exp() / gumbel


def denoise_block_step(
    block_logits: torch.Tensor,
    block_ids: torch.Tensor,
    mask_token_id: int,
    num_transfer: int,
    params: DiffusionParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One denoising step over the step's rows (`step_positions`: the earlier blocks' positions
    still masked, then the current block): `block_logits` [R, vocab] (guidance applied),
    `block_ids` [R]. Of the masked rows, the `num_transfer` most confident get their candidate —
    which stays the mask where the model predicted the mask (LLaDA: `x[transfer_index] =
    x0[transfer_index]`, the mask a candidate like any token). Returns the new ids and the rows
    unmasked (ascending; a transfer to the mask unmasks nothing)."""
    masked = block_ids == mask_token_id
    if num_transfer > int(masked.sum()):
        raise ValueError(f"num_transfer ({num_transfer}) exceeds the step's masked positions ({int(masked.sum())})")
    if params.uses_randomness and generator is None:
        raise ValueError(f"a generator is required with temperature={params.temperature}, "
                         f"remasking={params.remasking!r}")
    noisy = add_gumbel_noise(block_logits, params.temperature, generator) if params.temperature > 0 else block_logits
    candidates = noisy.argmax(dim=-1)
    if params.remasking == "low_confidence":
        probs = F.softmax(block_logits, dim=-1)
        confidence = probs.gather(-1, candidates[:, None]).squeeze(-1)
    else:
        confidence = torch.rand(block_ids.shape, generator=generator, device=generator.device).to(block_ids.device)
    confidence = torch.where(masked, confidence, torch.full_like(confidence, -torch.inf))
    # Stable: among equal confidences the lower position goes first.
    order = torch.sort(confidence, descending=True, stable=True).indices
    chosen = order[:num_transfer].sort().values
    new_ids = block_ids.clone()
    new_ids[chosen] = candidates[chosen]
    return new_ids, chosen[new_ids[chosen] != mask_token_id]


def step_positions(ids: torch.Tensor, prompt_len: int, block_start: int, block_end: int,
                   mask_token_id: int, *, earlier: bool = True) -> torch.Tensor:
    """The positions a step decides over, ascending: with `earlier` (a step that computes the
    whole sequence), the positions of the earlier blocks still masked — LLaDA's
    `mask_index = (x == mask_id)` with only the positions past the block excluded — then the
    current block's positions."""
    block = torch.arange(block_start, block_end, device=ids.device)
    if not earlier:
        return block
    left_masked = (ids[prompt_len:block_start] == mask_token_id).nonzero().flatten() + prompt_len
    return torch.cat((left_masked, block))


def generate(
    model: MaskPredictor,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    params: DiffusionParams,
    *,
    mask_token_id: int,
    generators: Sequence[torch.Generator] | None = None,
    device: torch.device | str = "cpu",
) -> list[DiffusionOutput]:
    """Generate for each prompt independently (see the module doc); `generators[i]` is prompt
    i's randomness, required when `params.uses_randomness`."""
    if not isinstance(mask_token_id, int) or mask_token_id < 0:
        raise ValueError(f"mask_token_id must be an int >= 0, got {mask_token_id!r}")
    prompt_ids = [_prompt_ids(p, i, mask_token_id) for i, p in enumerate(prompts)]
    if generators is not None:
        if len(generators) != len(prompt_ids):
            raise ValueError(f"generators has {len(generators)} entries, one per prompt needs {len(prompt_ids)}")
        if not all(isinstance(g, torch.Generator) for g in generators):
            raise ValueError("generators must hold torch.Generator objects")
    elif params.uses_randomness:
        raise ValueError(f"generators (one torch.Generator per prompt) are required with "
                         f"temperature={params.temperature}, remasking={params.remasking!r}")
    outputs = []
    with torch.inference_mode():
        for index, prompt in enumerate(prompt_ids):
            generator = None if generators is None else generators[index]
            outputs.append(_generate_one(model, prompt, params, mask_token_id, generator, torch.device(device)))
    return outputs


def _prompt_ids(prompt, index: int, mask_token_id: int) -> list[int]:
    ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"prompts[{index}] must hold token ids (ints >= 0)")
    if mask_token_id in ids:
        raise ValueError(f"prompts[{index}] contains the mask token (mask_token_id={mask_token_id})")
    return ids


def _generate_one(
    model: MaskPredictor,
    prompt: list[int],
    params: DiffusionParams,
    mask_token_id: int,
    generator: torch.Generator | None,
    device: torch.device,
) -> DiffusionOutput:
    prompt_len = len(prompt)
    x = torch.full((prompt_len + params.gen_length,), mask_token_id, dtype=torch.long, device=device)
    x[:prompt_len] = torch.tensor(prompt, dtype=torch.long, device=device)
    commit_step = torch.full((params.gen_length,), -1, dtype=torch.long)
    for block in range(params.num_blocks):
        start = prompt_len + block * params.block_length
        end = start + params.block_length
        schedule = transfer_token_schedule(int((x[start:end] == mask_token_id).sum()), params.steps_per_block)
        for step, num_transfer in enumerate(schedule):
            logits = _guided_logits(model, x, prompt_len, params.cfg_scale, mask_token_id)
            if mask_token_id >= logits.shape[-1]:
                raise ValueError(f"mask_token_id ({mask_token_id}) is outside the model's vocabulary "
                                 f"({logits.shape[-1]})")
            rows = step_positions(x, prompt_len, start, end, mask_token_id)
            new_ids, unmasked = denoise_block_step(logits[rows], x[rows], mask_token_id, num_transfer, params,
                                                   generator)
            x[rows] = new_ids
            commit_step[rows[unmasked].cpu() - prompt_len] = block * params.steps_per_block + step
    return DiffusionOutput(tuple(prompt), tuple(x[prompt_len:].tolist()), tuple(commit_step.tolist()), mask_token_id)


def _guided_logits(
    model: MaskPredictor, x: torch.Tensor, prompt_len: int, cfg_scale: float, mask_token_id: int
) -> torch.Tensor:
    """Logits [T, vocab] for sequence `x` [T]; with classifier-free guidance, LLaDA's
    `uncond + (cfg_scale + 1) * (cond - uncond)`, the unconditional pass seeing the prompt masked."""
    if cfg_scale == 0:
        return _predict(model, x[None])[0]
    unconditional = x.clone()
    unconditional[:prompt_len] = mask_token_id
    cond, uncond = _predict(model, torch.stack([x, unconditional]))
    return uncond + (cfg_scale + 1) * (cond - uncond)


def _predict(model: MaskPredictor, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids)
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"the model must return logits [batch, positions, vocab] for input "
                         f"{tuple(input_ids.shape)}, got {tuple(logits.shape)}")
    return logits


def generate_dual_cache(
    model,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    params: DiffusionParams,
    *,
    mask_token_id: int,
    generators: Sequence[torch.Generator] | None = None,
) -> list[DiffusionOutput]:
    """The dual-cache definition (Fast-dLLM; dLLM-Serve §2.3), one prompt at a time: a block's
    first step is a Refresh (`model.forward_with_kv` over the whole sequence, its keys/values
    kept), its other steps Reuse them (`model.forward_queries` over the block alone, the
    block's fresh keys/values in place of the cached ones). No guidance (`cfg_scale` 0)."""
    if params.cfg_scale:
        raise ValueError("cfg_scale is not supported with the dual cache")
    prompt_ids = [_prompt_ids(p, i, mask_token_id) for i, p in enumerate(prompts)]
    outputs = []
    with torch.inference_mode():
        for index, prompt in enumerate(prompt_ids):
            generator = None if generators is None else generators[index]
            prompt_len = len(prompt)
            x = torch.full((prompt_len + params.gen_length,), mask_token_id, dtype=torch.long)
            x[:prompt_len] = torch.tensor(prompt, dtype=torch.long)
            commit_step = torch.full((params.gen_length,), -1, dtype=torch.long)
            for block in range(params.num_blocks):
                start = prompt_len + block * params.block_length
                end = start + params.block_length
                schedule = transfer_token_schedule(params.block_length, params.steps_per_block)
                cached = None
                for step, num_transfer in enumerate(schedule):
                    # Fast-dLLM: the Refresh decides over the earlier blocks' masked positions too
                    # (`mask_index = (x == mask_id); mask_index[:, end:] = 0`), a Reuse over the block.
                    rows = step_positions(x, prompt_len, start, end, mask_token_id, earlier=step == 0)
                    if step == 0:
                        refreshed = model.forward_with_kv(x[None])
                        cached, row_logits = refreshed.kv, refreshed.logits[0, rows]
                    else:
                        query_index = torch.arange(start, end)[None]
                        row_logits = model.forward_queries(x[None, start:end], query_index, cached).logits[0]
                    new_ids, unmasked = denoise_block_step(row_logits, x[rows], mask_token_id, num_transfer,
                                                           params, generator)
                    x[rows] = new_ids
                    commit_step[rows[unmasked] - prompt_len] = block * params.steps_per_block + step
            outputs.append(DiffusionOutput(tuple(prompt), tuple(x[prompt_len:].tolist()), tuple(commit_step.tolist()),
                                           mask_token_id))
    return outputs
