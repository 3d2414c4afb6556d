"""The gateway's one connection to the coordinator: submit, relay, detokenize, cut at stop strings."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

import grpc
from opentelemetry.context import Context

from gateway.validation import GenerationRequest
from splitserve.errors import Unavailable, from_rpc_error
from splitserve.proto import coordinator_pb2, coordinator_pb2_grpc
from splitserve.telemetry import outgoing_metadata

# Coordinator finish reasons that do not end the client's stream.
_RUNNING = ("", "stage_end")


class Detokenizer(Protocol):
    stopped: bool

    def push(self, token_ids: list[int], final: bool = False) -> str: ...


class DetokenizerFactory(Protocol):
    def detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str]) -> Detokenizer: ...


@dataclass
class GenerationDelta:
    """New output since the previous delta; the last one has a finish_reason."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "" while running; else "stop", "length" or "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # output tokens so far, as delivered to the client


class OutputAssembler:
    """Turns the coordinator's token chunks into client deltas, cutting the text at stop strings.

    The worker stops on stop strings too, but the tokens that complete one may arrive in
    the same chunk as more output; the gateway's detokenizer decides where the text ends.
    """

    def __init__(self, detokenizer: Detokenizer, prompt_len: int):
        self.detokenizer = detokenizer
        self.prompt_tokens = prompt_len
        self.completion_tokens = 0
        self.finished = False

    def feed(self, token_ids: Sequence[int], finish_reason: str, num_prompt_tokens: int = 0) -> GenerationDelta | None:
        """The delta for one upstream chunk, or None when it adds nothing visible."""
        if num_prompt_tokens:
            self.prompt_tokens = num_prompt_tokens
        finishing = finish_reason not in _RUNNING
        taken: list[int] = []
        text = ""
        for token in token_ids:
            text += self.detokenizer.push([token])
            taken.append(token)
            if self.detokenizer.stopped:
                break
        stopped = self.detokenizer.stopped
        if finishing or stopped:
            text += self.detokenizer.push([], final=True)
            self.finished = True
        self.completion_tokens += len(taken)
        reason = "stop" if stopped else (finish_reason if finishing else "")
        if not (text or taken or reason):
            return None
        return GenerationDelta(text, taken, reason, self.prompt_tokens, self.completion_tokens)


class CoordinatorClient:
    """Submits requests to the coordinator and streams their detokenized output."""

    def __init__(self, channel: grpc.aio.Channel, tokenization: DetokenizerFactory):
        self.channel = channel
        self.stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self.tokenization = tokenization

    async def generate(self, request: GenerationRequest, timeout_s: float | None = None,
                       trace_context: Context | None = None) -> AsyncIterator[GenerationDelta]:
        """Stream deltas of one request; closing the iterator early cancels it upstream."""
        assembler = OutputAssembler(self.tokenization.detokenizer(request.prompt_token_ids, request.stop),
                                    len(request.prompt_token_ids))
        call = self.stub.Submit(request.submit_request(), timeout=timeout_s,
                                metadata=outgoing_metadata(request.request_id, trace_context))
        try:
            async for chunk in call:
                delta = assembler.feed(chunk.token_ids, chunk.finish_reason, chunk.num_prompt_tokens)
                if delta is not None:
                    yield delta
                if assembler.finished:
                    return
            raise Unavailable("the coordinator ended the stream without a finish reason")
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        finally:
            # Runs on stop-string cut, client disconnect (generator closed or task
            # cancelled) and errors: cancelling the call propagates to the coordinator.
            if not call.done():
                call.cancel()

    async def open_session(self, session_id: str, ttl_s: float, owner: str) -> tuple[str, float]:
        """Open a session at the coordinator (state in Redis); its id and idle TTL."""
        try:
            reply = await self.stub.CreateSession(coordinator_pb2.CreateSessionRequest(
                session_id=session_id, ttl_s=int(ttl_s), owner=owner), timeout=10.0)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return reply.session_id, float(reply.ttl_s)

    async def close_session(self, session_id: str, owner: str) -> bool:
        try:
            reply = await self.stub.DeleteSession(coordinator_pb2.DeleteSessionRequest(
                session_id=session_id, owner=owner), timeout=10.0)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return reply.closed

    async def ready(self, timeout_s: float = 1.0, engine_family: str = "") -> tuple[bool, str]:
        """Whether a request sent now would be served: the coordinator answers and its placement
        has an eligible worker of the model's engine family; (ready, why not)."""
        try:
            reply = await self.stub.Ready(coordinator_pb2.ReadyRequest(engine_family=engine_family),
                                          timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            return False, f"coordinator unreachable ({err.code().name})"
        return reply.ready, reply.reason

    async def close(self) -> None:
        await self.channel.close()


class EmbeddedCoordinatorClient:
    """The same interface over a Coordinator running in the gateway's own process.

    No Submit RPC and no second token relay: each chunk comes straight from the
    coordinator's Worker.Execute stream.
    """

    def __init__(self, coordinator, tokenization: DetokenizerFactory):
        self.coordinator = coordinator  # services.coordinator.core.Coordinator
        self.tokenization = tokenization

    async def generate(self, request: GenerationRequest, timeout_s: float | None = None,
                       trace_context: Context | None = None) -> AsyncIterator[GenerationDelta]:
        """Stream deltas of one request; closing the iterator early cancels it on the worker."""
        assembler = OutputAssembler(self.tokenization.detokenizer(request.prompt_token_ids, request.stop),
                                    len(request.prompt_token_ids))
        deadline = time.monotonic() + (timeout_s or self.coordinator.config.request_timeout_s)
        submitted = self.coordinator.submit(request.submit_request(), deadline, trace_context=trace_context)
        async with contextlib.aclosing(submitted) as chunks:
            async for chunk in chunks:
                delta = assembler.feed(chunk.token_ids, chunk.finish_reason, chunk.num_prompt_tokens)
                if delta is not None:
                    yield delta
                if assembler.finished:
                    return
        raise Unavailable("the coordinator ended the stream without a finish reason")

    async def open_session(self, session_id: str, ttl_s: float, owner: str) -> tuple[str, float]:
        return await self.coordinator.open_session(session_id, ttl_s, owner)

    async def close_session(self, session_id: str, owner: str) -> bool:
        return await self.coordinator.close_session(session_id, owner)

    async def ready(self, timeout_s: float = 1.0, engine_family: str = "") -> tuple[bool, str]:
        ready, reason, _ = await self.coordinator.ready(timeout_s, engine_family)
        return ready, reason

    async def close(self) -> None:
        """The gateway closes the embedded coordinator itself (it owns its lifetime)."""
