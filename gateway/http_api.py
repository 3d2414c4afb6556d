"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, vLLM's /tokenize,
/detokenize and /version, /health, /metrics."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from gateway.admission import retry_after_header
from gateway.coordinator_client import GenerationDelta
from gateway.core import GatewayCore
from gateway.openai_format import (
    SSE_DONE,
    ResponseShaper,
    detokenize_response,
    error_body,
    models_response,
    sse_event,
    tokenize_response,
    version_response,
)
from gateway.validation import (
    PREDICTED_OUTPUT_LEN_HEADER,
    SESSION_ID_HEADER,
    chat_request,
    completion_request,
    detokenize_request,
    invalid_argument_from_pydantic,
    session_open_params,
    tokenize_request,
    with_session_header,
)
from splitserve.errors import (
    Cancelled,
    InvalidArgument,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    SplitserveError,
    Unavailable,
)
from splitserve.telemetry import http_parent_context, request_id_var

log = logging.getLogger(__name__)
T = TypeVar("T")


def splitserve_version() -> str:
    """The installed splitserve distribution's version (GET /version)."""
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def error_response(err: SplitserveError) -> JSONResponse:
    """The OpenAI error body with the error's HTTP status (and Retry-After on overload)."""
    headers = {"Retry-After": retry_after_header(err.retry_after_s)} if isinstance(err, Overloaded) else None
    return JSONResponse(error_body(err), status_code=err.http_status, headers=headers)


