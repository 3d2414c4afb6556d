"""The gateway's one connection to the coordinator: submit, relay, detokenize, cut at stop strings.

A coordinator that dies (or restarts) under a request is survived here: a Submit that ends
with UNAVAILABLE is sent again once the coordinator answers (bounded in attempts and in the
wait), so a client never sees a coordinator restart as long as the request can be continued
exactly. Before any output arrived the request is simply sent again; after output arrived
it is continued from the tokens already delivered (`SubmitRequest.generated_token_ids`: the
coordinator recomputes their KV and goes on, as a migration does, so greedy and sampled
requests alike get exactly the tokens one attempt would have produced). A session round or
a diffusion request cannot be continued: those end with the retriable UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

import grpc
from opentelemetry.context import Context
from prometheus_client import Counter

from gateway.validation import GenerationRequest
from splitserve.core.sampling import TokenLogprobs
from splitserve.errors import DeadlineExceeded, SplitserveError, Unavailable, connection_failure, from_rpc_error
from splitserve.proto import coordinator_pb2, coordinator_pb2_grpc
from splitserve.core.records import DIFFUSION
from splitserve.wire import token_logprobs_from_proto
from splitserve.telemetry import outgoing_metadata

log = logging.getLogger(__name__)

# Coordinator finish reasons that do not end the client's stream.
_RUNNING = ("", "stage_end")

RESUBMITS = Counter("splitserve_gateway_coordinator_resubmits_total",
                    "Requests sent to the coordinator again after it failed them with UNAVAILABLE (it "
                    "restarted, or could not place them), once per failure, by whether output had been delivered",
                    ["after"])
# Sending a request again after the coordinator failed it with UNAVAILABLE: while it cannot
# be reached (a restarted coordinator takes a few seconds to start), for at most
# COORDINATOR_WAIT_S from the first failure; after UNAVAILABLE answers of its own (e.g. no
# worker can take the request), at most MAX_RESUBMITS times.
MAX_RESUBMITS = 2
COORDINATOR_WAIT_S = 30.0


class Detokenizer(Protocol):
    stopped: bool

    def push(self, token_ids: list[int], final: bool = False) -> str: ...


class DetokenizerFactory(Protocol):
    def detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str], min_tokens: int = 0) -> Detokenizer: ...


@dataclass
class GenerationDelta:
    """New output since the previous delta; the last one has a finish_reason."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "" while running; else "stop", "length" or "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # output tokens so far, as delivered to the client
    # One per token of token_ids when the request asked for logprobs; else empty.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # On the first delta of a request that asked for prompt logprobs: one per prompt token, the
    # first None (nothing predicts it); else None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class OutputAssembler:
    """Turns the coordinator's token chunks into client deltas, cutting the text at stop strings.

    The worker stops on stop strings too, but the tokens that complete one may arrive in
    the same chunk as more output; the gateway's detokenizer decides where the text ends.
    """

    def __init__(self, detokenizer: Detokenizer, prompt_len: int, max_tokens: int | None = None,
                 prompt_logprobs: bool = False):
        """`max_tokens` 0: the output is empty whatever the engine generated (echo alone);
        `prompt_logprobs`: the request asked for them (stitched here by position)."""
        self.detokenizer = detokenizer
        self.prompt_tokens = prompt_len
        self.completion_tokens = 0
        self.finished = False
        self.max_tokens = max_tokens
        self._prompt_scores: dict[int, TokenLogprobs] | None = {} if prompt_logprobs else None

    def feed(self, token_ids: Sequence[int], finish_reason: str, num_prompt_tokens: int = 0,
             logprobs: Sequence[TokenLogprobs] = (), prompt_logprobs: Sequence[TokenLogprobs] = (),
             prompt_logprobs_start: int = 0) -> GenerationDelta | None:
        """The delta for one upstream chunk, or None when it adds nothing visible; `logprobs`
        (one per token, when asked for) are cut with the tokens a stop string cuts;
        `prompt_logprobs` score the prompt tokens from `prompt_logprobs_start` on (each stage
        of a split request sends those it computed; a position scored twice keeps the later)."""
        if num_prompt_tokens:
            self.prompt_tokens = num_prompt_tokens
        if self._prompt_scores is not None:
            for position, record in enumerate(prompt_logprobs, prompt_logprobs_start):
                self._prompt_scores[position] = record
        if self.max_tokens == 0 and (token_ids or finish_reason not in _RUNNING):
            token_ids, finish_reason = [], "length"  # the engine's one token is not part of the answer
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
        return GenerationDelta(text, taken, reason, self.prompt_tokens, self.completion_tokens,
                               list(logprobs[:len(taken)]), self._take_prompt_logprobs())

    def _take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """Every prompt token's logprobs, once (on the first visible delta): they are all in by
        then, since a prompt is scored before its first output token is sampled."""
        if self._prompt_scores is None:
            return None
        scores, self._prompt_scores = self._prompt_scores, None
        missing = [p for p in range(1, self.prompt_tokens) if p not in scores]
        if missing:
            raise SplitserveError(f"prompt_logprobs: {len(missing)} of the {self.prompt_tokens - 1} scored prompt "
                                  f"positions did not arrive (first: {missing[0]}); a stage reused KV it did not "
                                  "compute", param="prompt_logprobs")
        return [None] + [scores[p] for p in range(1, self.prompt_tokens)]


