"""Incremental detokenisation and stop-string matching for one sequence."""

from __future__ import annotations

from workers.engine.sequence import Sequence

# Tokens before the output that give the tokenizer context for spacing (sentencepiece).
_CONTEXT_TOKENS = 5


def start(seq: Sequence) -> None:
    """Position the detokeniser at the start of the output."""
    seq.detok_prefix_offset = max(seq.prompt_len - _CONTEXT_TOKENS, 0)
    seq.detok_read_offset = seq.prompt_len


def decode_new_text(tokenizer, seq: Sequence) -> str:
    """Text added by tokens after the read offset; empty while a UTF-8 char is incomplete."""
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.detok_prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.detok_prefix_offset = seq.detok_read_offset
        seq.detok_read_offset = len(ids)
        return full[len(prefix) :]
    return ""


def find_stop(text: str, new_text_len: int, stops: list[str]) -> int | None:
    """Index in `text` where the earliest stop string begins, looking only where new text could complete one."""
    best = None
    for stop in stops:
        lo = max(0, len(text) - new_text_len - len(stop) + 1)
        i = text.find(stop, lo)
        if i != -1 and (best is None or i < best):
            best = i
    return best
