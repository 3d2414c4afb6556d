"""splitserve gRPC SDK: `AsyncClient` (grpc.aio) and `Client` (blocking), with typed errors.

    async with AsyncClient("127.0.0.1:50051", api_key="k") as client:
        result = await client.generate("Hello", max_tokens=32, temperature=0)
        async for chunk in client.stream("Hello", max_tokens=32):
            print(chunk.text, end="")

A request's options are one `GenerateOptions` (sampling, stop conditions, session, SLO,
priority, output-length hint, request id, deadline): pass one to reuse it, and/or any of its fields by
keyword, as above; keywords override the options' fields.

`Client` has the same methods, blocking, and `stream` is a plain iterator. It uses gRPC's
synchronous API rather than a private event-loop thread around `AsyncClient`: no extra
thread, it works inside other event loops and after fork, and breaking out of a stream
cancels the call directly. The logic both share (options and request building, retry
decisions, error mapping, reply conversion) lives in module-level code and `_ClientBase`;
each class keeps only its own way of waiting.

TLS: `AsyncClient("gw:50051", ca_file="ca.pem")` verifies the gateway's certificate against
`ca_file` (`tls=True` alone: the system roots); `cert_file` + `key_file` add a client
certificate for a gateway that requires one (`--tls-client-ca-file`). Without any of them the
channel is plaintext, as before.

Deadlines: `timeout_s` (per call, else the client's) bounds the whole call, retries
included. Retries: only UNAVAILABLE, with exponential backoff; a `stream` only before its
first message arrived (what it yielded cannot be taken back), a `generate` at any point (its
partial output never left the client; the same request id gives the same seed, hence the
same tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence

import grpc

from splitserve.proto import gateway_pb2, gateway_pb2_grpc, types_pb2
from splitserve.tls import channel_credentials, open_aio_channel, open_channel

DEFAULT_TARGET = "127.0.0.1:50051"
RETRY_AFTER_KEY = "retry-after-ms"
MAX_BACKOFF_S = 5.0
_UINT32_MAX = 2**32 - 1
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                    ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000)]


@dataclass(frozen=True)
class Usage:
    """Token accounting of a finished generation."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log probability and the top N tokens' (`GenerateOptions.logprobs`),
    from the model's raw distribution (before penalties, temperature and filters)."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class GenerationResult:
    """A whole generation: text, its token ids, why it ended, usage and the request id; with
    `logprobs` asked for, one `TokenLogprob` per token id."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    request_id: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class StreamChunk:
    """One streamed delta; the last has finish_reason and usage."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage | None
    request_id: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked for


@dataclass(frozen=True)
class ModelInfo:
    """A served model."""

    id: str
    engine_kind: str
    max_model_len: int
    num_workers: int




class SplitserveClientError(Exception):
    """Base of every SDK error; `code` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN):
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidRequestError(SplitserveClientError):
    """The request was refused as invalid (INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION)."""


class NotFoundError(InvalidRequestError):
    """The model or session does not exist (NOT_FOUND)."""


class AuthenticationError(SplitserveClientError):
    """Missing or wrong API key (UNAUTHENTICATED, PERMISSION_DENIED)."""


class RateLimitedError(SplitserveClientError):
    """The gateway is overloaded (RESOURCE_EXHAUSTED); retry after `retry_after_s` (None: no hint)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
                 retry_after_s: float | None = None):
        super().__init__(message, code)
        self.retry_after_s = retry_after_s


class ServiceUnavailableError(SplitserveClientError):
    """The service could not be reached or has no capacity (UNAVAILABLE); retried automatically when safe."""


class DeadlineExceededError(SplitserveClientError):
    """The call's deadline passed (DEADLINE_EXCEEDED)."""


class RequestCancelledError(SplitserveClientError):
    """The call was cancelled (CANCELLED)."""


class ConflictError(SplitserveClientError):
    """The request conflicts with one in flight (ABORTED), e.g. a second round of a session
    sent while its previous round still runs: send a session's rounds one at a time."""


