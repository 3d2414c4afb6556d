"""Multi-turn chat conversations shaped like LAPS' workload (LMsys-Chat-1M), from what is here.

LAPS (arXiv 2601.11589, Figure 2) measures on LMsys-Chat-1M that 63% of first-turn prompts
(system prompt included) and 81% of later turns' *new* tokens are below 256 tokens: most
(re-)prefills are short, long ones (> 1 K tokens) are rare. Neither LMsys nor ShareGPT is
available here, so a conversation is built from three sources, each named in reports:

* **new tokens per turn**: a lognormal per turn kind (first / later), its median placed so
  that P(L < 256) is Figure 2's share, its log-space spread `sigma` taken from the Mooncake
  conversation trace's real re-prefills (`mooncake_turns`: a row whose `hash_ids` extend an
  earlier row's beyond the shared first block is a later turn of that conversation; the
  robust spread of ln L over those rows, IQR / 1.349, is 1.39; the plain standard deviation
  1.71 is inflated by the trace's 512-token block granularity);
* **turns per conversation**: the Mooncake chains' empirical distribution (mean 1.63 in the
  one-hour trace), or a fixed mean;
* **output tokens**: drawn from the Azure 2023 conversation trace's generated lengths
  (mean 211, median 129), or a lognormal.

A conversation is a `loadgen.sessions.Session`: round 0 is the first turn (no history), each
later round appends its new tokens to the whole history (earlier prompts and outputs), after
a think time (`ToolDelay`, the sessions' default: exponential, mean 1 s). So a later round is a
re-prefill of L new tokens on H history tokens, which the simulator serves with the history's
KV pinned on the session's decode worker (pulled by a remote prefill, AMPD's lazy pull).

`new_token_stats` reports the distribution beside Figure 2's numbers; `split_by_class`
classifies each round by its new tokens against L_m(H) (`PerfModel.prefill_boundary`), never
by the total prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Callable, Sequence

import numpy as np

from loadgen.sessions import Round, Session, ToolDelay
from loadgen.traces import TraceRequest

__all__ = ["FIGURE2", "ConversationShape", "MooncakeTurn", "mooncake_turns", "mooncake_turn_stats",
           "generate_conversations", "rounds_of", "new_token_stats", "split_by_class", "lognormal_median_for"]

# LAPS Figure 2 (LMsys-Chat-1M): share of prompts below 256 tokens, first turn / later turns.
FIGURE2 = {"threshold": 256, "first_below": 0.63, "later_below": 0.81}
# ln(new tokens) spread of the Mooncake conversation trace's later turns (IQR / 1.349), see above.
MOONCAKE_LATER_SIGMA = 1.39


def lognormal_median_for(share_below: float, threshold: float, sigma: float) -> float:
    """The median of a lognormal with log-sd `sigma` whose P(X < threshold) is `share_below`."""
    if not 0 < share_below < 1:
        raise ValueError(f"share_below must be in (0, 1), got {share_below}")
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    return threshold / math.exp(NormalDist().inv_cdf(share_below) * sigma)


@dataclass(frozen=True)
class MooncakeTurn:
    """One Mooncake row read as a turn: its conversation (first row's index), turn index,
    history H (the shared prefix, whole blocks) and new tokens L = prompt - H."""

    index: int
    conversation: int
    turn: int
    history: int
    new_tokens: int
    arrival_s: float


def mooncake_turns(rows: Sequence[TraceRequest], min_shared_blocks: int = 2) -> list[MooncakeTurn]:
    """Conversations in a Mooncake trace by its shared prefixes.

    A row whose `prefix_block_ids` share at least `min_shared_blocks` leading blocks with an
    earlier row's continues the conversation of the (latest) row it shares the longest
    prefix with; its history is the shared blocks, its new tokens the rest of its prompt. The
    default 2 skips the first block, which nearly every row of the conversation trace shares
    (a system prompt, not a conversation). Rows in the given (arrival) order."""
    if min_shared_blocks < 1:
        raise ValueError(f"min_shared_blocks must be >= 1, got {min_shared_blocks}")
    latest: dict[tuple[int, ...], int] = {}  # prefix -> latest row holding it
    out: list[MooncakeTurn] = []
    for i, row in enumerate(rows):
        ids, bt = row.prefix_block_ids, row.block_tokens
        shared, parent = 0, -1
        for k in range(len(ids), 0, -1):
            j = latest.get(ids[:k])
            if j is not None:
                shared, parent = k, j
                break
        for k in range(1, len(ids) + 1):
            latest[ids[:k]] = i
        if parent >= 0 and shared >= min_shared_blocks and bt > 0:
            history = min(shared * bt, row.prompt_len - 1)
            p = out[parent]
            out.append(MooncakeTurn(i, p.conversation, p.turn + 1, history, row.prompt_len - history, row.arrival_s))
        else:
            out.append(MooncakeTurn(i, i, 0, 0, row.prompt_len, row.arrival_s))
    return out


def mooncake_turn_stats(turns: Sequence[MooncakeTurn]) -> dict[str, Any]:
    """The Mooncake conversations' turns per conversation, new-token spread and Figure-2 shares."""
    first = np.array([t.new_tokens for t in turns if t.turn == 0], dtype=np.float64)
    later = np.array([t.new_tokens for t in turns if t.turn > 0], dtype=np.float64)
    per_conv = np.bincount(np.array([t.conversation for t in turns]))
    per_conv = per_conv[per_conv > 0]

    def robust_sigma(x: np.ndarray) -> float:
        q75, q25 = np.percentile(np.log(np.maximum(x, 1)), [75, 25])
        return float((q75 - q25) / 1.349)

    return {"rows": len(turns), "conversations": int(len(per_conv)), "mean_turns": float(per_conv.mean()),
            "turns_per_conversation": [int(v) for v in per_conv],
            "first": _length_summary(first), "later": _length_summary(later),
            "later_sigma_iqr": robust_sigma(later) if len(later) else float("nan"),
            "later_sigma_sd": float(np.log(np.maximum(later, 1)).std()) if len(later) else float("nan")}


def _length_summary(x: np.ndarray) -> dict[str, float]:
    if not len(x):
        return {"n": 0}
    return {"n": int(len(x)), "mean": float(x.mean()), "p50": float(np.median(x)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99)), "below_64": float((x < 64).mean()),
            "below_256": float((x < 256).mean()), "above_1k": float((x > 1024).mean()),
            "above_4k": float((x > 4096).mean())}


