"""A stand-in tokenizer for gateway tests that need no model: bytes as token ids, BOS 256."""

from __future__ import annotations


class ByteTokenizer:
    chat_template = None

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([256] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
