"""Token sampling whose randomness depends only on (request seed, output index).

Every random row's noise is a pure function of (mix_seed(seed, output index), token id),
computed by integer tensor ops on the device holding the logits: a counter-based generator,
so a request produces the same tokens however it is batched, chunked, preempted, split
across workers or migrated (principle 3), with no generator object, no host round trip per
row and one device-to-host copy per step (the sampled ids). All random rows are sampled in
one vectorised pass (temperature, top-k, top-p per row); greedy rows take the argmax and
draw no noise.

vLLM's logit processing comes first, in the order of vLLM's v1 sampler
(vllm/v1/sample/sampler.py, `Sampler.forward` and `Sampler.sample`): min_tokens (EOS and
stop_token_ids masked while the output is shorter), then the penalties
(vllm/v1/sample/ops/penalties.py -> vllm/model_executor/layers/utils.py `apply_penalties`:
repetition over prompt and output, then frequency and presence over the output), then the
greedy argmax; random rows then take temperature, min_p (over the tempered softmax), top-k
and top-p. Each is elementwise or a reduction within a row, and reads only the row's own
request history (prompt and output ids, which every stage of a split request is given), so a
row's token does not depend on its batch nor on the worker the stage runs on.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

from splitserve.core import SamplingParams
from splitserve.core.sampling import TokenLogprobs, mix_seed
from workers.tensor_hash import M32, hash32

__all__ = ["apply_penalties", "argmax_rows", "counter_uniform", "mask_disallowed", "min_p_mask", "mix_seed", "sample",
           "token_logprobs"]  # mix_seed: splitserve.core.sampling's, re-exported

# Rows whose noise is made at once: bounds its temporaries (~5 int64 tables of NOISE_ROWS x
# vocab: 48 MiB at a 152k vocabulary) whatever the batch, on the CPU and in GPU memory alike.
NOISE_ROWS = 8


def counter_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise in (0, 1), float32 [rows, vocab]: entry (r, j) depends only on keys[r]
    (a 63-bit int64, `mix_seed(seed, output index)`) and the token id j, computed on keys'
    device by exact integer ops (the same numbers on every device)."""
    token = torch.arange(vocab, dtype=torch.int64, device=keys.device).unsqueeze(0)
    key_low = (keys & M32).unsqueeze(1)
    key_high = (keys >> 32).unsqueeze(1)
    h = hash32(token ^ key_low)
    h = hash32(h ^ key_high)
    h = hash32((h + key_low) & M32)
    # 23 random bits and a half: 24 significant bits, exact in float32, never 0 or 1.
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    output_indices: list[int],
    token_ids: Sequence[Sequence[int]] | None = None,
    prompt_lens: Sequence[int] | None = None,
    eos_token_ids: Collection[int] = (),
    grammar_rows: Collection[int] = (),
) -> list[int]:
    """One token per row of `logits` [rows, vocab] (float32).

    `token_ids[i]` (prompt then output) and `prompt_lens[i]` are row i's request history, read
    only by rows with penalties; `eos_token_ids` are masked with stop_token_ids under min_tokens
    (`output_indices[i]` is the output's length so far). `grammar_rows`: the rows whose logits
    a structured output's grammar masked (`mask_disallowed`), where min_tokens yields to it."""
    rows = len(params)
    vocab = logits.shape[-1]
    logits = _processed(logits, params, output_indices, token_ids, prompt_lens, eos_token_ids, grammar_rows)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        index = _index(greedy, rows, logits.device)
        tokens[index] = argmax_rows(logits[index])
    # Rows that filter (top-k, top-p) and rows that do not are sampled apart: a row's numbers
    # must not depend on which other rows share its step (a sorted softmax sums in another order).
    filtered = [i for i, p in enumerate(params) if not p.greedy and _filters(p, vocab)]
    plain = [i for i, p in enumerate(params) if not p.greedy and not _filters(p, vocab)]
    for drawn, filtering in ((plain, False), (filtered, True)):
        if drawn:
            index = _index(drawn, rows, logits.device)
            keys = torch.tensor([mix_seed(seeds[i], output_indices[i]) for i in drawn], dtype=torch.int64)
            tokens[index] = _sample_rows(logits[index], [params[i] for i in drawn], keys.to(logits.device),
                                         filtering)
    return tokens.tolist()


