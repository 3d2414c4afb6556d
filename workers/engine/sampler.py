"""Token sampling whose randomness depends only on (request seed, output index).

Each random row draws its noise from a generator seeded by a counter-based mix of the
request's seed and the output position, so a request produces the same tokens however
it is batched, chunked, preempted, split across workers or migrated (principle 3).
"""

from __future__ import annotations

import torch

from splitserve.core import SamplingParams
from splitserve.core.sampling import mix_seed

__all__ = ["mix_seed", "sample"]  # mix_seed: splitserve.core.sampling's, re-exported


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    output_indices: list[int],
) -> list[int]:
    """One token per row of `logits` [rows, vocab] (float32)."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    tokens = [0] * len(params)
    if greedy_rows:
        picked = logits[greedy_rows].argmax(dim=-1).tolist()
        for row, tok in zip(greedy_rows, picked):
            tokens[row] = tok
    for row, p in enumerate(params):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, mix_seed(seeds[row], output_indices[row]))
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, seed: int) -> int:
    scaled = logits / p.temperature
    if p.top_k and p.top_k < scaled.shape[-1]:
        keep = torch.zeros_like(scaled, dtype=torch.bool)
        keep[torch.topk(scaled, p.top_k).indices] = True  # exactly k, even with tied logits
        scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # The noise always comes from a CPU generator: CUDA generators produce other streams,
    # and a request must sample the same tokens on whichever worker runs it.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Exponential race (argmax p_i / E_i, E_i ~ Exp(1)) samples from p exactly.
    noise = torch.empty(probs.shape, dtype=probs.dtype).exponential_(generator=gen).to(probs.device)
    return int((probs / noise).argmax())
