"""Turn OpenAI request bodies and GenerateRequest protos into one validated GenerationRequest.

Pure: no I/O. Every error is `InvalidArgument(message, param=field)` (or `NotFound` for an
unknown model) whose message names the field and the limit it broke.

The output-length hint (what placement plans a request's decode with, DynaServe §3.1):
`predicted_output_len` in a GenerateRequest, and over HTTP the `predicted_output_len` body
field or the `x-predicted-output-len` header. The body wins when both are given: it is
this request's own statement, while a header is often set once per client (the OpenAI
SDK's `default_headers`) or by a proxy; both are checked either way. A hint is an integer
in [0, 2^32 - 1] (the wire type's range; anything else is refused naming the field); one
above max_tokens is clamped to max_tokens, which is all the request can generate.
"""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from splitserve.core.diffusion import DiffusionParamError, diffusion_params
from splitserve.core.sampling import MAX_LOGPROBS  # vLLM's default max_logprobs (20)
from splitserve.core.structured import StructuredOutput
from gateway import structured_output as structured
from splitserve.errors import InvalidArgument, NotFound
from splitserve.request_rules import UINT32_MAX, check_id_length  # the rules every service applies
from splitserve.proto import coordinator_pb2, gateway_pb2, types_pb2
from splitserve.wire import structured_output_from_proto, structured_output_to_proto
from splitserve.core.records import DIFFUSION  # the engine family of diffusion models (LLaDA)

MAX_TEMPERATURE = 2.0  # OpenAI's upper bound
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: the detokenizer matches each against every step's text
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SEED_LIMIT = 2**63
PREDICTED_OUTPUT_LEN_HEADER = "x-predicted-output-len"
DIFFUSION_FIELDS = ("steps", "block_length", "remasking", "retention_ratio", "cfg_scale")
# vLLM's penalties and filters, with the values that leave sampling as it is (sent only when they differ).
PENALTY_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
                    "min_tokens": 0}


class PromptEncoder(Protocol):
    """What validation needs from the tokenizer (gateway.tokenization.Tokenization has it)."""

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]: ...
    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]: ...


class ContextLengthExceeded(InvalidArgument):
    """A prompt (with its max_tokens) longer than the model's context: OpenAI's 400 with code
    `context_length_exceeded`, which clients (LangChain, LiteLLM, ...) test to trim history."""

    openai_code = "context_length_exceeded"


@dataclass(frozen=True)
class Limits:
    """The served model's name and length limits, and the max_tokens policy.

    `default_max_tokens` is what /v1/completions and gRPC Generate use when a request sets no
    max_tokens (vLLM's legacy-completions default is 16), and what a diffusion model generates by
    default; chat completions default to the rest of the context instead (see `_common`)."""

    served_model: str
    max_model_len: int
    default_max_tokens: int = 16
    max_tokens_limit: int = 4096
    max_n: int = 16  # largest n (choices per request): each choice is a request of its own
    engine_family: str = ""  # "diffusion" for a diffusion model; "": autoregressive
    mask_token_id: int | None = None  # a diffusion model's mask token, which no prompt may hold