class EventStreamResponse(StreamingResponse):
    """SSE response that stops (cancelling upstream) when the client disconnects, and always runs `on_close`."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Our own disconnect watch, whatever ASGI spec version the server speaks: the
        # cancelled stream task unwinds the generators, whose finally cancels the RPC.
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            for task in (streaming, watching):
                try:
                    await task
                except (asyncio.CancelledError, OSError):
                    pass  # the client went away
            await self.body_iterator.aclose()
            await self._on_close()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (Starlette would not)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it unwind (and cancel the RPC) before the caller cleans up
    if task.cancelled():
        raise Cancelled("client disconnected")
    return task.result()


def create_app(core: GatewayCore) -> FastAPI:
    """The FastAPI application serving the OpenAI-compatible API for one gateway."""
    app = FastAPI(title="splitserve gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(SplitserveError)
    async def _typed_error(_: Request, err: SplitserveError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(invalid_argument_from_pydantic(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, str(err.status_code))
        body = {"error": {"message": f"{err.detail}: {request.method} {request.url.path}",
                          "type": "invalid_request_error", "param": None, "code": code}}
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error: %s", err)
        return error_response(SplitserveError("internal server error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(core, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(core, request, chat=True)

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> JSONResponse:
        """Open a multi-turn session (an extension of the OpenAI API): send its id as the
        x-session-id header (or a session_id body field) on each round."""
        caller = await core.authorize(request.headers.get("authorization"))
        raw = await _read_body(request, core.config.max_request_body_bytes)
        session_id, ttl_s = session_open_params(_parse_json(raw) if raw.strip() else {})
        opened, ttl = await core.open_session(session_id, ttl_s, caller.owner)
        return JSONResponse({"id": opened, "object": "session", "ttl_s": max(1, round(ttl))})

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> JSONResponse:
        caller = await core.authorize(request.headers.get("authorization"))
        if not await core.close_session(session_id, caller.owner):
            raise NotFound(f"session {session_id!r} does not exist (never opened, closed, or expired)",
                           param="session_id")
        return JSONResponse({"id": session_id, "object": "session", "deleted": True})

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        await core.authorize(request.headers.get("authorization"))
        return JSONResponse(models_response(core.model_name, core.created, core.limits.max_model_len))

    # vLLM's tokenizer endpoints (outside /v1, as in vLLM), behind the API keys like the rest of
    # the API: the tokenizer's work is the gateway's CPU. Pure tokenizer calls, no coordinator.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        await core.authorize(request.headers.get("authorization"))
        body = await _read_json(request, core.config.max_request_body_bytes)
        ids, with_strs = tokenize_request(body, core.tokenization, core.limits)
        strs = core.tokenization.token_strings(ids) if with_strs else None
        return JSONResponse(tokenize_response(ids, core.limits.max_model_len, strs))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        await core.authorize(request.headers.get("authorization"))
        body = await _read_json(request, core.config.max_request_body_bytes)
        ids = detokenize_request(body, core.tokenization, core.limits)
        return JSONResponse(detokenize_response(core.tokenization.decode(ids)))

    version = splitserve_version()

    @app.get("/version")
    async def version_info() -> JSONResponse:
        """Open like /health (vLLM's is too): it names the software, nothing about the deployment."""
        return JSONResponse(version_response(version))

    @app.get("/health")
    @app.get("/health/ready")
    async def health() -> JSONResponse:
        """Readiness: a request sent now would be served (admitting, the coordinator answers, a
        worker is eligible); 503 saying why otherwise."""
        ready, reason = await core.ready()
        if not ready:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health/live")
    async def live() -> JSONResponse:
        """Liveness: the process and its event loop answer (while starting and draining too)."""
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 naming the limit once it is larger than `limit` bytes
    (by its Content-Length before reading, else while reading: it is never held whole)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> PayloadTooLarge:
    return PayloadTooLarge(f"body: the request body is {'over ' if at_least else ''}{size} bytes, larger than the "
                           f"limit of {limit} bytes (max_request_body_bytes)", param="body")


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidArgument(f"request body is not valid JSON: {err}", param="body") from None
    except RecursionError:
        raise InvalidArgument("request body is not valid JSON: nested too deeply", param="body") from None


async def _read_json(request: Request, limit: int) -> Any:
    return _parse_json(await _read_body(request, limit))


async def _generate(core: GatewayCore, request: Request, *, chat: bool) -> Response:
    caller = await core.authorize(request.headers.get("authorization"))
    body = await _read_json(request, core.config.max_request_body_bytes)
    request_id = uuid.uuid4().hex
    request_id_var.set(request_id)
    validate = chat_request if chat else completion_request
    # A repeated header arrives as one comma-joined value (HTTP list semantics), which is refused.
    hints = request.headers.getlist(PREDICTED_OUTPUT_LEN_HEADER)
    req = validate(body, core.tokenization, core.limits, request_id, ", ".join(hints) if hints else None)
    req = with_session_header(req, request.headers.getlist(SESSION_ID_HEADER))
    if req.ignored_fields:
        log.warning("The following fields were present in the request but ignored: %s", list(req.ignored_fields))
    created = int(time.time())
    token_text = _token_texts(core) if req.logprobs is not None else None
    echo_text = "" if not req.echo else (
        req.echo_text if req.echo_text is not None else core.tokenization.decode(req.prompt_token_ids))
    shapers = [ResponseShaper(chat=chat, request_id=request_id, model=core.model_name, created=created,
                              include_usage=req.include_usage, continuous_usage=req.continuous_usage,
                              logprobs=req.logprobs, token_text=token_text, index=index, echo_text=echo_text,
                              prompt_ids=req.prompt_token_ids) for index in range(req.n)]
    headers = {"X-Request-Id": request_id}
    trace_parent = http_parent_context(request.headers.items())
    if req.max_tokens == 0 and req.prompt_logprobs is None:
        # An echo of the prompt alone: nothing for the model to compute.
        streams = [_echo_only(len(req.prompt_token_ids)) for _ in range(req.n)]
    else:
        # Each of the n choices is a request of its own (its own seed), generated concurrently.
        streams = [core.generate(req.choice(index), api="http", trace_parent=trace_parent, caller=caller)
                   for index in range(req.n)]
    if not req.stream:
        try:
            results = await _until_disconnected(request, asyncio.gather(*(_collect(s) for s in streams)))
        finally:
            for stream in streams:
                await stream.aclose()
        choices = [shaper.choice(text, last.finish_reason, token_ids, logprobs, prompt_logprobs)
                   for shaper, (text, last, token_ids, logprobs, prompt_logprobs) in zip(shapers, results)]
        completion_tokens = sum(last.completion_tokens for _, last, *_ in results)
        return JSONResponse(shapers[0].body(choices, results[0][1].prompt_tokens, completion_tokens), headers=headers)
    merged = _merged(streams)
    # The first delta is awaited before the 200 goes out, so admission and coordinator
    # errors (429, 503, ...) still reach the client as HTTP statuses.
    try:
        first = await _until_disconnected(request, anext(merged))
    except BaseException:
        await merged.aclose()
        raise
    return EventStreamResponse(_sse_events(first, merged, shapers), merged.aclose, headers)


async def _echo_only(prompt_tokens: int) -> AsyncIterator[GenerationDelta]:
    """The output of an echo with max_tokens 0 and no logprobs: nothing (the echo is the answer)."""
    yield GenerationDelta("", [], "length", prompt_tokens, 0)


async def _merged(streams: list[AsyncIterator[GenerationDelta]]) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """(choice index, delta) of every stream as they come; closing it closes them all. An
    error of one stream ends the merge (and the others) with that error."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, GenerationDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerationDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta, None))
        except Exception as err:  # handed to the consumer; a cancellation is not
            await queue.put((index, None, err))
        else:
            await queue.put((index, None, None))

    pumps = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                running -= 1
            else:
                yield index, delta
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _token_texts(core: GatewayCore) -> Callable[[int], str]:
    """Each token id's text for logprobs: the id decoded alone, special tokens included (vLLM's
    decoded_token: `tokenizer.decode([id])`), remembered for the request (top tokens recur)."""
    texts: dict[int, str] = {}

    def token_text(token: int) -> str:
        if token not in texts:
            texts[token] = core.tokenization.decode([token])
        return texts[token]
    return token_text


async def _collect(stream: AsyncIterator[GenerationDelta]) -> tuple[str, GenerationDelta, list[int], list[Any],
                                                                  list[Any] | None]:
    """The whole output: its text, the last delta, every token with its logprobs (when asked),
    and the prompt's logprobs (when asked: echo)."""
    parts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[Any] = []
    prompt_logprobs = None
    async for delta in stream:
        parts.append(delta.text)
        token_ids += delta.token_ids
        logprobs += delta.logprobs
        prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
        if delta.finish_reason:
            return "".join(parts), delta, token_ids, logprobs, prompt_logprobs
    raise Unavailable("generation ended without a finish reason")


