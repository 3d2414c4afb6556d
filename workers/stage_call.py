"""One stage on this worker, from the call that brings it to its last token (Worker.Execute).

In the order it happens: refuse what this worker cannot run, receive the stage's KV (wait for
a push, or pull lazily), add the stage to the engine, stream its tokens, and at its end push
the rest of its KV to the next stage's worker (or hold it for a lazy pull); a caller that
leaves before the end aborts it. Traced as `worker.stage` (KV receive, queue wait, prefill,
decode and KV push below it) under the coordinator's stage span.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AsyncIterator

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Histogram

from splitserve.core import InvalidInput, KvInBlocks, StageSpec, TokenEvent
from splitserve.errors import InvalidArgument, Unavailable
from splitserve.proto import types_pb2
from splitserve.telemetry import end_span, percentile_buckets, record_interval, start_span
from splitserve.wire import service_error
from workers.engine_loop import StageBusy
from workers.wire import has_kv_sink, stage_key, stage_spec_from_proto, token_chunk

if TYPE_CHECKING:
    from workers.server import WorkerServer

STAGES = Counter("splitserve_worker_stages_total", "Stages finished, by finish reason", ["finish_reason"])
TTFT = Histogram("splitserve_worker_ttft_seconds", "Stage arrival to first token", buckets=percentile_buckets(30.0))
ITL = Histogram("splitserve_worker_itl_seconds", "Gap between consecutive tokens", buckets=percentile_buckets(2.0))


class StageCall:
    """One Execute call: `start` admits the stage (SplitserveError when refused), `stream` runs it."""

    def __init__(self, worker: WorkerServer, stage: types_pb2.Stage, trace_parent: Context | None):
        self.worker = worker
        self.stage = stage
        self.key = stage_key(stage)
        self.span = start_span("worker.stage", trace_parent, kind=SpanKind.SERVER, attributes={
            "splitserve.request_id": stage.request_id, "splitserve.worker_id": worker.worker_id,
            "splitserve.stage_index": stage.stage_index, "splitserve.start": stage.start,
            "splitserve.end": stage.end})
        self.spec: StageSpec | None = None
        self.events: asyncio.Queue | None = None
        self.arrived = self.last_token_at = 0.0  # monotonic: the latency histograms
        self.arrived_ns = self.first_token_ns = 0  # wall clock: the trace's phases
        self.queue_wait_s: float | None = None
        self.finished = False

    async def start(self) -> None:
        """Receive the stage's KV, add the stage to the engine and start pushing its KV as it
        computes; a refusal is a SplitserveError, and it ends the span."""
        try:
            self._refuse_what_this_worker_cannot_run()
            kv = await self._receive_kv()
            await self._add(kv)
            self._start_push()
        except BaseException as err:  # refused, cancelled while waiting for KV, or a failure below the RPC layer
            end_span(self.span, None if isinstance(err, asyncio.CancelledError) else err)
            raise

    async def stream(self) -> AsyncIterator[types_pb2.TokenChunk]:
        """The stage's tokens as the engine produces them; the last message goes out once the
        stage's KV is in place on the next worker (or held here for a lazy pull)."""
        error: BaseException | None = None
        try:
            while not self.finished:
                event = await self._next_event()
                kv_held = await self._end(event) if event.finished else ([], 0)
                yield token_chunk(self.stage, event, self.worker.worker_id, self.first_token_ns, *kv_held)
            STAGES.labels(event.finish_reason).inc()
            self.span.set_attribute("splitserve.finish_reason", event.finish_reason)
        except BaseException as err:
            error = err
            raise
        finally:
            if not self.finished:  # the caller went away or cancelled: free the blocks now
                self._abort()
            end_span(self.span, None if isinstance(error, (GeneratorExit, asyncio.CancelledError)) else error)

    # ---- admitting -----------------------------------------------------------------------
    def _refuse_what_this_worker_cannot_run(self) -> None:
        worker, stage = self.worker, self.stage
        if worker.draining:
            raise Unavailable(f"worker {worker.worker_id} is draining")
        if len(stage.kv_sources) > 1:
            raise InvalidArgument("kv_sources: at most one source per stage", param="kv_sources")
        if worker.kv is None and (stage.kv_sources or has_kv_sink(stage)):
            param = "kv_sources" if stage.kv_sources else "kv_sink"
            raise InvalidArgument(f"{param}: worker {worker.worker_id} serves a diffusion model, whose requests "
                                  "run whole on one worker (no KV moves)", param=param)

    async def _receive_kv(self) -> KvInBlocks | None:
        """The KV another worker computed for this stage: pulled now (a session's history, lazy)
        or waited for (pushed as that worker computed); None: the stage computes it again."""
        if not self.stage.kv_sources:
            return None
        source, kv_stages = self.stage.kv_sources[0], self.worker.kv
        waited = time.time_ns()
        if source.lazy:
            kv = await kv_stages.pull_prefix(self.stage.request_id, source.worker_id, list(source.block_ids),
                                             source.end, source.transfer_id or str(self.key),
                                             list(self.stage.prompt_token_ids) + list(self.stage.generated_token_ids))
        else:
            kv = await kv_stages.acquire_prefix(source.transfer_id, source.end)
        record_interval("worker.kv_receive", self.span, waited, time.time_ns(), {
            "splitserve.source_worker": source.worker_id, "splitserve.lazy_pull": source.lazy,
            "splitserve.kv_tokens": kv.num_tokens if kv is not None else 0})
        return kv

    async def _add(self, kv: KvInBlocks | None) -> None:
        loop = self.worker.loop
        try:
            self.spec = stage_spec_from_proto(self.stage, self.key, kv)
        except BaseException as err:
            if kv is not None:  # from here on `add` owns the received blocks; before it, we do
                loop.release_reserved(kv.block_ids)
            if isinstance(err, InvalidInput):
                raise service_error(err) from None
            raise
        self.arrived = self.last_token_at = time.monotonic()
        self.arrived_ns = time.time_ns()
        try:
            # Takes the received KV blocks, or releases them if the stage does not start
            # (refused, busy, or this call cancelled while it waited).
            self.events = await loop.add(self.spec)
        except ValueError as err:
            raise _refusal(err) from None
        finally:
            # A history this worker lent for the request's prefill elsewhere: that pull ended
            # before this stage could start, and the stage holds its own references now.
            if self.worker.kv is not None:
                await self.worker.kv.release_leases(self.stage.request_id)

    def _start_push(self) -> None:
        spec = self.spec
        if spec.sink is not None:
            total = len(spec.prompt_ids) + spec.sampling.max_tokens
            self.worker.kv.start_push(self.key, spec.sink, spec.end if spec.end is not None and spec.end < total
                                      else total)

    # ---- running -------------------------------------------------------------------------
    async def _next_event(self) -> TokenEvent:
        """The engine's next event, with any already queued behind it (a stream that fell behind
        catches up in one message)."""
        event = await self.events.get()
        if self.queue_wait_s is None:
            self.queue_wait_s = event.queue_wait_s
        if not event.finished and not self.events.empty():
            event = merge_pending(event, self.events)
        if event.token_ids:
            now = time.monotonic()
            if self.first_token_ns == 0:
                self.worker.samples.ttft.append(now - self.arrived)
                TTFT.observe(now - self.arrived)
                self.first_token_ns = time.time_ns()
            else:
                self.worker.samples.itl.append(now - self.last_token_at)
                ITL.observe(now - self.last_token_at)
            self.last_token_at = now
        self.finished = event.finished
        return event

    async def _end(self, last: TokenEvent) -> tuple[list[int], int]:
        """The stage ended: its KV goes to the next stage's worker, which may start once it is in
        place, or stays here for a lazy pull (Cancel(request_id) frees it); the blocks and
        tokens held for that pull (none otherwise)."""
        record_stage_phases(self.span, self.arrived_ns, self.queue_wait_s, self.first_token_ns, time.time_ns(),
                            last.num_output_tokens)
        spec = self.spec
        if spec.sink is not None:
            pushing = time.time_ns()
            await self.worker.kv.finish_push(self.key, completed=last.finish_reason == "stage_end")
            record_interval("worker.kv_push", self.span, pushing, time.time_ns(),
                            {"splitserve.sink_worker": spec.sink.worker_id})
            return [], 0
        if spec.keep_kv:
            key = self.key
            return await self.worker.loop.call(lambda engine: engine.kv_blocks(key))
        return [], 0

    def _abort(self) -> None:
        self.worker.loop.abort(self.key)
        if self.spec is not None and self.spec.sink is not None:
            asyncio.ensure_future(self.worker.kv.finish_push(self.key, completed=False))
        STAGES.labels("abort").inc()
        self.span.set_attribute("splitserve.finish_reason", "abort")