@dataclass(frozen=True)
class ConversationShape:
    """How conversations are drawn (see the module docstring)."""

    sigma: float = MOONCAKE_LATER_SIGMA
    first_below_256: float = FIGURE2["first_below"]
    later_below_256: float = FIGURE2["later_below"]
    # Empirical turns per conversation to draw from (e.g. the Mooncake chains); empty: mean_turns.
    turns: tuple[int, ...] = ()
    mean_turns: float = 2.0  # without `turns`: 1 + Poisson(mean - 1)
    # Empirical output lengths to draw from (e.g. Azure conversation GeneratedTokens); empty: lognormal.
    outputs: tuple[int, ...] = ()
    mean_output: float = 211.0
    output_sigma: float = 0.86
    max_new_tokens: int = 16384  # one turn's new tokens at most (a draw above is clipped)
    max_context: int = 32768  # a conversation ends before a turn would exceed it (Qwen2.5's context)
    think_time: ToolDelay = field(default_factory=ToolDelay)

    def medians(self) -> tuple[float, float]:
        return (lognormal_median_for(self.first_below_256, FIGURE2["threshold"], self.sigma),
                lognormal_median_for(self.later_below_256, FIGURE2["threshold"], self.sigma))

    def describe(self) -> dict[str, Any]:
        first, later = self.medians()
        return {"sigma": self.sigma, "first_below_256": self.first_below_256,
                "later_below_256": self.later_below_256, "first_median": round(first, 1),
                "later_median": round(later, 1),
                "turns": f"empirical ({len(self.turns)} conversations, mean {np.mean(self.turns):.2f})"
                if self.turns else f"1 + Poisson({self.mean_turns - 1:g})",
                "outputs": f"empirical ({len(self.outputs)} lengths, mean {np.mean(self.outputs):.0f})"
                if self.outputs else f"lognormal(mean {self.mean_output:g}, sigma {self.output_sigma:g})",
                "max_new_tokens": self.max_new_tokens, "max_context": self.max_context,
                "think_time": f"{self.think_time.kind} mean {self.think_time.mean_s:g} s"}


