"""OpenAI-shaped JSON: responses, streamed chunks (SSE framing), model list and error bodies. Pure."""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from splitserve.core.sampling import TokenLogprobs

from splitserve.errors import NotFound, Overloaded, PayloadTooLarge, SplitserveError, Unauthenticated

SSE_DONE = b"data: [DONE]\n\n"
# OpenAI's stand-in for a logprob of -inf (JSON has no infinity), as vLLM clamps it.
MIN_LOGPROB = -9999.0

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


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _step_logprobs(token: int, record: TokenLogprobs) -> dict[int, float]:
    """One token's logprobs as vLLM's LogprobsProcessor orders them: the sampled token first,
    then the top N by rank (the sampled one keeps its first place when it is among them)."""
    step = {token: record.logprob}
    for top_id, value in record.top:
        step.setdefault(top_id, value)
    return step


def completion_logprobs(token_ids: Sequence[int], records: Sequence[TokenLogprobs | None], num_logprobs: int,
                        token_text: Callable[[int], str], initial_text_offset: int = 0) -> dict[str, Any]:
    """A completions choice's `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}), as
    vLLM's serving_completion builds it: each token's text is its id decoded alone, top_logprobs
    maps the sampled token and the top `num_logprobs` (so up to N + 1 entries, as OpenAI's spec
    allows) to their logprobs, and text_offset counts the token texts from `initial_text_offset`
    (the length of the text streamed before). A record None (the first prompt token of an echo,
    which nothing predicts) gives null token_logprobs and top_logprobs, as OpenAI and vLLM do."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = initial_text_offset
    for token, record in zip(token_ids, records):
        text = token_text(token)
        tokens.append(text)
        if record is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(_logprob(record.logprob))
            top_logprobs.append({token_text(t): _logprob(v) for i, (t, v) in
                                 enumerate(_step_logprobs(token, record).items()) if i <= num_logprobs})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], records: Sequence[TokenLogprobs], top_logprobs: int,
                  token_text: Callable[[int], str]) -> dict[str, Any]:
    """A chat choice's `logprobs` ({content: [{token, logprob, bytes, top_logprobs}]}), as vLLM's
    serving_chat builds it: `bytes` the token text's UTF-8 bytes, top_logprobs the first
    `top_logprobs` entries of the step's logprobs (the sampled token first, then by rank)."""
    content = []
    for token, record in zip(token_ids, records):
        text = token_text(token)
        top = []
        for t, v in list(_step_logprobs(token, record).items())[:top_logprobs]:
            top_text = token_text(t)
            top.append({"token": top_text, "logprob": _logprob(v), "bytes": _utf8(top_text)})
        content.append({"token": text, "logprob": _logprob(record.logprob), "bytes": _utf8(text),
                        "top_logprobs": top})
    return {"content": content}


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class ResponseShaper:
    """Builds one request's OpenAI response or stream chunks; `chat` picks the chat.completion shapes."""

    def __init__(self, *, chat: bool, request_id: str, model: str, created: int, include_usage: bool = False,
                 continuous_usage: bool = False, logprobs: int | None = None,
                 token_text: Callable[[int], str] | None = None, index: int = 0, echo_text: str = "",
                 prompt_ids: Sequence[int] = ()):
        """`index`: the choice this shaper writes (n > 1: one shaper per choice); `echo_text`:
        what the choice's text starts with (echo); `prompt_ids`: the prompt, whose tokens lead
        the logprobs when a delta brings prompt logprobs (completions' echo with logprobs)."""
        self.chat = chat
        self.index = index
        self.echo_text = echo_text
        self._echoed = False
        self.prompt_ids = list(prompt_ids)
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
        # None: the request asked for no logprobs (`"logprobs": null`); N: top N per token, each
        # token's text `token_text(id)` (the tokenizer's decode of that one id, as vLLM's).
        self.num_logprobs = logprobs
        self.token_text = token_text or str
        # Streaming: tokens whose chunk is not sent yet (no text yet), with their logprobs, and
        # the length of the text streamed so far (completions' text_offset).
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[TokenLogprobs | None] = []
        self._text_len = 0

    def response(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                 token_ids: Sequence[int] = (), logprobs: Sequence[TokenLogprobs] = (),
                 prompt_logprobs: Sequence[TokenLogprobs | None] | None = None) -> dict[str, Any]:
        """The non-streaming response body of one choice; `logprobs` one per output token, when
        asked for (`prompt_logprobs` one per prompt token, for an echo)."""
        return self.body([self.choice(text, finish_reason, token_ids, logprobs, prompt_logprobs)], prompt_tokens,
                         completion_tokens)

    def choice(self, text: str, finish_reason: str, token_ids: Sequence[int] = (),
               logprobs: Sequence[TokenLogprobs] = (),
               prompt_logprobs: Sequence[TokenLogprobs | None] | None = None) -> dict[str, Any]:
        """This shaper's choice of a non-streaming response (echo included)."""
        if prompt_logprobs is not None:
            token_ids, logprobs = [*self.prompt_ids, *token_ids], [*prompt_logprobs, *logprobs]
        shaped = self._logprobs(token_ids, logprobs, 0)
        text = self.echo_text + text
        if self.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": text}, "logprobs": shaped,
                    "finish_reason": finish_reason}
        return {"index": self.index, "text": text, "logprobs": shaped, "finish_reason": finish_reason}

    def body(self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """A non-streaming response of these choices; usage counts the prompt once and every
        choice's completion tokens (`completion_tokens`, summed by the caller), as OpenAI does."""
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return body

    def chunks(self, text: str, finish_reason: str | None, prompt_tokens: int = 0, completion_tokens: int = 0,
               new_tokens: int = 0, token_ids: Sequence[int] = (),
               logprobs: Sequence[TokenLogprobs] = (),
               prompt_logprobs: Sequence[TokenLogprobs | None] | None = None) -> list[dict[str, Any]]:
        """Stream chunks for one delta (chat opens with a role-only chunk, as OpenAI does); with
        continuous usage each carries the usage after this delta's `new_tokens`. The chunk with
        this delta's text carries the logprobs of its tokens (and of earlier tokens that had no
        text yet, hence no chunk). The first content chunk starts with the echo (and its
        tokens' `prompt_logprobs`, as vLLM streams an echo)."""
        if not self._echoed:
            self._echoed = True
            text = self.echo_text + text
            if prompt_logprobs is not None and self.num_logprobs is not None:
                self._pending_ids += self.prompt_ids
                self._pending_logprobs += prompt_logprobs
        if self.num_logprobs is not None:
            self._pending_ids += token_ids
            self._pending_logprobs += logprobs
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
                out.append(self._chunk({"content": text}, None, self._take_logprobs()))
                out.append(self._chunk({}, finish_reason))
            elif text or finish_reason or counted_only:
                out.append(self._chunk({"content": text} if text or counted_only else {}, finish_reason,
                                       self._take_logprobs()))
        elif text or finish_reason or counted_only:
            out.append(self._chunk(text, finish_reason, self._take_logprobs()))
        self._text_len += len(text)
        return out

    def _take_logprobs(self) -> dict[str, Any] | None:
        """The pending tokens' logprobs for the chunk being sent (None when not asked for)."""
        shaped = self._logprobs(self._pending_ids, self._pending_logprobs, self._text_len)
        self._pending_ids, self._pending_logprobs = [], []
        return shaped

    def _logprobs(self, token_ids: Sequence[int], records: Sequence[TokenLogprobs | None],
                  text_offset: int) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(token_ids, records, self.num_logprobs, self.token_text)
        return completion_logprobs(token_ids, records, self.num_logprobs, self.token_text, text_offset)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: usage and no choices."""
        body = self._envelope(self._chunk_object(), [])
        body["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return body

    def _chunk(self, content: Any, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": self.index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": self.index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        body = self._envelope(self._chunk_object(), [choice])
        if self.include_usage:
            # OpenAI sends null usage on every chunk but the last; vLLM's continuous usage, the sum so far.
            body["usage"] = self._usage
        return body

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