async def _sse_events(first: tuple[int, GenerationDelta], stream: AsyncIterator[tuple[int, GenerationDelta]],
                      shapers: list[ResponseShaper]) -> AsyncIterator[bytes]:
    """The stream's events: each choice's chunks by its shaper, as its deltas come; usage (the
    prompt once, every choice's completion tokens) after the last choice finished."""
    item: tuple[int, GenerationDelta] | None = first
    completion = [0] * len(shapers)  # output tokens so far, by choice
    finished = 0
    try:
        while item is not None:
            index, delta = item
            completion[index] = delta.completion_tokens
            for chunk in shapers[index].chunks(delta.text, delta.finish_reason or None, delta.prompt_tokens,
                                               sum(completion), len(delta.token_ids), delta.token_ids,
                                               delta.logprobs, delta.prompt_logprobs):
                yield sse_event(chunk)
            if delta.finish_reason:
                finished += 1
                if finished == len(shapers):
                    if shapers[0].include_usage:
                        yield sse_event(shapers[0].usage_chunk(delta.prompt_tokens, sum(completion)))
                    break
            item = await anext(stream, None)
    except SplitserveError as err:
        # Headers are out: the error travels as an event, as OpenAI and vLLM do.
        yield sse_event(error_body(err))
    yield SSE_DONE