def token_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                   tokens: Sequence[int]) -> dict[int, TokenLogprobs]:
    """The logprobs of the rows whose request asked for them (`params[i].logprobs` not None),
    by row: the sampled `tokens[i]`'s and the `params[i].logprobs` most likely tokens', under the
    model's raw distribution: log_softmax of `logits` [rows, vocab] as the model gave them, before
    min_tokens, penalties, temperature, min_p, top-k and top-p (which `sample` applies to a copy);
    a structured-output row's logits come already masked by its grammar (`mask_disallowed`), as
    vLLM's bitmask is applied before its sampler.

    vLLM v1's default `logprobs_mode="raw_logprobs"` does the same: `Sampler.forward`
    (vllm/v1/sample/sampler.py) takes `compute_logprobs(logits)` (log_softmax in float32) before
    any processing, and `gather_logprobs` gathers the top `max_num_logprobs` (torch.topk) and the
    sampled token from it. One log_softmax and one topk over the rows that asked, vectorised; a
    step where none asked computes nothing."""
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not asked:
        return {}
    logprobs = torch.log_softmax(logits[_index(asked, logits.shape[0], logits.device)].to(torch.float32), dim=-1)
    # A token a structured output's grammar refused (its logit -inf): vLLM's API shows -9999.0,
    # and JSON has no -inf.
    logprobs = logprobs.clamp(min=LOGPROB_FLOOR)
    ids = torch.tensor([tokens[i] for i in asked], dtype=torch.int64, device=logits.device).unsqueeze(1)
    sampled = logprobs.gather(1, ids).squeeze(1).tolist()
    wanted = [params[i].logprobs for i in asked]
    k = min(max(wanted), logprobs.shape[-1])
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)  # largest first
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    else:
        top_values = top_ids = [[] for _ in asked]
    return {i: TokenLogprobs(sampled[r], tuple(zip(top_ids[r][:n], top_values[r][:n])))
            for r, (i, n) in enumerate(zip(asked, wanted))}


