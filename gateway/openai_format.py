"""OpenAI-shaped JSON: responses, streamed chunks (SSE framing), model list and error bodies. Pure."""

from __future__ import annotations

import json
from typing import Any

from splitserve.errors import NotFound, Overloaded, PayloadTooLarge, SplitserveError, Unauthenticated

SSE_DONE = b"data: [DONE]\n\n"

# OpenAI's `code` strings for the errors that have one; others get their gRPC code's name.
_ERROR_CODES = {Unauthenticated: "invalid_api_key", Overloaded: "rate_limit_exceeded",
                PayloadTooLarge: "request_too_large"}


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: {json}\\n\\n`."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(err: SplitserveError) -> dict[str, Any]:
    """`{"error": {message, type, param, code}}` for a typed error."""
    if isinstance(err, NotFound) and err.param == "model":
        code = "model_not_found"
    elif getattr(err, "openai_code", None):  # e.g. context_length_exceeded (gateway.validation)
        code = err.openai_code
    else:
        code = next((c for cls, c in _ERROR_CODES.items() if isinstance(err, cls)), err.code.name.lower())
    return {"error": {"message": err.message, "type": err.error_type, "param": err.param, "code": code}}


def models_response(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "splitserve", "max_model_len": max_model_len}]}


def tokenize_response(token_ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    """POST /tokenize, as vLLM answers it (token_strs null unless return_token_strs was set)."""
    return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": token_strs}


def detokenize_response(text: str) -> dict[str, Any]:
    """POST /detokenize, as vLLM answers it."""
    return {"prompt": text}


def version_response(version: str) -> dict[str, Any]:
    """GET /version, as vLLM answers it (the serving stack's version)."""
    return {"version": version}


class ResponseShaper:
    """Builds one request's OpenAI response or stream chunks; `chat` picks the chat.completion shapes."""

    def __init__(self, *, chat: bool, request_id: str, model: str, created: int, include_usage: bool = False,
                 continuous_usage: bool = False):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = created
        self.include_usage = include_usage
        # vLLM's continuous_usage_stats: every chunk carries the usage so far, and a delta of
        # tokens without text yet (an incomplete UTF-8 character) is a chunk of its own, so the
        # client sees each token when it arrives.
        self.continuous_usage = include_usage and continuous_usage
        self._usage: dict[str, int] | None = None
        self._role_sent = False

    def response(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The non-streaming response body."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return body

    def chunks(self, text: str, finish_reason: str | None, prompt_tokens: int = 0, completion_tokens: int = 0,
               new_tokens: int = 0) -> list[dict[str, Any]]:
        """Stream chunks for one delta (chat opens with a role-only chunk, as OpenAI does); with
        continuous usage each carries the usage after this delta's `new_tokens`."""
        # Tokens without text yet: no chunk, unless the client counts tokens by continuous usage.
        counted_only = self.continuous_usage and new_tokens > 0 and not text and not finish_reason
        out = []
        if self.chat and not self._role_sent:
            self._role_sent = True
            if self.continuous_usage:  # the role chunk comes before this delta's tokens
                self._usage = usage_dict(prompt_tokens, completion_tokens - new_tokens)
            out.append(self._chunk({"role": "assistant", "content": ""}, None))
        if self.continuous_usage:
            self._usage = usage_dict(prompt_tokens, completion_tokens)
        if self.chat:
            if text and finish_reason:
                # OpenAI sends the last content and the finish reason in separate chunks.
                out.append(self._chunk({"content": text}, None))
                out.append(self._chunk({}, finish_reason))
            elif text or finish_reason or counted_only:
                out.append(self._chunk({"content": text} if text or counted_only else {}, finish_reason))
        elif text or finish_reason or counted_only:
            out.append(self._chunk(text, finish_reason))
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: usage and no choices."""
        body = self._envelope(self._chunk_object(), [])
        body["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return body

    def _chunk(self, content: Any, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        body = self._envelope(self._chunk_object(), [choice])
        if self.include_usage:
            # OpenAI sends null usage on every chunk but the last; vLLM's continuous usage, the sum so far.
            body["usage"] = self._usage
        return body

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
