"""Structured output on the worker: a request's `StructuredOutput` compiled by xgrammar for this
model's tokenizer, one grammar matcher per stage, and the token masks the sampler applies.

xgrammar (vLLM's default structured-output backend) is imported only when a request asks for
structured output: a worker without it refuses such a request with INVALID_ARGUMENT naming the
request's field. Compiled grammars are cached per worker (`CompiledGrammarCache`, an LRU keyed by
the constraint); a stage's matcher is built from the compiled grammar and the request's output
so far (`GrammarBackend.constraint`), so a stage that starts mid-output (a split, disaggregated
or migrated request) continues from exactly the state an unsplit request would be in: accepting
tokens is deterministic.

The mask: xgrammar fills a packed bitmask ([rows, ceil(vocab / 32)] int32, bit j of word w allows
token 32 w + j) on the CPU; `unpack_bitmask` turns it into a boolean [rows, vocab] on the logits'
device by integer ops (the same on every device: no xgrammar kernel, no Triton), and the sampler
sets refused tokens' logits to -inf before min_tokens, penalties and sampling (vLLM's order: the
bitmask is applied to the logits before the sampler, which takes the logprobs from them).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from typing import Any, Callable, Collection, Hashable, Sequence

import torch

from splitserve.core.errors import InvalidInput
from splitserve.core.structured import CHOICE, GRAMMAR, JSON, JSON_OBJECT, REGEX, StructuredOutput, choice_grammar

log = logging.getLogger(__name__)

BITS = 32
INSTALL_HINT = "pip install 'splitserve[structured]'"
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ": the client needs the rest.
_LOCATION_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


class CompiledGrammarCache:
    """At most `capacity` values by key, least recently used dropped first; thread-safe (the
    engine thread compiles, another thread may warm it). `build(key)` makes a missing one; an
    error it raises is not cached."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"structured_output_cache_size must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
        value = build()  # outside the lock: a slow compile does not hold up other keys' hits
        with self._lock:
            self.misses += 1
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)


class GrammarConstraint:
    """One stage's grammar state (the core's OutputConstraint): accepts the output's tokens and
    says which may come next."""

    def __init__(self, matcher: Any):
        self._matcher = matcher

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(int(token_id)))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the packed int32 `bitmask`: the tokens allowed next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    """Compiles structured-output constraints for one tokenizer and makes their matchers.

    `vocab_size` is the model's (its logits' width, which may exceed the tokenizer's: the extra
    ids are never allowed); `eos_token_ids` end the grammar (allowed where it is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int], cache_size: int = 256):
        import xgrammar  # ImportError: the caller names the request's field

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_token_ids) or None)
        # xgrammar's own cache off: ours is bounded by count and keyed by the whole constraint.
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.cache = CompiledGrammarCache(cache_size)

    def compile(self, structured: StructuredOutput) -> Any:
        """The compiled grammar (cached); InvalidInput naming the request's field when the
        schema, regex or grammar does not compile."""
        structured.validate()
        return self.cache.get(structured.cache_key, lambda: self._compile(structured))

    def _compile(self, s: StructuredOutput) -> Any:
        compiler = self._compiler
        try:
            if s.kind == JSON:
                return compiler.compile_json_schema(s.spec, any_whitespace=s.any_whitespace)
            if s.kind == JSON_OBJECT:  # OpenAI's JSON mode: an object (vLLM compiles the same schema)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=s.any_whitespace)
            if s.kind == REGEX:
                return compiler.compile_regex(s.spec)
            if s.kind == CHOICE:
                return compiler.compile_grammar(choice_grammar(s.choices))
            if s.kind == GRAMMAR:
                return compiler.compile_grammar(s.spec)
        except (RuntimeError, ValueError, TypeError) as err:
            what = {JSON: "the JSON schema", JSON_OBJECT: "the JSON grammar", REGEX: "the regex",
                    CHOICE: "the choices", GRAMMAR: "the grammar (EBNF)"}[s.kind]
            raise InvalidInput(f"{s.param}: {what} does not compile: {compile_error_text(err)}",
                               param=s.param) from None
        raise InvalidInput(f"{s.param}: unknown structured output kind {s.kind!r}", param=s.param)

    def constraint(self, structured: StructuredOutput, output_ids: Sequence[int] = ()) -> GrammarConstraint:
        """A matcher at the state after `output_ids` (the earlier stages' output)."""
        matcher = self._xgr.GrammarMatcher(self.compile(structured))
        state = GrammarConstraint(matcher)
        for i, token in enumerate(output_ids):
            if not state.accept(token):
                raise InvalidInput(f"output_token_ids: token {token} at index {i} does not follow the request's "
                                   f"{structured.param} constraint", param="output_token_ids")
        return state


def allowed_tokens(constraints: Sequence[GrammarConstraint], vocab: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [len(constraints), vocab] on `device`: the tokens each constraint allows next."""
    bitmask = torch.full((len(constraints), -(-vocab // BITS)), -1, dtype=torch.int32)
    for row, constraint in enumerate(constraints):
        constraint.fill_bitmask(bitmask, row)
    return unpack_bitmask(bitmask, vocab, device)


def compile_error_text(err: BaseException) -> str:
    """xgrammar's error message without its source location, on one line."""
    lines = [_LOCATION_PREFIX.sub("", line).strip() for line in str(err).strip().splitlines()]
    return " ".join(line for line in lines if line)[:500]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [rows, vocab] of a packed int32 bitmask (True: allowed), on `device`."""
    words = bitmask.to(device)
    shifts = torch.arange(BITS, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # arithmetic shift of negative words: &1 keeps the bit
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


def load_backend(tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int], cache_size: int,
                 param: str) -> GrammarBackend:
    """The backend, or InvalidInput naming `param` when this worker cannot constrain output."""
    if tokenizer is None:
        raise InvalidInput(f"{param}: structured output needs the model's tokenizer; the model directory has none",
                           param=param)
    try:
        return GrammarBackend(tokenizer, vocab_size, eos_token_ids, cache_size)
    except ImportError as err:
        log.warning("structured output refused: xgrammar is not installed (%s)", err)
        raise InvalidInput(f"{param}: structured output is not available on this worker: the xgrammar package is "
                           f"not installed ({INSTALL_HINT})", param=param) from None