def mask_disallowed(logits: torch.Tensor, rows: Sequence[int], allowed: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` whose rows `rows` keep only the tokens `allowed` [len(rows), vocab]
    (bool) marks; the others are -inf. Structured output's grammar masks, applied as vLLM's model
    runner applies its bitmask: to the logits before the sampler, so that the logprobs, which
    are computed from them, are those of the tokens the grammar allows (a refused token: -inf)."""
    masked = logits.clone()
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    masked[index] = masked[index].masked_fill(~allowed, float("-inf"))
    return masked


LOGPROB_FLOOR = -9999.0


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first on ties), int64.

    On the CPU numpy's vectorised argmax: torch's CPU argmax took 1.2 ms for 32 rows of a
    32,000-token vocabulary on this project's 2-core VM against numpy's 0.19 ms — 3% of a
    small model's decode step. Both return the first maximum, and NaN counts as the largest
    in both, so the tokens are the same."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(scores.detach().numpy().argmax(axis=-1))
    return scores.argmax(dim=-1)


def _filters(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


# Rows whose penalties are computed at once: bounds the [rows, vocab] count tables.
PENALTY_ROWS = 8


def _processed(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
               token_ids: Sequence[Sequence[int]] | None, prompt_lens: Sequence[int] | None,
               eos_token_ids: Collection[int],
               grammar_rows: Collection[int] = ()) -> torch.Tensor:
    """The logits after min_tokens and the penalties (vLLM's order); `logits` itself when no
    row asks for either, else a copy (the caller's tensor is left as it was)."""
    stopping = [i for i, p in enumerate(params) if output_indices[i] < p.min_tokens]
    penalised = [i for i, p in enumerate(params) if p.penalised]
    if not stopping and not penalised:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    masked = set(grammar_rows)
    for i in stopping:  # few rows, few ids each: masked in place
        stop = sorted({t for t in (*params[i].stop_token_ids, *eos_token_ids) if 0 <= t < vocab})
        if stop:
            kept = logits[i, stop].clone() if i in masked else None
            logits[i, stop] = float("-inf")
            if kept is not None and not bool(torch.isfinite(logits[i]).any()):
                # The grammar allows only an end here: it wins over min_tokens (vLLM would be
                # left with no token at all), so the output stays what the grammar accepts.
                logits[i, stop] = kept
    if penalised:
        if token_ids is None or prompt_lens is None:
            raise ValueError("penalties need each row's token_ids and prompt_lens")
        for start in range(0, len(penalised), PENALTY_ROWS):
            chunk = penalised[start:start + PENALTY_ROWS]
            index = torch.tensor(chunk, dtype=torch.long, device=logits.device)
            ps = [params[i] for i in chunk]
            logits[index] = apply_penalties(
                logits[index], [token_ids[i][:prompt_lens[i]] for i in chunk],
                [token_ids[i][prompt_lens[i]:] for i in chunk], [p.presence_penalty for p in ps],
                [p.frequency_penalty for p in ps], [p.repetition_penalty for p in ps])
    return logits


def apply_penalties(logits: torch.Tensor, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                    presence: Sequence[float], frequency: Sequence[float],
                    repetition: Sequence[float]) -> torch.Tensor:
    """vLLM's penalties (vllm/model_executor/layers/utils.py `apply_penalties`) on `logits`
    [rows, vocab] in place, returned: a token of the prompt or the output has its logit divided
    by the repetition penalty when positive, multiplied when not; then the output's count of it
    times the frequency penalty and, once, the presence penalty are subtracted.

    vLLM multiplies by 1 / penalty where this divides: a correctly rounded division gives the
    same float on every device, so the tokens do not depend on where the row is sampled."""
    rows, vocab = logits.shape
    device = logits.device
    prompt_seen = _token_counts(prompts, vocab, device) > 0
    output_counts = _token_counts(outputs, vocab, device)
    output_seen = output_counts > 0
    column = dict(dtype=logits.dtype, device=device)
    rep = torch.tensor(repetition, **column).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(prompt_seen | output_seen, penalised, logits))
    logits -= torch.tensor(frequency, **column).unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= torch.tensor(presence, **column).unsqueeze(1) * output_seen.to(logits.dtype)
    return logits


def _token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] int64: how often each token id occurs in each row's ids (padded with an
    extra column, as vLLM pads with vocab_size, then dropped)."""
    width = max((len(row) for row in ids), default=0)
    padded = torch.full((len(ids), max(width, 1)), vocab, dtype=torch.int64)
    for r, row in enumerate(ids):
        if len(row):
            padded[r, : len(row)] = torch.as_tensor(list(row), dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab]


def min_p_mask(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """True where a token falls below min_p x its row's top probability (vLLM's MinPLogitsProcessor,
    over the softmax of the tempered logits); `min_p` [rows, 1], 0 masks nothing."""
    probs = torch.softmax(scaled, dim=-1)
    return probs < probs.amax(dim=-1, keepdim=True) * min_p


def _index(rows: list[int], total: int, device: torch.device) -> torch.Tensor | slice:
    if len(rows) == total:
        return slice(None)  # every row: no gather
    return torch.tensor(rows, dtype=torch.long, device=device)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor,
                 filtering: bool) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p per row, then the exponential race over the kept tokens."""
    rows, vocab = logits.shape
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device).unsqueeze(1)
    scaled = logits / temperature
    min_p = [p.min_p for p in params]
    if filtering and any(min_p):
        # vLLM: after temperature, before top-k and top-p (those renormalise over what min_p kept).
        limit = torch.tensor(min_p, dtype=logits.dtype, device=device).unsqueeze(1)
        scaled = scaled.masked_fill(min_p_mask(scaled, limit), float("-inf"))
    if not filtering:
        probs = torch.softmax(scaled, dim=-1)
    else:
        # Sorted once per row (stable: among tied logits the lower id ranks first, so top-k
        # keeps exactly k). The kept set is the first k ranks, then the smallest prefix of
        # those whose renormalised mass reaches top_p (the top token always stays).
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        beyond_k = rank >= torch.tensor(top_k, device=device).unsqueeze(1)
        sorted_probs = torch.softmax(sorted_logits.masked_fill(beyond_k, float("-inf")), dim=-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        limit = torch.tensor(top_p, dtype=sorted_probs.dtype, device=device).unsqueeze(1)
        sorted_probs = sorted_probs.masked_fill((mass_before >= limit) & (limit < 1.0), 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) samples from p exactly; E_i is keyed
    # by the token id, so the draw does not depend on how the row was sorted or batched. The
    # noise's int64 temporaries are rows x vocab each: made NOISE_ROWS rows at a time.
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    for start in range(0, rows, NOISE_ROWS):
        end = min(rows, start + NOISE_ROWS)
        exponential = -torch.log(counter_uniform(keys[start:end], vocab))
        tokens[start:end] = argmax_rows(probs[start:end] / exponential)
    return tokens


# Prompt positions whose log_softmax is taken at once: bounds the float32 [rows, vocab] temporary.
PROMPT_LOGPROB_ROWS = 256


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """Row r's logprob of `targets[r]` (the prompt token that follows the position whose logits
    row r holds) and its top `num_top`, of the raw distribution as `token_logprobs` takes them
    (vLLM's prompt_logprobs: log_softmax in float32 of the unprocessed logits)."""
    out: list[TokenLogprobs] = []
    for start in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        end = min(len(targets), start + PROMPT_LOGPROB_ROWS)
        logprobs = torch.log_softmax(logits[start:end].to(torch.float32), dim=-1)
        ids = torch.tensor(list(targets[start:end]), dtype=torch.int64, device=logits.device).unsqueeze(1)
        own = logprobs.gather(1, ids).squeeze(1).tolist()
        k = min(num_top, logprobs.shape[-1])
        if k:
            top_values, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
        else:
            top_values = top_ids = [[] for _ in own]
        out += [TokenLogprobs(v, tuple(zip(i, t))) for v, i, t in zip(own, top_ids, top_values)]
    return out