def generate_conversations(shape: ConversationShape, n: int, rng: np.random.Generator,
                           id_prefix: str = "conv") -> list[Session]:
    """`n` conversations as sessions (deterministic for a seeded `rng`)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    first_median, later_median = shape.medians()
    if shape.turns:
        turns = rng.choice(np.asarray(shape.turns, dtype=np.int64), size=n)
    else:
        turns = 1 + rng.poisson(max(0.0, shape.mean_turns - 1), size=n)
    total = int(turns.sum())
    z = rng.standard_normal(total)
    if shape.outputs:
        outputs = rng.choice(np.asarray(shape.outputs, dtype=np.int64), size=total)
    else:
        mu = math.log(shape.mean_output) - shape.output_sigma ** 2 / 2
        outputs = np.rint(rng.lognormal(mu, shape.output_sigma, size=total)).astype(np.int64)
    outputs = np.maximum(1, outputs)
    delays = shape.think_time.sample(total, rng)
    sessions: list[Session] = []
    start = 0
    for i, k in enumerate(turns.tolist()):
        rounds: list[Round] = []
        context = 0
        for j in range(start, start + k):
            median = first_median if j == start else later_median
            new = int(min(shape.max_new_tokens, max(1, round(median * math.exp(shape.sigma * z[j])))))
            out = int(outputs[j])
            if context + new + out > shape.max_context:
                break
            rounds.append(Round(new, out, 0.0 if j == start else float(delays[j])))
            context += new + out
        if not rounds:  # a first turn longer than the context: clipped to fit
            out = int(outputs[start])
            rounds.append(Round(max(1, min(shape.max_new_tokens, shape.max_context - out - 1)), out, 0.0))
        sessions.append(Session(f"{id_prefix}-{i}", rounds))
        start += k
    return sessions


def rounds_of(sessions: Sequence[Session]) -> list[tuple[str, int, int, int]]:
    """(request id as the simulator names it, turn, history H, new tokens L) of every round."""
    return [(f"{s.session_id}/r{i}", i, s.history_len(i), r.incr_prompt_len)
            for s in sessions for i, r in enumerate(s.rounds)]


def new_token_stats(sessions: Sequence[Session]) -> dict[str, Any]:
    """New tokens of first and later turns (Figure 2's view), histories, turns per conversation."""
    rows = rounds_of(sessions)
    first = np.array([r[3] for r in rows if r[1] == 0], dtype=np.float64)
    later = np.array([r[3] for r in rows if r[1] > 0], dtype=np.float64)
    hist = np.array([r[2] for r in rows if r[1] > 0], dtype=np.float64)
    return {"conversations": len(sessions), "rounds": len(rows),
            "mean_turns": len(rows) / max(1, len(sessions)),
            "later_share": float(len(later) / max(1, len(rows))),
            "first": _length_summary(first), "later": _length_summary(later), "later_history": _length_summary(hist),
            "output_mean": float(np.mean([r.output_len for s in sessions for r in s.rounds])) if rows else 0.0}


def split_by_class(rows: Sequence[tuple[str, int, int, int]],
                   boundary: Callable[[int], float]) -> dict[str, bool]:
    """request id -> short, by the round's new tokens L against L_m(H) (`boundary(H)`, e.g.
    `perf_model.prefill_boundary`): LAPS' classification of a (re-)prefill, not the prompt's length."""
    cache: dict[int, float] = {}
    out = {}
    for request_id, _turn, history, new in rows:
        l_m = cache.get(history)
        if l_m is None:
            l_m = cache[history] = boundary(history)
        out[request_id] = new < l_m
    return out