class CoordinatorClient:
    """Submits requests to the coordinator and streams their detokenized output."""

    def __init__(self, channel: grpc.aio.Channel, tokenization: DetokenizerFactory):
        self.channel = channel
        self.stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self.tokenization = tokenization

    async def generate(self, request: GenerationRequest, timeout_s: float | None = None,
                       trace_context: Context | None = None) -> AsyncIterator[GenerationDelta]:
        """Stream deltas of one request; closing the iterator early cancels it upstream.

        A Submit that fails with UNAVAILABLE is sent again when that keeps the output exact
        (module docstring); the client sees one uninterrupted stream."""
        assembler = output_assembler(self.tokenization, request)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delivered: list[int] = []  # output tokens the coordinator streamed so far, over every attempt
        attempts = answered = 0
        down_since: float | None = None  # the first failure of this request
        while True:
            call = self.stub.Submit(resume_request(request, delivered), timeout=_left(deadline),
                                    metadata=outgoing_metadata(request.request_id, trace_context))
            try:
                async for chunk in call:
                    delivered.extend(chunk.token_ids)
                    down_since = None  # served again: a later failure gets the whole wait
                    delta = feed_chunk(assembler, chunk)
                    if delta is not None:
                        yield delta
                    if assembler.finished:
                        return
                raise Unavailable("the coordinator ended the stream without a finish reason")
            except grpc.aio.AioRpcError as err:
                error = from_rpc_error(err)
                if err.code() == grpc.StatusCode.UNAVAILABLE and len(delivered) >= max(request.max_tokens, 1) \
                        and not request.session_id:
                    # Every token arrived, only the last chunk's finish reason did not: it is
                    # "length" (EOS or a stop would have ended the stream with that chunk).
                    delta = assembler.feed([], "length")
                    if delta is not None:
                        yield delta
                    return
                if not (err.code() == grpc.StatusCode.UNAVAILABLE and resumable(request, delivered)):
                    raise error from None
                now = time.monotonic()
                down_since = down_since or now
                unreached = connection_failure(err, self.channel)
                answered += not unreached  # the coordinator itself said UNAVAILABLE (e.g. no worker)
                if answered > MAX_RESUBMITS:
                    raise error from None
                if now - down_since > COORDINATOR_WAIT_S:
                    raise Unavailable(f"the coordinator did not serve the request within {COORDINATOR_WAIT_S:.0f} s: "
                                      f"{error.message}") from None
            finally:
                # Runs on stop-string cut, client disconnect (generator closed or task
                # cancelled) and errors: cancelling the call propagates to the coordinator.
                if not call.done():
                    call.cancel()
            attempts += 1
            if attempts == 1 or not unreached:  # not each try while the coordinator is down
                RESUBMITS.labels("output" if delivered else "nothing").inc()
                log.warning("coordinator failed request %s with UNAVAILABLE after %d output tokens (%s); "
                            "sending it again", request.request_id, len(delivered), error.message,
                            extra={"request_id": request.request_id})
            # Backoff, not synchronisation: a coordinator that is down fails each try at once
            # until its channel reconnects.
            pause = min(0.05 * 2 ** (attempts - 1), 0.25)
            if deadline is not None and time.monotonic() + pause >= deadline:
                raise error
            await asyncio.sleep(pause)

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




def output_assembler(tokenization: DetokenizerFactory, request: GenerationRequest) -> OutputAssembler:
    return OutputAssembler(tokenization.detokenizer(request.prompt_token_ids, request.stop, request.min_tokens),
                           len(request.prompt_token_ids), request.max_tokens, request.prompt_logprobs is not None)


def feed_chunk(assembler: OutputAssembler, chunk) -> GenerationDelta | None:
    """`assembler.feed` of one coordinator TokenChunk."""
    return assembler.feed(chunk.token_ids, chunk.finish_reason, chunk.num_prompt_tokens,
                          [token_logprobs_from_proto(lp) for lp in chunk.logprobs],
                          [token_logprobs_from_proto(lp) for lp in chunk.prompt_logprobs], chunk.prompt_logprobs_start)


def resumable(request: GenerationRequest, delivered: Sequence[int]) -> bool:
    """Whether a request the coordinator failed with UNAVAILABLE may be sent again with
    `delivered` tokens already streamed: unless it is a session round (its round is marked
    in flight in Redis) or a diffusion request (blocks, not tokens), or nothing is left.
    A request scoring its prompt is sent again only before any output (its prompt is scored
    again whole then; a continuation from delivered tokens would not score it)."""
    if request.session_id or request.engine_family == DIFFUSION:
        return False
    if request.prompt_logprobs is not None and delivered:
        return False
    return len(delivered) < max(request.max_tokens, 1)  # max_tokens 0: the engine generates one


def resume_request(request: GenerationRequest, delivered: Sequence[int]) -> coordinator_pb2.SubmitRequest:
    """The Submit message continuing `request` after `delivered` output tokens: the same
    request (id, hence seed; prompt; budget) with those tokens as already generated, which
    the coordinator continues from as a migration does: exactly the tokens the first attempt
    would have produced, greedy or sampled (the sampler's randomness depends only on the seed
    and the output position)."""
    submit = request.submit_request()
    submit.generated_token_ids.extend(delivered)
    return submit


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed before the coordinator answered")
    return left


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
        assembler = output_assembler(self.tokenization, request)
        deadline = time.monotonic() + (timeout_s or self.coordinator.config.request_timeout_s)
        submitted = self.coordinator.submit(request.submit_request(), deadline, trace_context=trace_context)
        async with contextlib.aclosing(submitted) as chunks:
            async for chunk in chunks:
                delta = feed_chunk(assembler, chunk)
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