def _refusal(err: ValueError) -> Exception:
    """The engine's refusal of a stage as the caller's error, by its type (never its message)."""
    if isinstance(err, StageBusy):  # an earlier attempt still runs here: retry elsewhere
        return Unavailable(str(err))
    if isinstance(err, InvalidInput):
        return service_error(err)
    # An engine that does not type its refusals: the stage as a whole is at fault.
    return InvalidArgument(str(err), param="stage")


def merge_pending(event: TokenEvent, events: asyncio.Queue) -> TokenEvent:
    """One event for everything already queued: a stream that fell behind catches up in one message."""
    token_ids, text, logprobs = list(event.token_ids), event.text, list(event.logprobs)
    prompt_start, prompt_logprobs = event.prompt_logprobs_start, list(event.prompt_logprobs)
    while not event.finished and not events.empty():
        event = events.get_nowait()
        token_ids += event.token_ids
        text += event.text
        logprobs += event.logprobs  # one per token where the request asked: they stay aligned
        if event.prompt_logprobs:  # scored positions: the later ones win where they overlap
            if prompt_start + len(prompt_logprobs) >= event.prompt_logprobs_start >= prompt_start:
                del prompt_logprobs[event.prompt_logprobs_start - prompt_start:]
            else:
                prompt_start, prompt_logprobs = event.prompt_logprobs_start, []
            prompt_logprobs += event.prompt_logprobs
    return TokenEvent(event.key, token_ids, text, event.finish_reason, event.num_prompt_tokens,
                      event.num_output_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      prompt_logprobs_start=prompt_start)


def record_stage_phases(span, arrived_ns: int, queue_wait_s: float | None, first_token_ns: int, end_ns: int,
                        output_tokens: int) -> None:
    """The stage's phases as child spans: queue wait (arrival to first scheduled, as the engine
    measured it), prefill (to the first token, or to the end of a prefill-only stage) and decode."""
    scheduled_ns = arrived_ns + int((queue_wait_s or 0.0) * 1e9)
    if queue_wait_s is not None:
        record_interval("worker.queue", span, arrived_ns, scheduled_ns)
    prefilled_ns = first_token_ns or end_ns
    record_interval("worker.prefill", span, scheduled_ns, prefilled_ns)
    if first_token_ns and end_ns > first_token_ns:
        record_interval("worker.decode", span, first_token_ns, end_ns, {"gen_ai.usage.output_tokens": output_tokens})