_ERRORS: dict[grpc.StatusCode, type[SplitserveClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.ABORTED: ConflictError,
}


def error_from_status(code: grpc.StatusCode, details: str | None,
                      trailing_metadata: Iterable[tuple[str, Any]] | None = None) -> SplitserveClientError:
    """The typed SDK error for a gRPC status (RESOURCE_EXHAUSTED reads the `retry-after-ms` trailer)."""
    message = details or code.name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_after = None
        for key, value in trailing_metadata or ():
            if key == RETRY_AFTER_KEY:
                try:
                    retry_after = int(value.decode() if isinstance(value, bytes) else value) / 1000
                except ValueError:
                    pass  # a malformed hint is no hint
        return RateLimitedError(message, code, retry_after)
    return _ERRORS.get(code, SplitserveClientError)(message, code)


def _error_from_rpc(err: grpc.RpcError) -> SplitserveClientError:
    return error_from_status(err.code(), err.details(), err.trailing_metadata())


def should_retry(code: grpc.StatusCode, *, received_first_response: bool, attempt: int, max_retries: int) -> bool:
    """Retry only UNAVAILABLE, at most `max_retries` times; a stream only before any output arrived."""
    return code == grpc.StatusCode.UNAVAILABLE and not received_first_response and attempt < max_retries


def backoff_delay(attempt: int, backoff_s: float, max_backoff_s: float = MAX_BACKOFF_S,
                  rand: float | None = None) -> float:
    """Sleep before retry `attempt` (0-based): `backoff_s * 2**attempt` capped, with jitter in [1/2, 1] of it."""
    full = min(backoff_s * (2**attempt), max_backoff_s)
    return full * (0.5 + 0.5 * (random.random() if rand is None else rand))


@dataclass(frozen=True)
class GenerateOptions:
    """How to generate one request: every option `generate` and `stream` take.

    Sampling options left None take the server's defaults (temperature 0 is greedy);
    `stop` is one string or several, kept as a tuple; `timeout_s` bounds the call, retries
    included (None: the client's). `predicted_output_len` tells the scheduler how many
    tokens the request is expected to generate (it plans the split with it instead of its
    own prediction; None: no hint; above max_tokens counts as max_tokens). `steps`,
    `block_length`, `remasking`, `retention_ratio` and `cfg_scale` are a diffusion model's denoising knobs
    (dLLM-Serve; None: the server's defaults; an autoregressive model refuses them).
    `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_p` and `min_tokens`
    are vLLM's (None: off); every stage of a split request applies them over the whole history.
    `logprobs` N returns each output token's logprob and the top N's (`StreamChunk.logprobs`,
    `GenerationResult.logprobs`).
    Frozen, so one instance can serve many calls:

        greedy = GenerateOptions(temperature=0.0, ignore_eos=True)
        client.generate("Hello", greedy, max_tokens=8)
    """

    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()
    ignore_eos: bool = False
    session_id: str | None = None
    slo_ttft_ms: int | None = None
    slo_itl_ms: int | None = None
    priority: int = 0
    predicted_output_len: int | None = None
    request_id: str | None = None
    timeout_s: float | None = None
    steps: int | None = None
    block_length: int | None = None
    remasking: str | None = None
    retention_ratio: float | None = None
    cfg_scale: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logprobs: int | None = None  # N in [0, 20]: each token's logprob and the top N's (None: none)

    def __post_init__(self) -> None:
        # Tuples: the options stay as given even if the caller's list changes later.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

    def with_overrides(self, **overrides: Any) -> GenerateOptions:
        """These options with `overrides` (GenerateOptions fields) replaced; an unknown name is a TypeError."""
        unknown = [name for name in overrides if name not in _GENERATE_OPTION_NAMES]
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}: not a GenerateOptions field "
                            f"({', '.join(sorted(_GENERATE_OPTION_NAMES))})")
        return dataclasses.replace(self, **overrides) if overrides else self


