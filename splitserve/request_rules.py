"""The rules every service applies to the request fields it receives, defined once.

The gateway validates a client's request fully at the edge (`gateway/validation.py`); the
coordinator's `Submit` and the scheduler's `Place` are gRPC services any process on the
cluster network can call, so each checks the fields it relies on at its own boundary — with
these same rules and limits, never a copy — and the core below them only asserts
invariants. Each rule raises `InvalidArgument` naming the field and the limit.
"""

from __future__ import annotations

from splitserve.errors import InvalidArgument

MAX_ID_CHARS = 256  # request and session ids
UINT32_MAX = 2**32 - 1  # token positions and counts travel as uint32


def check_request_id(value: str, param: str = "request_id") -> str:
    """A request id travels on as gRPC metadata (x-request-id), which takes printable ASCII only."""
    if len(value) > MAX_ID_CHARS or not (value.isascii() and value.isprintable()):
        raise InvalidArgument(f"{param} must be at most {MAX_ID_CHARS} printable ASCII characters, got "
                              f"{value[:64]!r}", param=param)
    return value


def check_id_length(value: str, param: str) -> str:
    """Session ids: any text, bounded (they name Redis keys)."""
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{param} must be at most {MAX_ID_CHARS} characters, got {len(value)}", param=param)
    return value


def check_prompt_len(prompt_len: int, param: str = "prompt_token_ids") -> int:
    if prompt_len < 1:
        raise InvalidArgument(f"{param} must contain at least 1 token", param=param)
    return prompt_len


def check_token_positions(prompt_len: int, max_tokens: int, param: str = "max_tokens") -> None:
    """The last stage of a plan ends at prompt_len + max_tokens, a uint32 token position."""
    if prompt_len + max_tokens > UINT32_MAX:
        raise InvalidArgument(f"{param}: prompt_len + max_tokens = {prompt_len + max_tokens} exceeds the largest "
                              f"token position {UINT32_MAX}", param=param)
