"""Incremental detokenisation with stop-string matching (engine and gateway share it).

With a Hugging Face fast tokenizer the text of each new token comes from `tokenizers`'
`DecodeStream` (one Rust call per token, issue 35); any other tokenizer (a slow one, a
test's) is decoded by the same algorithm in Python: two `decode` calls over a short window.
"""

from __future__ import annotations

try:  # tokenizers >= 0.21; without it every tokenizer takes the Python path
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency
    DecodeStream = None

# Tokens before the output that give the tokenizer context for spacing (sentencepiece).
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24  # how far back a context that decodes to whole characters is looked for


class IncrementalDetokenizer:
    """Turns a growing output into text deltas; stops at (and cuts) the first stop string.

    Text that could still be the start of a stop string is held back until it cannot,
    so a streamed delta never has to be taken back.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None, min_tokens: int = 0):
        """`min_tokens`: stop strings count only once more output tokens than that were pushed
        (vLLM's detokenizer skips the stop check up to `min_tokens`, as its sampler holds back EOS)."""
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.min_tokens = min_tokens
        self._num_tokens = 0  # output tokens pushed
        self._holdback = max(map(len, self.stop)) - 1 if self.stop else 0
        context = _clean_context(tokenizer, prompt_ids)
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust core
        self._backend = backend if DecodeStream is not None and backend is not None else None
        self._stream = DecodeStream(ids=context, skip_special_tokens=True) if self._backend is not None else None
        self.text = ""  # output text so far, cut at a stop string
        self._emitted = 0
        self.stopped = False

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add output tokens; return the text now safe to show. Sets `stopped` on a stop string."""
        for token in token_ids:
            if self.stopped:
                break
            self._num_tokens += 1
            if self._stream is not None:
                new_text = self._stream.step(self._backend, token) or ""
            else:
                self._ids.append(token)
                new_text = self._decode_new()
            if not new_text:
                continue
            self.text += new_text
            if self.stop and self._num_tokens > self.min_tokens:
                cut = _find_stop(self.text, len(new_text), self.stop)
                if cut is not None:
                    self.text = self.text[:cut]
                    self.stopped = True
        hold = 0 if (final or self.stopped) else self._holdback
        upto = max(self._emitted, len(self.text) - hold)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta

    def _decode_new(self) -> str:
        # Decode a short window so cost stays constant per token; an incomplete UTF-8
        # sequence decodes to U+FFFD, in which case we wait for the next token.
        ids = self._ids
        prefix = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return full[len(prefix) :]
        return ""


def _clean_context(tokenizer, prompt_ids) -> list[int]:
    """The prompt's last few tokens, as the spacing context of the first output token: the
    shortest suffix of at least `_CONTEXT_TOKENS` that decodes to whole characters (a suffix
    ending inside a multi-byte character would glue its replacement character, or its
    bytes, onto the output's first text), else none (as vLLM primes its DecodeStream)."""
    prompt_ids = list(prompt_ids)
    if len(prompt_ids) <= _CONTEXT_TOKENS:
        candidates = [prompt_ids]
    else:
        candidates = [prompt_ids[-n:] for n in range(_CONTEXT_TOKENS, min(len(prompt_ids), _MAX_CONTEXT_TOKENS) + 1)]
    for suffix in candidates:
        try:
            text = tokenizer.decode(suffix, skip_special_tokens=True)
        except (OverflowError, TypeError, ValueError, IndexError):
            return []  # ids no tokenizer has: the request's validation refuses them, naming the field
        if "\ufffd" not in text:
            return suffix
    return []


def _find_stop(text: str, new_text_len: int, stops: list[str]) -> int | None:
    """Where the earliest stop string begins, looking only where the new text could complete one."""
    best = None
    for stop in stops:
        lo = max(0, len(text) - new_text_len - len(stop) + 1)
        i = text.find(stop, lo)
        if i != -1 and (best is None or i < best):
            best = i
    return best