_GENERATE_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(GenerateOptions))
_DEFAULT_OPTIONS = GenerateOptions()


def _merged_options(options: GenerateOptions | None, overrides: dict[str, Any]) -> GenerateOptions:
    """`options` (None: the defaults) with `overrides` replaced: what `(prompt, options, **overrides)` asks for."""
    if options is None:
        options = _DEFAULT_OPTIONS
    elif not isinstance(options, GenerateOptions):
        # Before GenerateOptions, the second positional argument was max_tokens.
        raise TypeError(f"options must be a GenerateOptions, got {type(options).__name__} "
                        "(pass max_tokens and the other options by keyword)")
    return options.with_overrides(**overrides)


def build_generate_request(prompt: str | Sequence[int], options: GenerateOptions | None = None,
                           **overrides: Any) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest for `prompt` and these options (always echo_token_ids; unset options stay unset).

    `timeout_s` is not part of the request: the client applies it to the call.
    """
    opts = _merged_options(options, overrides)
    sampling = types_pb2.SamplingParams(top_k=opts.top_k or 0, ignore_eos=opts.ignore_eos, stop=list(opts.stop),
                                        stop_token_ids=list(opts.stop_token_ids))
    for name in ("max_tokens", "temperature", "top_p", "seed", "steps", "block_length", "remasking",
                 "retention_ratio", "cfg_scale", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                 "min_tokens"):
        value = getattr(opts, name)
        if value is not None:
            setattr(sampling, name, value)
    if opts.logprobs is not None:
        sampling.num_logprobs = opts.logprobs
    request = gateway_pb2.GenerateRequest(
        sampling=sampling, slo=types_pb2.Slo(ttft_ms=opts.slo_ttft_ms or 0, itl_ms=opts.slo_itl_ms or 0),
        session_id=opts.session_id or "", request_id=opts.request_id or uuid.uuid4().hex, priority=opts.priority,
        echo_token_ids=True)
    hint = opts.predicted_output_len
    if hint is not None:
        # Named here: protobuf would only say "Value out of range" for the uint32 field.
        if isinstance(hint, bool) or not isinstance(hint, int) or not 0 <= hint <= _UINT32_MAX:
            raise ValueError(f"predicted_output_len must be an integer in [0, {_UINT32_MAX}] (output tokens) or "
                             f"None, got {hint!r}")
        request.predicted_output_len = hint
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request.token_ids.ids.extend(prompt)
    else:
        raise TypeError("prompt must be a str or a sequence of token ids (int)")
    return request


def _chunk(msg: gateway_pb2.GenerateResponse) -> StreamChunk:
    usage = None
    if msg.HasField("usage"):
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.total_tokens)
    logprobs = [TokenLogprob(lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs))) for lp in msg.logprobs]
    return StreamChunk(msg.text, list(msg.token_ids), msg.finish_reason, usage, msg.request_id, logprobs)


def _result(chunks: Iterable[StreamChunk], request_id: str) -> GenerationResult:
    text, ids, finish, usage, logprobs = [], [], "", Usage(0, 0, 0), []
    for chunk in chunks:
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
        finish = chunk.finish_reason or finish
        usage = chunk.usage or usage
        request_id = chunk.request_id or request_id
    return GenerationResult("".join(text), ids, finish, usage, request_id, logprobs)


class _Deadline:
    """The absolute end of a call, across its retries."""

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"deadline of {self.timeout_s:g} s exceeded", grpc.StatusCode.DEADLINE_EXCEEDED)
        return left

    def allows_sleep(self, delay: float) -> bool:
        return self.at is None or time.monotonic() + delay < self.at


class _Attempts:
    """One call's attempts: its deadline across retries, and whether and after how long to try again."""

    def __init__(self, deadline: _Deadline, max_retries: int, backoff_s: float):
        self.deadline = deadline
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.attempt = 0

    def timeout(self) -> float | None:
        """Seconds the next attempt may take (DeadlineExceededError when none are left)."""
        return self.deadline.remaining()

    def retry_delay(self, err: grpc.RpcError, received_first_response: bool) -> float:
        """Seconds to wait before the next attempt; raises `err` as the SDK's typed error when there is none."""
        if should_retry(err.code(), received_first_response=received_first_response, attempt=self.attempt,
                        max_retries=self.max_retries):
            delay = backoff_delay(self.attempt, self.backoff_s)
            if self.deadline.allows_sleep(delay):
                self.attempt += 1
                return delay
        raise _error_from_rpc(err) from None


