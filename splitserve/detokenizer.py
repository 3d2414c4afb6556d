"""Incremental detokenisation with stop-string matching (engine and gateway share it)."""

from __future__ import annotations

# Tokens before the output that give the tokenizer context for spacing (sentencepiece).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing output into text deltas; stops at (and cuts) the first stop string.

    Text that could still be the start of a stop string is held back until it cannot,
    so a streamed delta never has to be taken back.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self._holdback = max(map(len, self.stop)) - 1 if self.stop else 0
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # output text so far, cut at a stop string
        self._emitted = 0
        self.stopped = False

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add output tokens; return the text now safe to show. Sets `stopped` on a stop string."""
        for token in token_ids:
            if self.stopped:
                break
            self._ids.append(token)
            new_text = self._decode_new()
            if not new_text:
                continue
            self.text += new_text
            if self.stop:
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


def _find_stop(text: str, new_text_len: int, stops: list[str]) -> int | None:
    """Where the earliest stop string begins, looking only where the new text could complete one."""
    best = None
    for stop in stops:
        lo = max(0, len(text) - new_text_len - len(stop) + 1)
        i = text.find(stop, lo)
        if i != -1 and (best is None or i < best):
            best = i
    return best