@dataclass
class GenerationRequest:
    """One validated generation, whichever API it came from."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float | None = None  # None: engine default (1.0); 0 is greedy
    top_p: float | None = None
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    # vLLM's stream_options.continuous_usage_stats: cumulative usage on every chunk, so a client
    # counts exactly the tokens each chunk brings (also those whose text is not complete yet).
    continuous_usage: bool = False
    echo_token_ids: bool = False
    session_id: str = ""
    priority: int = 0
    slo_ttft_ms: int = 0
    slo_itl_ms: int = 0
    predicted_output_len: int | None = None  # the client's hint, <= max_tokens; None: no hint
    engine_family: str = ""  # "diffusion": placed whole on a diffusion worker
    # A diffusion model's denoising knobs (dLLM-Serve); None / "": the engine's defaults.
    steps: int | None = None
    block_length: int | None = None
    remasking: str = ""
    retention_ratio: float | None = None
    cfg_scale: float | None = None
    # vLLM's penalties and filters (workers.engine.sampler); the defaults change nothing.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    # None: no logprobs; N in [0, MAX_LOGPROBS]: each output token's logprob and the top N's
    # (completions' `logprobs`, chat's `top_logprobs` with `logprobs: true`).
    logprobs: int | None = None
    # Body fields neither OpenAI's, vLLM's nor ours: ignored, as vLLM does, and logged by the API.
    ignored_fields: tuple[str, ...] = ()
    # What the output must match (response_format, structured_outputs, guided_*); None: free output.
    structured_output: StructuredOutput | None = None
    # OpenAI's n: choices generated for the prompt, each a request of its own (`choice(i)`).
    n: int = 1
    # Echo: the response text starts with `echo_text` (completions: the prompt; chat: vLLM's last
    # message); None with echo set: the prompt ids decoded (a prompt given as token ids).
    echo: bool = False
    echo_text: str | None = None
    # None: no prompt logprobs; N: each prompt token's logprob and the top N's (completions'
    # echo with logprobs, vLLM's prompt_logprobs); the first prompt token has none.
    prompt_logprobs: int | None = None

    def choice(self, index: int) -> GenerationRequest:
        """The request generating choice `index` of n: its own request id (n > 1) and, for a
        seeded request, the seed + index (mod 2^63) as vLLM's parallel sampling gives its child
        requests, so each choice differs and a seeded request is reproducible; choice 0 of n is
        the request with n = 1. An unseeded choice gets its seed from its own id (coordinator)."""
        if self.n == 1:
            return self
        seed = None if self.seed is None else (self.seed + index) % SEED_LIMIT
        return dataclasses.replace(self, request_id=f"{self.request_id}-{index}", seed=seed, n=1)

    def sampling_params(self) -> types_pb2.SamplingParams:
        """The SamplingParams proto; unset optionals stay unset so engine defaults apply."""
        # max_tokens 0 (echo): the engine generates one token, which the gateway drops.
        params = types_pb2.SamplingParams(max_tokens=max(self.max_tokens, 1), top_k=self.top_k, stop=self.stop,
                                          stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.seed is not None:
            params.seed = self.seed
        for name in DIFFUSION_FIELDS:
            value = getattr(self, name)
            if value is not None and value != "":
                setattr(params, name, value)
        for name, default in PENALTY_DEFAULTS.items():
            if getattr(self, name) != default:
                setattr(params, name, getattr(self, name))
        if self.logprobs is not None:
            params.num_logprobs = self.logprobs
        if self.prompt_logprobs is not None:
            params.num_prompt_logprobs = self.prompt_logprobs
        if self.structured_output is not None:
            params.structured_output.CopyFrom(structured_output_to_proto(self.structured_output))
        return params

    def submit_request(self) -> coordinator_pb2.SubmitRequest:
        """The Coordinator.Submit message for this request (the hint only when given: unset is "no hint")."""
        submit = coordinator_pb2.SubmitRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, sampling=self.sampling_params(),
            slo=types_pb2.Slo(ttft_ms=self.slo_ttft_ms, itl_ms=self.slo_itl_ms), session_id=self.session_id,
            priority=self.priority, model=self.model, engine_family=self.engine_family)
        if self.predicted_output_len is not None:
            submit.predicted_output_len = self.predicted_output_len
        return submit


# --- OpenAI bodies: pydantic checks JSON types (strict: no "16" for 16, no true for 1); the
# polymorphic fields (prompt, stop, messages) are typed Any and checked below, which gives
# clearer messages than pydantic's union errors.

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM extension: usage on every chunk


class _OpenAIBody(BaseModel):
    # Unknown fields are ignored and logged (as vLLM does); known ones we cannot honour are
    # refused (NOT_IMPLEMENTED below).
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 disables like 0
    n: int | None = None
    seed: int | None = None
    stop: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    echo: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    min_tokens: int | None = None  # vLLM extension
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extensions
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    add_special_tokens: bool | None = None  # None: completions add them (BOS), chat as its template says
    # dLLM-Serve extensions: a diffusion model's denoising knobs
    steps: int | None = None
    block_length: int | None = None
    remasking: str | None = None
    retention_ratio: float | None = None
    cfg_scale: float | None = None
    # splitserve extensions
    session_id: str | None = None
    priority: int | None = None
    slo_ttft_ms: int | None = None
    slo_itl_ms: int | None = None
    predicted_output_len: int | None = None  # the output-length hint (also a header)


class CompletionBody(_OpenAIBody):
    """POST /v1/completions."""

    prompt: Any
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionBody(_OpenAIBody):
    """POST /v1/chat/completions."""

    messages: Any
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    # vLLM extensions: how the chat template renders the conversation
    add_generation_prompt: bool | None = None  # default true: end with the assistant's turn opener
    continue_final_message: bool | None = None  # leave the last message open for the model to continue
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} for Qwen3


# vLLM's request fields (and a few of OpenAI's) that this server does not implement, each with
# the values that ask for nothing (vLLM's defaults, and null). Any other value is refused with a
# 400 naming the field: ignoring it would answer something other than what the client asked
# for (a penalty not applied, a grammar not followed). Fields no API knows are ignored and
# logged, as vLLM does (GenerationRequest.ignored_fields); HARMLESS_FIELDS are ignored quietly.
NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # sampling
    "use_beam_search": ((None, False), "beam search"),
    "length_penalty": ((None, 1.0), "length_penalty other than 1 (beam search)"),
    "allowed_token_ids": ((None, []), "allowed_token_ids"),
    "bad_words": ((None, []), "bad_words"),
    "logits_processors": ((None, []), "logits_processors"),
    "watermarking": ((None, False), "watermarking"),
    "repetition_detection": ((None,), "repetition_detection"),
    "thinking_token_budget": ((None, -1), "thinking_token_budget"),
    # what the output holds
    "include_stop_str_in_output": ((None, False), "include_stop_str_in_output=true"),
    "skip_special_tokens": ((None, True), "skip_special_tokens=false (special tokens are always skipped)"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens=false"),
    "prompt_logprobs": ((None,), "prompt_logprobs"),
    "logprob_token_ids": ((None,), "logprob_token_ids"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids"),
    "return_token_ids": ((None, False), "return_token_ids"),
    # the prompt
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens (prompts are never truncated)"),
    "truncation_side": ((None,), "truncation_side (prompts are never truncated)"),
    "prompt_embeds": ((None,), "prompt_embeds"),
    # structured output: structured_outputs and guided_* are read by gateway.structured_output;
    # these two ask for what xgrammar does not do
    "structural_tag": ((None,), "structural_tag (structured output of tagged regions)"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern (xgrammar's JSON whitespace is fixed)"),
    # serving
    "request_id": ((None,), "a client-chosen request_id (the gateway assigns one, sent as X-Request-Id)"),
    "cache_salt": ((None,), "cache_salt (the prefix cache is not salted per request)"),
    "kv_transfer_params": ((None,), "kv_transfer_params (splitserve moves KV between its own workers)"),
    "ec_transfer_params": ((None,), "ec_transfer_params"),
    "vllm_xargs": ((None,), "vllm_xargs"),
}
NOT_IMPLEMENTED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    "documents": ((None,), "documents (RAG chat templates)"),
    "chat_template": ((None,), "a chat_template in the request (the model's own template is used)"),
    "mm_processor_kwargs": ((None,), "mm_processor_kwargs (multimodal input)"),
    "media_io_kwargs": ((None,), "media_io_kwargs (multimodal input)"),
    "reasoning_effort": ((None,), "reasoning_effort"),
    "include_reasoning": ((None, True), "include_reasoning=false (no reasoning parser)"),
    "tool_choice": ((None, "none", "auto"), "tool_choice other than none or auto (tool calling)"),
    # OpenAI's, not vLLM's (vLLM would ignore them): each changes the answer, so refused too.
    "functions": ((None, []), "functions (tool calling)"),
    "function_call": ((None, "none", "auto"), "function_call (tool calling)"),
    "audio": ((None,), "audio output"),
    "modalities": ((None, ["text"]), "modalities other than [\"text\"]"),
    "web_search_options": ((None,), "web search"),
}
# Ignored without a warning: they change nothing in what is generated or returned.
HARMLESS_FIELDS = frozenset({
    "store", "metadata", "service_tier",  # OpenAI: storage and billing tier
    "prediction",  # OpenAI's predicted outputs: latency only, the answer is the same
    "parallel_tool_calls",  # meaningless without tools (which are refused)
    "stream_interval",  # vLLM: tokens per streamed chunk; every token still arrives
})
MAX_IGNORED_FIELDS_LOGGED = 16
MAX_IGNORED_FIELD_CHARS = 64
# Keys chat_template_kwargs may not set: apply_chat_template's own parameters, which the
# request's fields (or the server) decide.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def invalid_argument_from_pydantic(errors: Sequence[dict[str, Any]]) -> InvalidArgument:
    """One InvalidArgument naming the first bad field of a pydantic/FastAPI validation error."""
    if not errors:
        return InvalidArgument("request body is invalid", param="body")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]  # FastAPI prefixes body fields with "body"
    if err.get("type") == "json_invalid":
        return InvalidArgument(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}",
                               param="body")
    if not loc:
        return InvalidArgument(f"request body: {err.get('msg', 'invalid')} (expected a JSON object)", param="body")
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
    if err.get("type") == "missing":
        return InvalidArgument(f"{path} is required", param=str(loc[0]))
    return InvalidArgument(f"{path}: {err.get('msg', 'invalid value')}", param=str(loc[0]))


def check_unicode(body: dict[str, Any]) -> None:
    """Refuse lone surrogates (what JSON's "\\ud800" escape decodes to) anywhere in a body: no
    tokenizer, protobuf or JSON encoder takes them. The error names the top-level field."""
    for key, value in body.items():
        if not _encodable(key):
            raise InvalidArgument("request body: a field name is not valid Unicode (lone surrogate escape)",
                                  param="body")
        stack = [value]
        while stack:  # iterative: a deeply nested value must not exhaust the stack
            item = stack.pop()
            if isinstance(item, str):
                bad = not _encodable(item)
            elif isinstance(item, dict):
                bad = not all(_encodable(k) for k in item)
                stack.extend(item.values())
            else:
                bad = False
                if isinstance(item, list):
                    stack.extend(item)
            if bad:
                raise InvalidArgument(f"{key}: holds a string that is not valid Unicode (a lone surrogate such "
                                      "as \\ud800)", param=key)


def _encodable(text: Any) -> bool:
    try:
        str(text).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse(model_cls: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {type(body).__name__}", param="body")
    check_unicode(body)
    try:
        return model_cls.model_validate(body)
    except ValidationError as err:
        raise invalid_argument_from_pydantic(err.errors()) from None


def completion_request(body: Any, encoder: PromptEncoder, limits: Limits, request_id: str,
                       predicted_output_len_header: str | None = None) -> GenerationRequest:
    """Validate a /v1/completions body (and the x-predicted-output-len header's value, None when absent)."""
    b: CompletionBody = _parse(CompletionBody, body)
    if b.suffix:
        _unsupported("suffix", "suffix")
    if b.best_of not in (None, 1, b.n):
        # best_of = n returns every candidate (vLLM's default); more candidates than choices
        # would need ranking them by their cumulative logprob, which is not implemented.
        raise InvalidArgument(f"best_of must equal n (got best_of {b.best_of}, n {b.n}): ranking more candidates "
                              "than choices is not supported", param="best_of")
    logprobs = _top_logprobs(b.logprobs, "logprobs")
    _refuse_not_implemented(b, NOT_IMPLEMENTED)
    prompt_ids = _completion_prompt(b.prompt, encoder, b.add_special_tokens)
    # Legacy completions default to limits.default_max_tokens (16), as vLLM's CompletionRequest
    # and OpenAI's legacy endpoint do: clients of this API send max_tokens when they want more.
    # Echo allows max_tokens 0 (vLLM does): the prompt, scored, is the whole answer (how
    # lm-eval-harness computes loglikelihoods: echo, logprobs, max_tokens 0).
    echo_only = bool(b.echo) and b.max_tokens == 0
    req = _common(b, prompt_ids, None if echo_only else b.max_tokens, "max_tokens", encoder, limits, request_id,
                  predicted_output_len_header, default_max_tokens=1 if echo_only else limits.default_max_tokens,
                  prompt_param="prompt", logprobs=logprobs)
    if not b.echo:
        return req
    if req.engine_family == DIFFUSION:
        _unsupported("echo", "echo on a diffusion model")
    if logprobs is not None and req.session_id:
        _unsupported("echo", "echo with logprobs in a session (the history's KV is reused, so its prompt "
                              "logprobs are not computed)")
    return dataclasses.replace(req, echo=True, echo_text=_echo_prompt_text(b.prompt),
                               prompt_logprobs=logprobs, max_tokens=0 if echo_only else req.max_tokens)


def _echo_prompt_text(prompt: Any) -> str | None:
    """The text echoed for a completions prompt: the string as sent (vLLM's prompt text);
    None for token ids (the API decodes them)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def chat_request(body: Any, encoder: PromptEncoder, limits: Limits, request_id: str,
                 predicted_output_len_header: str | None = None) -> GenerationRequest:
    """Validate a /v1/chat/completions body (and the x-predicted-output-len header's value, None when absent)."""
    b: ChatCompletionBody = _parse(ChatCompletionBody, body)
    logprobs = _chat_logprobs(b.logprobs, b.top_logprobs)
    if b.tools:
        _unsupported("tools", "tool calling")
    _refuse_not_implemented(b, {**NOT_IMPLEMENTED, **NOT_IMPLEMENTED_CHAT})
    messages = _chat_messages(b.messages)
    prompt_ids = _encode_chat(encoder, messages, b.add_generation_prompt, b.continue_final_message,
                              b.add_special_tokens, b.chat_template_kwargs)
    # max_completion_tokens is OpenAI's newer name for max_tokens; it wins when both are set.
    if b.max_completion_tokens is not None:
        max_tokens, param = b.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = b.max_tokens, "max_tokens"
    # Chat defaults to the rest of the context (max_model_len - prompt tokens), as OpenAI and
    # vLLM's ChatCompletionRequest do (a chat answer ends at its end-of-turn token, not at 16),
    # within the server's --max-tokens-limit. A diffusion model generates exactly max_tokens
    # tokens (a fixed canvas, not a cap), so it keeps the configured default.
    default = limits.default_max_tokens if limits.engine_family == DIFFUSION else None
    req = _common(b, prompt_ids, max_tokens, param, encoder, limits, request_id, predicted_output_len_header,
                  default_max_tokens=default, prompt_param="messages", logprobs=logprobs)
    if not b.echo:
        return req
    return dataclasses.replace(req, echo=True, echo_text=_chat_echo_text(messages, b.add_generation_prompt))


def _chat_echo_text(messages: list[dict[str, str]], add_generation_prompt: bool | None) -> str:
    """vLLM's chat echo: the last message's content when it is in the role the reply takes
    (the assistant's, or with add_generation_prompt false the last message's own), else ""."""
    role = messages[-1]["role"] if add_generation_prompt is False else "assistant"
    return messages[-1]["content"] if messages[-1]["role"] == role else ""


def _encode_chat(encoder: PromptEncoder, messages: list[dict[str, str]], add_generation_prompt: bool | None,
                 continue_final_message: bool | None, add_special_tokens: bool | None,
                 template_kwargs: dict[str, Any] | None) -> list[int]:
    """The conversation's prompt ids; only options that differ from the defaults are passed on."""
    options: dict[str, Any] = {}
    if continue_final_message:
        if add_generation_prompt is not False:
            # vLLM refuses the pair too: the model cannot both continue the last message and
            # start a new turn (add_generation_prompt defaults to true, so it must be set false).
            raise InvalidArgument("continue_final_message: set add_generation_prompt to false with it (a new "
                                  "assistant turn cannot follow an open final message)", param="continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise InvalidArgument("continue_final_message: the last message must be the assistant's (the one the "
                                  f"model continues), got role {messages[-1]['role']!r}", param="continue_final_message")
        options["continue_final_message"] = True
    if add_generation_prompt is False:
        options["add_generation_prompt"] = False
    if add_special_tokens is not None:
        options["add_special_tokens"] = add_special_tokens
    if template_kwargs:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs))
        if reserved:
            raise InvalidArgument(f"chat_template_kwargs may not set {reserved}: the request's own fields decide "
                                  "them", param="chat_template_kwargs")
        options["template_kwargs"] = template_kwargs
    return encoder.encode_chat(messages, **options)


def tokenize_request(body: Any, encoder: PromptEncoder, limits: Limits) -> tuple[list[int], bool]:
    """(token ids, whether the token strings were asked for) of a POST /tokenize body (vLLM's
    shapes): a `prompt` string, tokenized as /v1/completions would, or `messages`, rendered as
    /v1/chat/completions would (the same template options). No length check: it answers how long
    a prompt is, whatever its length."""
    b: TokenizeBody = _parse(TokenizeBody, body)
    _check_model(b.model, limits)
    if (b.prompt is None) == (b.messages is None):
        raise InvalidArgument("tokenize takes either prompt (a string) or messages (a chat), "
                              f"{'not both' if b.prompt is not None else 'got neither'}", param="prompt")
    _refuse_not_implemented(b, {name: NOT_IMPLEMENTED_CHAT[name] for name in ("documents", "chat_template",
                                                                               "mm_processor_kwargs")})
    if b.tools:
        _unsupported("tools", "tool calling")
    if b.prompt is not None:
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if getattr(b, name) is not None:
                raise InvalidArgument(f"{name} applies to messages, not to a prompt", param=name)
        ids = encoder.encode_prompt(b.prompt, True if b.add_special_tokens is None else b.add_special_tokens)
    else:
        ids = _encode_chat(encoder, _chat_messages(b.messages), b.add_generation_prompt, b.continue_final_message,
                           b.add_special_tokens, b.chat_template_kwargs)
    return ids, bool(b.return_token_strs)


def detokenize_request(body: Any, encoder: PromptEncoder, limits: Limits) -> list[int]:
    """The token ids of a POST /detokenize body (vLLM's shape: `tokens`), each checked against the vocab."""
    b: DetokenizeBody = _parse(DetokenizeBody, body)
    _check_model(b.model, limits)
    return encoder.check_token_ids(b.tokens, "tokens")


class TokenizeBody(BaseModel):
    """POST /tokenize: vLLM's TokenizeCompletionRequest or TokenizeChatRequest."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None
    tools: list[Any] | None = None


class DetokenizeBody(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int]


def generate_request(msg: gateway_pb2.GenerateRequest, encoder: PromptEncoder, limits: Limits,
                     request_id: str) -> GenerationRequest:
    """Validate a gRPC Gateway.Generate request."""
    _check_model(msg.model, limits)
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("prompt is required: set text or token_ids", param="prompt")
    if kind == "text":
        if not msg.text:
            raise InvalidArgument("prompt is empty: text must be non-empty", param="prompt")
        prompt_ids = encoder.encode_prompt(msg.text)
    else:
        if not msg.token_ids.ids:
            raise InvalidArgument("prompt is empty: token_ids.ids must be non-empty", param="prompt")
        prompt_ids = encoder.check_token_ids(msg.token_ids.ids, "prompt")
    s = msg.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else None
    seed = s.seed if s.HasField("seed") else None
    if seed is not None and seed >= SEED_LIMIT:
        raise InvalidArgument(f"seed must be in [0, 2^63), got {seed}", param="seed")
    stop = _stop_strings(list(s.stop))
    max_tokens = _max_tokens(max_tokens, "max_tokens", len(prompt_ids), limits, limits.default_max_tokens, "prompt")
    # uint32 on the wire: a negative or oversized hint cannot be encoded, so only the clamp is left.
    hint = msg.predicted_output_len if msg.HasField("predicted_output_len") else None
    req = GenerationRequest(
        request_id=request_id, model=limits.served_model, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
        temperature=_temperature(s.temperature if s.HasField("temperature") else None),
        top_p=_top_p(s.top_p if s.HasField("top_p") else None), top_k=s.top_k, seed=seed, stop=stop,
        stop_token_ids=encoder.check_token_ids(s.stop_token_ids, "stop_token_ids"), ignore_eos=s.ignore_eos,
        stream=True, include_usage=True, echo_token_ids=msg.echo_token_ids,
        logprobs=_top_logprobs(s.num_logprobs, "sampling.num_logprobs") if s.HasField("num_logprobs") else None,
        session_id=check_id_length(msg.session_id, "session_id"), priority=msg.priority,
        slo_ttft_ms=msg.slo.ttft_ms, slo_itl_ms=msg.slo.itl_ms,
        predicted_output_len=None if hint is None else min(hint, max_tokens),
        structured_output=_grpc_structured_output(s),
        **_penalties(*(getattr(s, name) if s.HasField(name) else None for name in _FLOAT_PENALTIES),
                     s.min_tokens, max_tokens))
    return _with_diffusion(req, limits, steps=s.steps if s.HasField("steps") else None,
                           block_length=s.block_length if s.HasField("block_length") else None,
                           remasking=s.remasking or None,
                           retention_ratio=s.retention_ratio if s.HasField("retention_ratio") else None,
                           cfg_scale=s.cfg_scale if s.HasField("cfg_scale") else None)


def _grpc_structured_output(s: types_pb2.SamplingParams) -> StructuredOutput | None:
    """sampling.structured_output of a gRPC Generate, shape-checked as the HTTP fields are."""
    if not s.HasField("structured_output"):
        return None
    param = "sampling.structured_output"
    constraint = dataclasses.replace(structured_output_from_proto(s.structured_output), param=param)
    if constraint.kind == "json":
        constraint = dataclasses.replace(constraint, spec=structured.schema_text(constraint.spec, f"{param}.spec",
                                                                                 param))
    return structured.checked(constraint)


# --- shared checks

def _common(b: _OpenAIBody, prompt_ids: list[int], max_tokens: int | None, max_tokens_param: str,
            encoder: PromptEncoder, limits: Limits, request_id: str,
            predicted_output_len_header: str | None = None, *, default_max_tokens: int | None,
            prompt_param: str, logprobs: int | None = None) -> GenerationRequest:
    """The checks both OpenAI endpoints share; `default_max_tokens` None: the rest of the context."""
    _check_model(b.model, limits)
    n = 1 if b.n is None else b.n
    if not 1 <= n <= limits.max_n:
        raise InvalidArgument(f"n must be in [1, {limits.max_n}] (max_n), got {n}", param="n")
    if n > 1 and b.session_id:
        _unsupported("n", "n > 1 in a session (a session holds one history)")
    if b.logit_bias:
        _unsupported("logit_bias", "logit_bias")
    # response_format is a declared field; structured_outputs and guided_* arrive as extras.
    constraint = structured.structured_output({"response_format": b.response_format, **(b.model_extra or {})})
    if b.stream_options is not None and not b.stream:
        raise InvalidArgument("stream_options is only allowed when stream is true", param="stream_options")
    top_k = b.top_k if b.top_k is not None else 0
    if not -1 <= top_k <= UINT32_MAX:
        raise InvalidArgument(f"top_k must be >= 0 and <= {UINT32_MAX} (0 or -1 disables it), got {top_k}",
                              param="top_k")
    if b.seed is not None and not 0 <= b.seed < SEED_LIMIT:
        raise InvalidArgument(f"seed must be in [0, 2^63), got {b.seed}", param="seed")
    for name in ("slo_ttft_ms", "slo_itl_ms"):
        value = getattr(b, name)
        if value is not None and not 0 <= value <= UINT32_MAX:
            raise InvalidArgument(f"{name} must be in [0, {UINT32_MAX}], got {value}", param=name)
    if b.priority is not None and not INT32_MIN <= b.priority <= INT32_MAX:
        raise InvalidArgument(f"priority must be a 32-bit integer, got {b.priority}", param="priority")
    hint = _predicted_output_len(b.predicted_output_len, predicted_output_len_header)
    max_tokens = _max_tokens(max_tokens, max_tokens_param, len(prompt_ids), limits, default_max_tokens,
                             prompt_param)
    req = GenerationRequest(
        request_id=request_id, model=limits.served_model, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
        temperature=_temperature(b.temperature), top_p=_top_p(b.top_p), top_k=max(top_k, 0), seed=b.seed,
        stop=_stop_strings(b.stop), stop_token_ids=encoder.check_token_ids(b.stop_token_ids or [], "stop_token_ids"),
        ignore_eos=bool(b.ignore_eos), stream=bool(b.stream),
        include_usage=bool(b.stream_options and b.stream_options.include_usage),
        continuous_usage=bool(b.stream_options and b.stream_options.include_usage
                              and b.stream_options.continuous_usage_stats),
        session_id=check_id_length(b.session_id or "", "session_id"), priority=b.priority or 0,
        slo_ttft_ms=b.slo_ttft_ms or 0, slo_itl_ms=b.slo_itl_ms or 0,
        predicted_output_len=None if hint is None else min(hint, max_tokens), ignored_fields=_ignored_fields(b),
        logprobs=logprobs, n=n, structured_output=constraint,
        **_penalties(b.presence_penalty, b.frequency_penalty, b.repetition_penalty, b.min_p, b.min_tokens, max_tokens))
    return _with_diffusion(req, limits, steps=b.steps, block_length=b.block_length, remasking=b.remasking,
                           retention_ratio=b.retention_ratio, cfg_scale=b.cfg_scale)


def _with_diffusion(req: GenerationRequest, limits: Limits, **knobs: Any) -> GenerationRequest:
    """The request with a diffusion model's knobs checked (dLLM-Serve); an autoregressive model
    refuses them, a diffusion model refuses what it cannot honour (top-k/top-p, sessions)."""
    given = {name: value for name, value in knobs.items() if value is not None}
    if limits.engine_family != DIFFUSION:
        if given:
            name = next(iter(given))
            raise InvalidArgument(f"{name}: only diffusion models take it; '{limits.served_model}' is "
                                  "autoregressive", param=name)
        return req
    if req.top_k:
        _unsupported("top_k", "top_k on a diffusion model (use temperature)")
    if req.top_p is not None and req.top_p != 1.0:
        _unsupported("top_p", "top_p below 1 on a diffusion model (use temperature)")
    if req.session_id:
        _unsupported("session_id", "a session on a diffusion model (its KV is not kept between rounds)")
    for name, default in PENALTY_DEFAULTS.items():
        if getattr(req, name) != default:
            _unsupported(name, f"{name} on a diffusion model (it samples every position of a block at once)")
    if req.logprobs is not None:
        _unsupported("logprobs", "logprobs on a diffusion model (its tokens are unmasked, not sampled one by one)")
    if req.structured_output is not None:
        _unsupported(req.structured_output.param, "structured output on a diffusion model (it unmasks every "
                     "position of a block at once, not left to right as a grammar is matched)")
    if limits.mask_token_id is not None and limits.mask_token_id in req.prompt_token_ids:
        raise InvalidArgument(f"prompt holds the mask token (id {limits.mask_token_id}), which only the model "
                              "may place", param="prompt")
    retention = given.get("retention_ratio", 1.0)
    try:
        diffusion_params(req.max_tokens, steps=given.get("steps"), block_length=given.get("block_length"),
                         temperature=req.temperature or 0.0, remasking=given.get("remasking", "low_confidence"),
                         retention_ratio=retention, cfg_scale=given.get("cfg_scale", 0.0))
    except DiffusionParamError as err:
        param = "max_tokens" if err.param == "gen_length" else err.param
        raise InvalidArgument(str(err), param=param) from None
    return dataclasses.replace(req, engine_family=DIFFUSION, **given)


def _unsupported(param: str, what: str) -> None:
    raise InvalidArgument(f"{param}: {what} is not supported by this server", param=param)


def _check_model(model: str | None, limits: Limits) -> None:
    if model and model != limits.served_model:
        raise NotFound(f"model '{model}' does not exist; this server serves '{limits.served_model}'", param="model")


def _max_tokens(value: int | None, param: str, prompt_len: int, limits: Limits, default: int | None,
                prompt_param: str) -> int:
    """The request's max_tokens: `value` checked, or `default` (None: the rest of the context)
    within --max-tokens-limit, shortened to fit a long prompt rather than refused.

    A prompt that leaves no room, or a max_tokens that does not fit beside it, is refused with
    OpenAI's `context_length_exceeded` and its message; `param` names what to shorten."""
    room = limits.max_model_len - prompt_len
    what = "messages" if prompt_param == "messages" else "prompt"
    context = f"This model's maximum context length is {limits.max_model_len} tokens (max_model_len). However, "
    if room < 1:
        if value is None or value < 1:
            message = (f"{context}your {what} resulted in {prompt_len} tokens, which leaves no room for the "
                       f"completion. Please reduce the length of the {what}.")
        else:
            message = (f"{context}you requested {prompt_len + value} tokens ({prompt_len} in the {what}, {value} in "
                       f"the completion). Please reduce the length of the {what} or completion.")
        raise ContextLengthExceeded(message, param=prompt_param)
    if value is None:
        return min(room if default is None else default, limits.max_tokens_limit, room)
    if value < 1:
        raise InvalidArgument(f"{param} must be >= 1, got {value}", param=param)
    if value > limits.max_tokens_limit:
        raise InvalidArgument(f"{param} must be <= {limits.max_tokens_limit}, got {value}", param=param)
    if value > room:
        raise ContextLengthExceeded(
            f"{context}you requested {prompt_len + value} tokens ({prompt_len} in the {what}, {value} in the "
            f"completion). Please reduce the length of the {what} or completion: {param} can be at most {room}.",
            param=param)
    return value


def _refuse_not_implemented(b: BaseModel, fields: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """400 naming the first field of `fields` sent with a value that asks for something."""
    for name, value in (b.model_extra or {}).items():
        if name in fields and not _asks_for_nothing(value, fields[name][0]):
            _unsupported(name, fields[name][1])


def _asks_for_nothing(value: Any, defaults: tuple[Any, ...]) -> bool:
    # A JSON true is not 1 and 0 is not false: the types must agree (1 and 1.0 do).
    return any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


def _ignored_fields(b: BaseModel) -> tuple[str, ...]:
    """The body's fields that no API here knows (bounded, for one log line)."""
    known = NOT_IMPLEMENTED.keys() | NOT_IMPLEMENTED_CHAT.keys() | HARMLESS_FIELDS | set(structured.FIELDS)
    names = sorted(name for name in (b.model_extra or {}) if name not in known)
    return tuple(name[:MAX_IGNORED_FIELD_CHARS] for name in names[:MAX_IGNORED_FIELDS_LOGGED])


def _predicted_output_len(body_value: int | None, header: str | None) -> int | None:
    """The hint from the body, else from the header; each checked when present (None: no hint)."""
    from_header = None if header is None else _hint_from_header(header)
    if body_value is None:
        return from_header
    if not 0 <= body_value <= UINT32_MAX:
        raise InvalidArgument(f"predicted_output_len must be an integer in [0, {UINT32_MAX}] (output tokens), "
                              f"got {body_value}", param="predicted_output_len")
    return body_value


def _hint_from_header(raw: str) -> int:
    name = PREDICTED_OUTPUT_LEN_HEADER
    text = raw.strip()
    shown = text if len(text) <= 32 else text[:32] + "..."
    # Digits only: no sign, exponent, fraction or thousands separator (int() would take "+5" and "1_0").
    if not (text.isascii() and text.isdigit()):
        detail = "negative" if text.startswith("-") and text[1:].isdigit() else "not an integer"
        raise InvalidArgument(f"{name} header must be an integer in [0, {UINT32_MAX}] (output tokens), got "
                              f"{shown!r} ({detail}; several values count as one malformed value)", param=name)
    value = int(text) if len(text) <= 20 else UINT32_MAX + 1  # int() of a huge digit string is slow
    if value > UINT32_MAX:
        raise InvalidArgument(f"{name} header must be an integer in [0, {UINT32_MAX}] (output tokens), got "
                              f"{shown!r}", param=name)
    return value


_FLOAT_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def _penalties(presence: float | None, frequency: float | None, repetition: float | None, min_p: float | None,
               min_tokens: int | None, max_tokens: int) -> dict[str, Any]:
    """vLLM's penalties and filters checked against vLLM's SamplingParams ranges (None: the default)."""
    values = dict(zip(PENALTY_DEFAULTS, (presence, frequency, repetition, min_p, min_tokens)))
    values = {name: PENALTY_DEFAULTS[name] if value is None else value for name, value in values.items()}
    for name in ("presence_penalty", "frequency_penalty"):
        if not (math.isfinite(values[name]) and -MAX_PENALTY <= values[name] <= MAX_PENALTY):
            raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {values[name]}",
                                  param=name)
    if not (math.isfinite(values["repetition_penalty"]) and values["repetition_penalty"] > 0):
        raise InvalidArgument(f"repetition_penalty must be > 0 (1 disables it), got {values['repetition_penalty']}",
                              param="repetition_penalty")
    if not (math.isfinite(values["min_p"]) and 0.0 <= values["min_p"] <= 1.0):
        raise InvalidArgument(f"min_p must be in [0, 1], got {values['min_p']}", param="min_p")
    if not 0 <= values["min_tokens"] <= max_tokens:
        raise InvalidArgument(f"min_tokens must be in [0, max_tokens] = [0, {max_tokens}], got "
                              f"{values['min_tokens']}", param="min_tokens")
    return values


def _top_logprobs(value: Any, param: str) -> int | None:
    """A number of top logprobs (completions' `logprobs`, chat's `top_logprobs`): an integer in
    [0, MAX_LOGPROBS] (vLLM's max_logprobs), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise InvalidArgument(f"{param} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", param=param)
    return value


def _chat_logprobs(logprobs: Any, top_logprobs: int | None) -> int | None:
    """Chat's pair: `logprobs` (a boolean) asks for them, `top_logprobs` (0..20) how many
    alternatives; vLLM's rule: top_logprobs above 0 needs logprobs true."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidArgument(f"logprobs must be a boolean on chat completions (top_logprobs says how many), "
                              f"got {logprobs!r}", param="logprobs")
    top = _top_logprobs(top_logprobs, "top_logprobs")
    if top and not logprobs:
        raise InvalidArgument("top_logprobs: when using top_logprobs, logprobs must be set to true",
                              param="top_logprobs")
    return (top or 0) if logprobs else None


