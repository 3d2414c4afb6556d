"""What a scheduled step computes, and what it costs under the performance model.

One definition for every driver: the emulated engine sleeps `step_time`, the simulator
advances virtual time by it, policies learn from the `StepShape` of executed steps, and
the profiler's synthetic steps are described the same way.

An entry of one new token past the prompt is a *decode*: it reads the KV of its whole
context (its new token included). Anything else is a *prefill chunk* `(l_hist, l_incr)`:
`l_incr` new tokens on `l_hist` tokens whose KV is in place — a prompt chunk, a
re-prefill on history (AMPD), or a recompute after preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from splitserve.perf.model import PerfModel


@dataclass(frozen=True, slots=True)
class StepShape:
    prefill_chunks: tuple[tuple[int, int], ...] = ()  # (l_hist, l_incr) per prefill entry
    num_decodes: int = 0
    decode_context_tokens: int = 0  # summed over decodes: the KV each reads, its new token included

    @classmethod
    def of(cls, entries: Iterable[tuple[int, int, int]]) -> StepShape:
        """The shape of entries given as (start, num_new_tokens, prompt_len)."""
        chunks = []
        decodes = context = 0
        for start, n, prompt_len in entries:
            if n == 1 and start >= prompt_len:
                decodes += 1
                context += start + 1
            else:
                chunks.append((start, n))
        return cls(tuple(chunks), decodes, context)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill_chunks)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes

    @property
    def mean_decode_context(self) -> float:
        return self.decode_context_tokens / self.num_decodes if self.num_decodes else 0.0

    @property
    def is_decode_only(self) -> bool:
        return not self.prefill_chunks and self.num_decodes > 0


def step_time(perf_model: PerfModel, shape: StepShape) -> float:
    """Seconds the performance model predicts for one step of this shape."""
    return perf_model.step_time(shape.prefill_chunks, shape.num_decodes, shape.mean_decode_context)
