"""Request shapes and synthetic prompt tokens, including Mooncake prefix sharing.

Token ids are drawn uniformly from ``[vocab_lo, vocab_hi)`` (high end exclusive, like
``numpy``), so callers can keep special tokens (BOS/EOS/pad, usually the low or high
ids) out of prompts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from loadgen.traces import TraceRequest

__all__ = [
    "RequestShape",
    "DYNASERVE_SHAPES",
    "parse_shape",
    "parse_shapes",
    "make_prompt_tokens",
    "PrefixBlockTokens",
]

_SHAPE_RE = re.compile(r"^\s*P\s*(?P<prompt>[^/]*?)\s*/\s*D\s*(?P<output>.*?)\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class RequestShape:
    """A fixed request shape: prompt length and output length in tokens."""

    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len: must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            raise ValueError(f"output_len: must be >= 1, got {self.output_len}")

    def scaled(self, length_scale: float) -> RequestShape:
        """Both lengths multiplied by ``length_scale``, rounded, at least 1."""
        if not (length_scale > 0 and math.isfinite(length_scale)):
            raise ValueError(f"length_scale: must be a finite number > 0, got {length_scale!r}")
        return RequestShape(
            max(1, round(self.prompt_len * length_scale)),
            max(1, round(self.output_len * length_scale)),
        )

    def __str__(self) -> str:
        return f"P{self.prompt_len}/D{self.output_len}"


def parse_shape(spec: str) -> RequestShape:
    """Parse ``"P8192/D32"`` (prompt 8192 tokens, decode 32) into a :class:`RequestShape`."""
    m = _SHAPE_RE.match(spec)
    if not m:
        raise ValueError(f"shape: expected 'P<prompt>/D<output>', got {spec!r}")
    values = {}
    for group, name in (("prompt", "prompt_len"), ("output", "output_len")):
        text = m.group(group)
        if not (text.isascii() and text.isdigit()):
            raise ValueError(f"{name}: not a positive integer: {text!r} in {spec!r}")
        values[name] = int(text)
    return RequestShape(**values)


def parse_shapes(spec: str) -> list[RequestShape]:
    """Parse a comma-separated list of shapes, e.g. ``"P8192/D32,P2048/D512"``."""
    return [parse_shape(part) for part in spec.split(",") if part.strip()]


# The three request shapes DynaServe evaluates (long prefill, balanced, long decode).
DYNASERVE_SHAPES: tuple[RequestShape, ...] = (
    RequestShape(8192, 32),
    RequestShape(2048, 512),
    RequestShape(219, 1467),
)


def _check_vocab(vocab_lo: int, vocab_hi: int) -> None:
    if not 0 <= vocab_lo < vocab_hi:
        raise ValueError(f"vocab_lo/vocab_hi: need 0 <= vocab_lo < vocab_hi, got [{vocab_lo}, {vocab_hi})")


def make_prompt_tokens(
    prompt_len: int,
    rng: np.random.Generator,
    vocab_lo: int,
    vocab_hi: int,
    shared_prefix: Sequence[int] = (),
) -> list[int]:
    """Synthesise ``prompt_len`` token ids: ``shared_prefix`` first, then uniform random ids.

    A ``shared_prefix`` longer than the prompt is truncated, so the result always has
    exactly ``prompt_len`` tokens.
    """
    if prompt_len < 0:
        raise ValueError(f"prompt_len: must be >= 0, got {prompt_len}")
    _check_vocab(vocab_lo, vocab_hi)
    prefix = [int(t) for t in shared_prefix[:prompt_len]]
    fresh = rng.integers(vocab_lo, vocab_hi, size=prompt_len - len(prefix))
    return prefix + fresh.tolist()


@dataclass
class PrefixBlockTokens:
    """Deterministic tokens for trace prefix blocks: equal hash id -> identical tokens.

    Block ``h`` of size ``b`` is drawn from a generator seeded by ``(seed, h)``, so it is
    the same for every request, every run and every process with the same seed; that is
    what turns Mooncake's shared ``hash_ids`` into real prefix-cache hits. The block
    size comes from the request (``TraceRequest.block_tokens``), so it follows
    :func:`loadgen.traces.scale_lengths`. The cache only saves recomputation.
    """

    vocab_lo: int
    vocab_hi: int
    seed: int = 0
    _cache: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _check_vocab(self.vocab_lo, self.vocab_hi)
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")

    def block(self, hash_id: int, block_tokens: int) -> list[int]:
        """The ``block_tokens`` token ids standing for block ``hash_id``."""
        if hash_id < 0:
            raise ValueError(f"hash_id: must be >= 0, got {hash_id}")
        key = (hash_id, block_tokens)
        tokens = self._cache.get(key)
        if tokens is None:
            block_rng = np.random.default_rng([self.seed, hash_id, block_tokens])
            tokens = block_rng.integers(self.vocab_lo, self.vocab_hi, size=block_tokens).tolist()
            self._cache[key] = tokens
        return tokens

    def prompt_tokens(self, request: TraceRequest, rng: np.random.Generator) -> list[int]:
        """Exactly ``request.prompt_len`` ids: the request's blocks in order, then fresh ids.

        The blocks are truncated when they cover more than the prompt (the last
        Mooncake block is usually partial); when rounding after scaling leaves the
        prompt longer than its blocks, the tail is filled from ``rng`` (request-unique).
        """
        tokens: list[int] = []
        if request.block_tokens > 0:
            for hash_id in request.prefix_block_ids:
                if len(tokens) >= request.prompt_len:
                    break
                tokens.extend(self.block(hash_id, request.block_tokens))
        return make_prompt_tokens(request.prompt_len, rng, self.vocab_lo, self.vocab_hi, tokens)