def _temperature(value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and 0.0 <= value <= MAX_TEMPERATURE):
        raise InvalidArgument(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {value}", param="temperature")
    return value


def _top_p(value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise InvalidArgument(f"top_p must be in (0, 1], got {value}", param="top_p")
    return value


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise InvalidArgument("stop strings must be non-empty", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidArgument(f"stop strings may be at most {MAX_STOP_CHARS} characters long, got one of {longest}",
                              param="stop")
    return list(stops)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompt(prompt: Any, encoder: PromptEncoder, add_special_tokens: bool | None) -> list[int]:
    # OpenAI accepts a string, token ids, or a batch of either; batches are refused.
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise InvalidArgument(f"prompt: batches of prompts are not supported (got {len(prompt)}); "
                                  "send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgument("prompt is empty: it must be a non-empty string or token ids", param="prompt")
        return encoder.encode_prompt(prompt, True if add_special_tokens is None else add_special_tokens)
    if _is_token_list(prompt):
        if not prompt:
            raise InvalidArgument("prompt is empty: it must be a non-empty string or token ids", param="prompt")
        return encoder.check_token_ids(prompt, "prompt")
    if prompt is None:
        raise InvalidArgument("prompt is required", param="prompt")
    raise InvalidArgument("prompt must be a string or a list of token ids (integers)", param="prompt")


def _chat_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"messages[{i}] must be an object with role and content", param="messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{i}].role must be a non-empty string", param="messages")
        out.append({"role": role, "content": _message_content(m.get("content"), i)})
    if not any(m["content"] for m in out):
        raise InvalidArgument("messages are empty: every content is empty", param="messages")
    return out


def _message_content(content: Any, i: int) -> str:
    if content is None:  # e.g. an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(
                    f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                    f"supported, got type {kind!r}", param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts", param="messages")


SESSION_ID_HEADER = "x-session-id"


def with_session_header(request: GenerationRequest, values: list[str]) -> GenerationRequest:
    """The round's session from the `x-session-id` header, which must agree with a
    `session_id` body field when both are sent."""
    if not values:
        return request
    if len(values) > 1:
        raise InvalidArgument(f"{SESSION_ID_HEADER} must be sent once, got {len(values)} values",
                              param=SESSION_ID_HEADER)
    session_id = check_id_length(values[0].strip(), SESSION_ID_HEADER)
    if request.session_id and request.session_id != session_id:
        raise InvalidArgument(f"{SESSION_ID_HEADER} ({session_id!r}) and body session_id ({request.session_id!r}) "
                              "differ", param=SESSION_ID_HEADER)
    return dataclasses.replace(request, session_id=session_id)


def session_open_params(body: Any) -> tuple[str, float]:
    """POST /v1/sessions body: optional `session_id` (str) and `ttl_s` (seconds, > 0)."""
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object", param="body")
    check_unicode(body)
    unknown = set(body) - {"session_id", "ttl_s"}
    if unknown:
        raise InvalidArgument(f"unknown field(s) {sorted(unknown)}; accepted: session_id, ttl_s", param=min(unknown))
    session_id = body.get("session_id") or ""
    if not isinstance(session_id, str):
        raise InvalidArgument("session_id must be a string", param="session_id")
    ttl = body.get("ttl_s", 0)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl <= UINT32_MAX:  # NaN too
        raise InvalidArgument(f"ttl_s must be a number of seconds in [0, {UINT32_MAX}], got {ttl!r}", param="ttl_s")
    return check_id_length(session_id, "session_id"), float(ttl)