def _models(reply: gateway_pb2.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(m.id, m.engine_kind, m.max_model_len, m.num_workers) for m in reply.models]


class _SessionBase:
    """A multi-turn session and its history (what every round's prompt starts with).

    Each round sends the whole history plus the new turn, under the session's id: the
    server keeps the history's KV on the session's worker, so only the new turn is
    computed. The history is token ids when the session started with token ids (exact:
    the output's own ids are appended), else text (the output text is appended).
    """

    def __init__(self, client: Any, session_id: str, ttl_s: int, history: str | Sequence[int] | None = None):
        self.client = client
        self.session_id = session_id
        self.ttl_s = ttl_s
        self.history: str | list[int] | None = None if history is None else _prompt_copy(history)
        self.rounds = 0

    def _prompt(self, turn: str | Sequence[int]) -> str | list[int]:
        turn = _prompt_copy(turn)
        if self.history is None:
            return turn
        if isinstance(turn, str) != isinstance(self.history, str):
            raise TypeError(f"session {self.session_id}: its history is {_kind(self.history)}; a turn must be too, "
                            f"got {_kind(turn)}")
        return self.history + turn

    def _advance(self, prompt: str | list[int], result: GenerationResult) -> None:
        self.history = prompt + result.text if isinstance(prompt, str) else prompt + list(result.token_ids)
        self.rounds += 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.session_id!r}, ttl_s={self.ttl_s}, rounds={self.rounds})"


