"""The diffusion runner: one packed forward pass per step over Refresh and Reuse requests (dLLM-Serve).

A step's requests are packed into one token batch (no padding): a Refresh request brings
its whole sequence, a Reuse request its current block (§4.4). The linear layers run once
over the packed rows; attention runs per request (bidirectional: every query sees every
key of its own sequence):

* **Refresh** — the sequence attends to itself; with the dual cache (Fast-dLLM; §2.3) every
  layer's keys (after RoPE) and values are kept for the Reuse steps of the block.
* **Reuse** — the block's fresh keys/values stand in for the cached ones at the block's
  positions (prefix, block, suffix in position order: what `LladaModel.forward_queries`
  computes); the cache itself is not changed until the next Refresh.
* **Head-centric sparse KV** (§4.5), when a request's `retention_ratio` < 1: at Refresh,
  per KV head, the context positions (all but the current block) are scored by the block's
  queries (raw dot products summed over the block's queries and the head's query group),
  max-pooled over a window of 3 positions (`SPARSE_POOL_KERNEL`), and the top
  k = ceil(r · context) kept — packed once into a dense `[n_kv_heads, k, head_dim]` buffer
  per layer allocated at r·L, keys already rotated, so a Reuse step reads it contiguously
  with no index map and no position recomputation. `uniform` (Sparse-dLLM, the baseline)
  sums the scores over heads and keeps one shared set.

**A predicted mask** (LLaDA's reference, `reference.py`): a transferred position whose
candidate is the mask token stays masked and is decided again at later steps; a Refresh (which
computes every position) also decides over the earlier blocks' positions still masked (LLaDA's
`mask_index = (x == mask_id)`, only the positions past the block excluded; Fast-dLLM's dual
cache likewise at its Refresh), a Reuse over its block alone. Those positions are kept on the
host (`_RequestState.left_masked`), so the common step needs no device-to-host copy.

**Logit decomposition** (§4.3): only the step's rows need logits (the current block's, and at
a Refresh the earlier blocks' positions still masked); they are computed
`max_num_logits` rows at a time, each chunk decoded at once (candidate, confidence; Gumbel
noise drawn row-sequentially from the request's own generator) and freed before the next —
also when one request's block alone is larger than the limit. The denoising decision per
request is then the reference's (`workers/diffusion/reference.py`), so with no cache the
runner reproduces the reference's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.core.diffusion import DiffusionBatch, DiffusionSequence, Phase, retained_tokens
from workers.engine.models.llada import LladaModel, _apply_rope, _rope_cos_sin

__all__ = ["DiffusionRunner", "SPARSE_POOL_KERNEL", "SPARSE_SELECTIONS", "select_context"]

SPARSE_POOL_KERNEL = 3  # dLLM-Serve Table 3: the local pooling window of the importance scores
SPARSE_SELECTIONS = ("head", "uniform")


def select_context(scores: torch.Tensor, keep: int, selection: str) -> torch.Tensor:
    """Positions kept per KV head from importance `scores` [n_kv_heads, context]: max-pooled
    over `SPARSE_POOL_KERNEL` positions, then the top `keep` per head (`head`, dLLM-Serve
    Eq. 6) or one top set from the scores summed over heads (`uniform`, Sparse-dLLM Eq. 5).
    Returns [n_kv_heads, keep] long, ascending positions in each row."""
    if selection not in SPARSE_SELECTIONS:
        raise ValueError(f"sparse_kv must be one of {list(SPARSE_SELECTIONS)}, got {selection!r}")
    pooled = F.max_pool1d(scores[None].float(), SPARSE_POOL_KERNEL, stride=1, padding=SPARSE_POOL_KERNEL // 2)[0]
    if selection == "uniform":
        pooled = pooled.sum(0, keepdim=True)
    # A stable sort: among equal scores the earlier position is kept (deterministic, unlike topk).
    kept = torch.sort(pooled, dim=-1, descending=True, stable=True).indices[:, :keep].sort(dim=-1).values
    return kept.expand(scores.shape[0], keep)


@dataclass
class _RequestState:
    seq: DiffusionSequence
    ids: torch.Tensor  # [L] the sequence: prompt, then generated / mask tokens
    generator: torch.Generator | None
    # Per layer (keys, values) [n_kv_heads, cached, head_dim]: the whole sequence (dense) or
    # the packed retained context (sparse); empty without a cache.
    cache: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # The earlier blocks' positions still masked, ascending (the model predicted the mask there):
    # a Refresh decides over them again. Empty unless the mask was predicted.
    left_masked: list[int] = field(default_factory=list)


class DiffusionRunner:
    """Owns the LLaDA model and each running request's tokens and KV; runs one step at a time."""

    def __init__(self, model: LladaModel, *, cache: str = "dual", max_num_logits: int = 2048,
                 sparse_kv: str = "head", device: torch.device | str = "cpu"):
        if max_num_logits < 1:
            raise ValueError(f"max_num_logits must be >= 1, got {max_num_logits}")
        if sparse_kv not in SPARSE_SELECTIONS:
            raise ValueError(f"sparse_kv must be one of {list(SPARSE_SELECTIONS)}, got {sparse_kv!r}")
        self.model = model
        self.config = model.config
        self.cache = cache
        self.max_num_logits = max_num_logits
        self.sparse_kv = sparse_kv
        self.device = torch.device(device)
        self.mask_token_id = model.config.mask_token_id
        self.states: dict[str, _RequestState] = {}
        self.peak_logit_rows = 0  # the most logit rows materialised at once (a check of §4.3)

    # ---- request state ------------------------------------------------------------------
    def start(self, seq: DiffusionSequence, prompt_ids: list[int], seed: int | None) -> None:
        ids = torch.full((seq.length,), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[: seq.prompt_len] = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        generator = None
        if seq.params.uses_randomness:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else 0)
        self.states[seq.key] = _RequestState(seq, ids, generator)

    def release(self, key: str) -> None:
        self.states.pop(key, None)

    def tokens(self, key: str, start: int, end: int) -> list[int]:
        return self.states[key].ids[start:end].tolist()

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: DiffusionBatch) -> None:
        """Run the batch: every request's block advances by its scheduled number of tokens."""
        if not batch.entries:
            return
        cfg = self.config
        states = [self.states[w.seq.key] for w in batch.entries]
        positions, inputs = [], []
        for work, state in zip(batch.entries, states):
            seq = state.seq
            if work.phase is Phase.REFRESH:
                positions.append(torch.arange(seq.length, device=self.device))
            else:
                positions.append(torch.arange(seq.block_start, seq.block_start + seq.params.block_length,
                                              device=self.device))
            inputs.append(state.ids[positions[-1]])
        # Classifier-free guidance (no cache only): each guided request's unconditional pass, the
        # same sequence with its prompt masked, packed after the conditional ones.
        guided = [i for i, s in enumerate(states) if s.seq.params.cfg_scale > 0]
        if guided and self.cache != "none":  # the engine refuses such requests; a direct caller must not reach here
            raise ValueError("cfg_scale: classifier-free guidance needs cache none (no cached unconditional pass)")
        segments = list(zip(batch.entries, states, positions))
        for i in guided:
            unconditional = states[i].ids.clone()
            unconditional[: states[i].seq.prompt_len] = self.mask_token_id
            segments.append((batch.entries[i], states[i], positions[i]))
            inputs.append(unconditional)
        packed_positions = torch.cat([pos for _, _, pos in segments])
        input_ids = torch.cat(inputs)
        cos, sin = _rope_cos_sin(cfg, packed_positions[None], self.device)
        cos, sin = cos[0].transpose(0, 1), sin[0].transpose(0, 1)  # [N, 1, head_dim]
        transformer = self.model.transformer
        hidden = transformer.wte(input_ids)
        total = hidden.shape[0]
        for layer, block in enumerate(transformer.blocks):
            normed = block.attn_norm(hidden)
            q = _apply_rope(block.q_proj(normed).view(total, cfg.n_heads, cfg.head_dim), cos, sin)
            k = _apply_rope(block.k_proj(normed).view(total, cfg.n_kv_heads, cfg.head_dim), cos, sin)
            v = block.v_proj(normed).view(total, cfg.n_kv_heads, cfg.head_dim)
            attended = torch.empty_like(q)
            offset = 0
            for work, state, pos in segments:
                rows = slice(offset, offset + pos.numel())
                offset += pos.numel()
                attended[rows] = self._attend(work.phase, state, layer, q[rows], k[rows], v[rows])
            hidden = hidden + block.attn_out(attended.flatten(1))
            normed = block.ff_norm(hidden)
            hidden = hidden + block.ff_out(F.silu(block.ff_proj(normed)) * block.up_proj(normed))
        self._denoise(batch, states, positions, hidden, guided)

    def _attend(self, phase: Phase, state: _RequestState, layer: int, q, k, v) -> torch.Tensor:
        """One request's attention in this layer: q [n, H, D], its fresh k/v [n, KVH, D]."""
        seq = state.seq
        start, end = seq.block_start, seq.block_start + seq.params.block_length
        if phase is Phase.REFRESH:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, L, D]
            if self.cache == "dual":
                self._store(state, layer, q[start:end], keys, values)
        else:
            cached_k, cached_v = state.cache[layer]
            fresh_k, fresh_v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, Bl, D]
            if seq.params.retention_ratio >= 1:  # dense: prefix, fresh block, suffix
                keys = torch.cat((cached_k[:, :start], fresh_k, cached_k[:, end:]), dim=1)
                values = torch.cat((cached_v[:, :start], fresh_v, cached_v[:, end:]), dim=1)
            else:  # sparse: the packed retained context, then the fresh block
                keys = torch.cat((cached_k, fresh_k), dim=1)
                values = torch.cat((cached_v, fresh_v), dim=1)
        group = self.config.n_heads // self.config.n_kv_heads
        keys_h, values_h = keys, values
        if group > 1:  # query head h reads KV head h // group (LLaDA's GQA)
            keys_h, values_h = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys_h[None], values_h[None])
        return out[0].transpose(0, 1)

    def _store(self, state: _RequestState, layer: int, block_q, keys, values) -> None:
        """Cache this layer's KV ([KVH, L, D]) at a Refresh: the whole sequence, or the retained context."""
        seq = state.seq
        if seq.params.retention_ratio >= 1:
            entry = (keys.clone(), values.clone())
        else:
            start, end = seq.block_start, seq.block_start + seq.params.block_length
            context = torch.cat((torch.arange(start), torch.arange(end, seq.length))).to(self.device)
            cfg = self.config
            group = cfg.n_heads // cfg.n_kv_heads
            # Per KV head, the attention the block's queries (and the head's query group) pay
            # each context key: softmax over all keys, summed over those queries (Eq. 6's
            # inner score as attention mass: raw dot products summed over queries cancel out).
            queries = block_q.transpose(0, 1).reshape(cfg.n_kv_heads, group * block_q.shape[0], cfg.head_dim)
            logits = torch.einsum("hqd,hkd->hqk", queries.float(), keys.float()) / math.sqrt(cfg.head_dim)
            scores = logits.softmax(dim=-1)[:, :, context].sum(dim=1)
            keep = retained_tokens(context.numel(), seq.params.retention_ratio)
            chosen = context[select_context(scores, keep, self.sparse_kv)]  # [KVH, keep] positions
            index = chosen[:, :, None].expand(-1, -1, cfg.head_dim)
            if len(state.cache) <= layer or state.cache[layer][0].shape[1] != keep:
                packed_k, packed_v = torch.gather(keys, 1, index), torch.gather(values, 1, index)
            else:  # the buffer allocated at the first Refresh is refilled in place
                packed_k, packed_v = state.cache[layer]
                torch.gather(keys, 1, index, out=packed_k)
                torch.gather(values, 1, index, out=packed_v)
            entry = (packed_k, packed_v)
        if len(state.cache) <= layer:
            state.cache.append(entry)
        else:
            state.cache[layer] = entry

    def _denoise(self, batch: DiffusionBatch, states: list[_RequestState], positions, hidden: torch.Tensor,
                 guided: list[int]) -> None:
        """Logits of every request's step rows in chunks of at most `max_num_logits` rows (§4.3),
        each chunk decoded and freed at once; then each request transfers its step's tokens. A
        guided request's rows count twice: its unconditional logits are materialised beside them."""
        rows, owners, step_rows = [], [], []
        first_row_of: dict[int, int] = {}  # request index -> its first row among `owners`
        offset = 0
        for index, (work, state, pos) in enumerate(zip(batch.entries, states, positions)):
            seq = state.seq
            block = torch.arange(seq.block_start, seq.block_start + seq.params.block_length, device=self.device)
            if work.phase is Phase.REFRESH:  # every position computed: the reference's step rows
                if state.left_masked:
                    block = torch.cat((torch.tensor(state.left_masked, dtype=torch.long, device=self.device), block))
                rows.append(offset + block)
            else:  # the packed rows are the block's
                rows.append(torch.arange(offset, offset + pos.numel(), device=self.device))
            step_rows.append(block)
            first_row_of[index] = len(owners)
            owners.extend([index] * block.numel())
            offset += pos.numel()
        unconditional_rows = {}  # request index -> its step rows in its unconditional pass
        for index in guided:
            unconditional_rows[index] = offset + step_rows[index]
            offset += positions[index].numel()
        row_index = torch.cat(rows)
        candidates = torch.empty(row_index.numel(), dtype=torch.long, device=self.device)
        confidence = torch.empty(row_index.numel(), dtype=torch.float32, device=self.device)
        transformer, cfg = self.model.transformer, self.config
        head = transformer.wte.weight if cfg.weight_tying else transformer.ff_out.weight
        head = head[: cfg.vocab_size]
        for chunk in _logit_chunks(owners, set(guided), self.max_num_logits):
            logits = F.linear(transformer.ln_f(hidden[row_index[chunk]]), head).float()
            guided_rows = 0
            # Rows of one request are contiguous; its generator draws them in order.
            start = chunk.start
            while start < chunk.stop:
                owner = owners[start]
                stop = start
                while stop < chunk.stop and owners[stop] == owner:
                    stop += 1
                part = logits[start - chunk.start: stop - chunk.start]
                params = states[owner].seq.params
                if params.cfg_scale > 0:  # LLaDA's guidance: uncond + (s + 1) (cond - uncond)
                    own = unconditional_rows[owner][start - first_row_of[owner]: stop - first_row_of[owner]]
                    uncond = F.linear(transformer.ln_f(hidden[own]), head).float()
                    part = uncond + (params.cfg_scale + 1) * (part - uncond)
                    guided_rows += stop - start
                    del uncond
                if params.temperature > 0:
                    uniform = torch.rand(part.shape, generator=states[owner].generator, dtype=torch.float64,
                                         device=self.device)
                    noisy = part.to(torch.float64).exp() / (-torch.log(uniform)) ** params.temperature
                    candidates[start:stop] = noisy.argmax(dim=-1)
                else:
                    candidates[start:stop] = part.argmax(dim=-1)
                if params.remasking == "low_confidence":
                    probs = F.softmax(part, dim=-1)
                    confidence[start:stop] = probs.gather(-1, candidates[start:stop, None]).squeeze(-1)
                start = stop
            self.peak_logit_rows = max(self.peak_logit_rows, logits.shape[0] + guided_rows)
            del logits
        offset = 0
        for work, state, where in zip(batch.entries, states, step_rows):
            seq = state.seq
            size = where.numel()
            ids = state.ids[where]
            cand, conf = candidates[offset:offset + size], confidence[offset:offset + size]
            offset += size
            if seq.params.remasking == "random":
                conf = torch.rand(size, generator=state.generator, device=self.device)
            masked = ids == self.mask_token_id
            conf = torch.where(masked, conf, torch.full_like(conf, -torch.inf))
            order = torch.sort(conf, descending=True, stable=True).indices
            chosen = order[: seq.num_transfer].sort().values
            # LLaDA: `x[transfer_index] = x0[transfer_index]` — a candidate that is the mask
            # leaves its position masked, to be decided again at a later step.
            ids[chosen] = cand[chosen]
            state.ids[where] = ids
            self._track_left_masked(state, work.phase)

    def _track_left_masked(self, state: _RequestState, phase: Phase) -> None:
        """Keep `left_masked` for the next step: after a block's last step its positions still
        masked join it; after a Refresh that decided over them, those unmasked leave it. Reads
        the device only then (a block's end, or when the mask was predicted)."""
        seq = state.seq
        last_step = seq.step_in_block == seq.params.steps_per_block - 1
        if not last_step and not (phase is Phase.REFRESH and state.left_masked):
            return
        end = seq.block_start + (seq.params.block_length if last_step else 0)
        masked = (state.ids[seq.prompt_len:end] == self.mask_token_id).nonzero().flatten() + seq.prompt_len
        state.left_masked = masked.tolist()


def _logit_chunks(owners: list[int], guided: set[int], max_rows: int):
    """Slices of the logit rows (in order) holding at most `max_rows` materialised rows each, a
    guided request's row counting twice (its unconditional row is computed beside it); a
    chunk holds at least one row."""
    start, weight = 0, 0
    for index, owner in enumerate(owners):
        cost = 2 if owner in guided else 1
        if index > start and weight + cost > max_rows:
            yield slice(start, index)
            start, weight = index, 0
        weight += cost
    if start < len(owners):
        yield slice(start, len(owners))