def _prompt_copy(prompt: str | Sequence[int]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise TypeError(f"a prompt is a str or a sequence of token ids, got {type(prompt).__name__}")


def _kind(prompt: str | Sequence[int]) -> str:
    return "text" if isinstance(prompt, str) else "token ids"


class Session(_SessionBase):
    """A session of the blocking `Client`: `session.generate(turn)` runs one round."""

    def generate(self, turn: str | Sequence[int], options: GenerateOptions | None = None,
                 **overrides: Any) -> GenerationResult:
        """One round: history + `turn` in, the output appended to the history; the result."""
        prompt = self._prompt(turn)
        result = self.client.generate(prompt, options, **{**overrides, "session_id": self.session_id})
        self._advance(prompt, result)
        return result

    def close(self) -> bool:
        """Close the session (its pinned history is freed); whether it was still open."""
        return self.client.close_session(self.session_id)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSession(_SessionBase):
    """A session of the `AsyncClient`: `await session.generate(turn)` runs one round."""

    async def generate(self, turn: str | Sequence[int], options: GenerateOptions | None = None,
                       **overrides: Any) -> GenerationResult:
        """One round: history + `turn` in, the output appended to the history; the result."""
        prompt = self._prompt(turn)
        result = await self.client.generate(prompt, options, **{**overrides, "session_id": self.session_id})
        self._advance(prompt, result)
        return result

    async def close(self) -> bool:
        """Close the session (its pinned history is freed); whether it was still open."""
        return await self.client.close_session(self.session_id)

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _ClientBase:
    """What both clients share; each subclass adds only its own way of waiting (await or block)."""

    def __init__(self, target: str, api_key: str | None, timeout_s: float | None, max_retries: int, backoff_s: float,
                 tls: bool, ca_file: str | None, cert_file: str | None, key_file: str | None,
                 server_name: str | None):
        self.target = target
        self.tls = bool(tls or ca_file or cert_file or key_file)
        # ValueError naming the argument (a missing file, a certificate without its key) here, not at the first call.
        self._credentials = channel_credentials(ca_file or "", cert_file or "", key_file or "",
                                                fields=("ca_file", "cert_file", "key_file")) if self.tls else None
        self._server_name = server_name or ""
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def _generate_request(self, prompt: str | Sequence[int], options: GenerateOptions | None,
                          overrides: dict[str, Any]) -> tuple[gateway_pb2.GenerateRequest, float | None]:
        """The request `generate`/`stream` send, and the call's timeout (None: the client's)."""
        opts = _merged_options(options, overrides)
        return build_generate_request(prompt, opts), opts.timeout_s

    def _attempts(self, timeout_s: float | None) -> _Attempts:
        """A call's attempts; its deadline starts now."""
        return _Attempts(_Deadline(self.timeout_s if timeout_s is None else timeout_s), self.max_retries,
                         self.backoff_s)


class AsyncClient(_ClientBase):
    """Asynchronous client of the Gateway service (grpc.aio)."""

    def __init__(self, target: str = DEFAULT_TARGET, api_key: str | None = None, timeout_s: float | None = None,
                 max_retries: int = 3, backoff_s: float = 0.1, *, tls: bool = False, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None, server_name: str | None = None):
        """TLS when `tls` or any of `ca_file` (trusted CA; default the system roots), `cert_file` +
        `key_file` (client certificate) is given; `server_name`: the name the gateway's
        certificate is checked against instead of the target's host."""
        super().__init__(target, api_key, timeout_s, max_retries, backoff_s, tls, ca_file, cert_file, key_file,
                         server_name)
        self._channel = open_aio_channel(target, self._credentials, _CHANNEL_OPTIONS, self._server_name)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def generate(self, prompt: str | Sequence[int], options: GenerateOptions | None = None,
                       **overrides: Any) -> GenerationResult:
        """Generate to completion; `overrides` are GenerateOptions fields (max_tokens=32, temperature=0, ...)."""
        request, timeout_s = self._generate_request(prompt, options, overrides)
        attempts = self._attempts(timeout_s)
        while True:
            call = self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._metadata)
            try:
                return _result([_chunk(msg) async for msg in call], request.request_id)
            except grpc.aio.AioRpcError as err:
                # Unlike a stream's, a partial output never reached the caller: retried whole
                # (same request id, hence the same seed and tokens), even after output began.
                delay = attempts.retry_delay(err, False)
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    def stream(self, prompt: str | Sequence[int], options: GenerateOptions | None = None,
               **overrides: Any) -> AsyncIterator[StreamChunk]:
        """`async for chunk in client.stream(...)` (not awaited); closing the iterator early cancels the request."""
        return self._stream_request(*self._generate_request(prompt, options, overrides))

    async def _stream_request(self, request: gateway_pb2.GenerateRequest,
                              timeout_s: float | None) -> AsyncIterator[StreamChunk]:
        attempts = self._attempts(timeout_s)
        while True:
            call = self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._metadata)
            received = False
            try:
                async for msg in call:
                    received = True
                    yield _chunk(msg)
                return
            except grpc.aio.AioRpcError as err:
                delay = attempts.retry_delay(err, received)
            finally:
                call.cancel()  # no-op when finished; stops the server's work when we were closed early
            await asyncio.sleep(delay)

    async def _unary(self, method: Any, request: Any, timeout_s: float | None) -> Any:
        attempts = self._attempts(timeout_s)
        while True:
            try:
                return await method(request, timeout=attempts.timeout(), metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                delay = attempts.retry_delay(err, False)
            await asyncio.sleep(delay)

    async def list_models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        """The served models."""
        return _models(await self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest(), timeout_s))

    async def open_session(self, session_id: str = "", ttl_s: int = 0, *, history: str | Sequence[int] | None = None,
                           timeout_s: float | None = None) -> AsyncSession:
        """Open a multi-turn session (the server picks the id when empty, the TTL when 0);
        `await session.generate(turn)` runs its rounds, each on the whole history so far."""
        request = gateway_pb2.OpenSessionRequest(session_id=session_id, ttl_s=ttl_s)
        reply = await self._unary(self._stub.OpenSession, request, timeout_s)
        return AsyncSession(self, reply.session_id, reply.ttl_s, history)

    async def close_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """Close a session; whether it was open."""
        request = gateway_pb2.CloseSessionRequest(session_id=session_id)
        return (await self._unary(self._stub.CloseSession, request, timeout_s)).closed

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Client(_ClientBase):
    """Blocking client of the Gateway service (gRPC's synchronous API); same methods as AsyncClient."""

    def __init__(self, target: str = DEFAULT_TARGET, api_key: str | None = None, timeout_s: float | None = None,
                 max_retries: int = 3, backoff_s: float = 0.1, *, tls: bool = False, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None, server_name: str | None = None):
        """TLS options as AsyncClient's."""
        super().__init__(target, api_key, timeout_s, max_retries, backoff_s, tls, ca_file, cert_file, key_file,
                         server_name)
        self._channel = open_channel(target, self._credentials, _CHANNEL_OPTIONS, self._server_name)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def generate(self, prompt: str | Sequence[int], options: GenerateOptions | None = None,
                 **overrides: Any) -> GenerationResult:
        """Generate to completion; `overrides` are GenerateOptions fields (max_tokens=32, temperature=0, ...)."""
        request, timeout_s = self._generate_request(prompt, options, overrides)
        attempts = self._attempts(timeout_s)
        while True:
            call = self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._metadata)
            try:
                return _result([_chunk(msg) for msg in call], request.request_id)
            except grpc.RpcError as err:
                # Retried whole even after output began, as AsyncClient.generate.
                delay = attempts.retry_delay(err, False)
            finally:
                call.cancel()
            time.sleep(delay)

    def stream(self, prompt: str | Sequence[int], options: GenerateOptions | None = None,
               **overrides: Any) -> Iterator[StreamChunk]:
        """Stream deltas (same options as generate); closing the iterator early (break) cancels the request."""
        return self._stream_request(*self._generate_request(prompt, options, overrides))

    def _stream_request(self, request: gateway_pb2.GenerateRequest, timeout_s: float | None) -> Iterator[StreamChunk]:
        attempts = self._attempts(timeout_s)
        while True:
            call = self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._metadata)
            received = False
            try:
                for msg in call:
                    received = True
                    yield _chunk(msg)
                return
            except grpc.RpcError as err:
                delay = attempts.retry_delay(err, received)
            finally:
                call.cancel()
            time.sleep(delay)

    def _unary(self, method: Any, request: Any, timeout_s: float | None) -> Any:
        attempts = self._attempts(timeout_s)
        while True:
            try:
                return method(request, timeout=attempts.timeout(), metadata=self._metadata)
            except grpc.RpcError as err:
                delay = attempts.retry_delay(err, False)
            time.sleep(delay)

    def list_models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        """The served models."""
        return _models(self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest(), timeout_s))

    def open_session(self, session_id: str = "", ttl_s: int = 0, *, history: str | Sequence[int] | None = None,
                     timeout_s: float | None = None) -> Session:
        """Open a multi-turn session (the server picks the id when empty, the TTL when 0);
        `session.generate(turn)` runs its rounds, each on the whole history so far."""
        request = gateway_pb2.OpenSessionRequest(session_id=session_id, ttl_s=ttl_s)
        reply = self._unary(self._stub.OpenSession, request, timeout_s)
        return Session(self, reply.session_id, reply.ttl_s, history)

    def close_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """Close a session; whether it was open."""
        request = gateway_pb2.CloseSessionRequest(session_id=session_id)
        return self._unary(self._stub.CloseSession, request, timeout_s).closed

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
