"""What the HTTP and gRPC APIs share: limits, tokenizer, auth, admission, sessions, the coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from pathlib import Path
from typing import AsyncIterator

from gateway import metrics
from gateway.admission import Admission
from gateway.coordinator_client import CoordinatorClient, GenerationDelta
from gateway.rate_limit import KeyRateLimiter
from gateway.tokenization import Tokenization
from gateway.validation import GenerationRequest, Limits
from splitserve.config import GatewayConfig
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from splitserve.errors import DeadlineExceeded, SplitserveError, Unauthenticated
from splitserve.telemetry import end_span, span_context, start_span


def served_model_name(config: GatewayConfig) -> str:
    """The model id clients send: served_model_name, else the model directory's name."""
    return config.served_model_name or Path(config.model).name


class GatewayCore:
    """One gateway's shared state and the admitted, measured generation path."""

    def __init__(self, config: GatewayConfig, tokenization: Tokenization, coordinator: CoordinatorClient,
                 rate_limiter: KeyRateLimiter | None = None):
        self.config = config
        self.tokenization = tokenization
        self.coordinator = coordinator
        self.model_name = served_model_name(config)
        self.limits = Limits(served_model=self.model_name, max_model_len=config.max_model_len or tokenization.max_model_len,
                             default_max_tokens=config.default_max_tokens, max_tokens_limit=config.max_tokens_limit,
                             engine_family=tokenization.engine_family, mask_token_id=tokenization.mask_token_id)
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout_s)
        self.rate_limiter = rate_limiter if rate_limiter is not None and rate_limiter.enabled else None
        self.created = int(time.time())
        # config.py's `opt(list, ...)` leaves the `list` type itself as the default (not an
        # empty list), so anything but a real sequence means "no keys".
        self._api_keys = [k.encode() for k in config.api_keys if k]
        metrics.IN_FLIGHT.set_function(lambda: self.admission.in_flight)
        metrics.QUEUED.set_function(lambda: self.admission.queued)

    async def ready(self, timeout_s: float = 1.0) -> tuple[bool, str]:
        """Whether a request sent now would be served; (ready, why not)."""
        if not self.admission.admitting:
            return False, "draining"
        return await self.coordinator.ready(timeout_s, self.tokenization.engine_family)

    def authenticate(self, authorization: str | None) -> str:
        """Check an `Authorization: Bearer <key>` value when API keys are configured; the
        caller's owner id for per-key limits (a digest of the key; "" without keys)."""
        if not self._api_keys:
            return ""
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        candidate = key.strip().encode()
        # Compare against every key so timing does not reveal which one nearly matched.
        if not sum(hmac.compare_digest(candidate, k) for k in self._api_keys):
            raise Unauthenticated("invalid API key")
        return hashlib.sha256(candidate).hexdigest()[:24]  # never the key itself in Redis

    async def open_session(self, session_id: str, ttl_s: float, owner: str) -> tuple[str, float]:
        """Open a multi-turn session (its state lives in Redis; any gateway serves its rounds)."""
        return await self.coordinator.open_session(session_id, ttl_s, owner)

    async def close_session(self, session_id: str, owner: str) -> bool:
        return await self.coordinator.close_session(session_id, owner)

    async def generate(self, request: GenerationRequest, api: str, deadline: float | None = None,
                       trace_parent: Context | None = None, owner: str = "") -> AsyncIterator[GenerationDelta]:
        """Admit, run and measure one request; `deadline` is on the loop clock (covers queueing).
        Traced as `gateway.request` under the caller's W3C trace context, if it sent one."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        status = "ok"
        finished = False
        error: BaseException | None = None
        span = start_span("gateway.request", trace_parent, kind=SpanKind.SERVER, attributes={
            "splitserve.request_id": request.request_id, "splitserve.api": api, "gen_ai.request.model": self.model_name,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "gen_ai.request.max_tokens": request.max_tokens})
        completion_tokens = 0
        try:
            if self.rate_limiter is not None:  # per API key, before it takes a slot
                await self.rate_limiter.check(owner, len(request.prompt_token_ids) + request.max_tokens)
            async with self.admission.slot():
                metrics.QUEUE_WAIT.observe(loop.time() - arrived)
                span.add_event("admitted")
                timeout_s = None
                if deadline is not None:
                    timeout_s = deadline - loop.time()
                    if timeout_s <= 0:
                        raise DeadlineExceeded("deadline exceeded while waiting for admission")
                metrics.PROMPT_TOKENS.inc(len(request.prompt_token_ids))
                last = None
                # aclosing: when our consumer closes us, the upstream call is cancelled now, not at GC.
                deltas = self.coordinator.generate(request, timeout_s, trace_context=span_context(span))
                async with contextlib.aclosing(deltas):
                    async for delta in deltas:
                        now = loop.time()
                        if last is None:
                            span.add_event("first_token")
                        (metrics.TTFT if last is None else metrics.ITL).observe(now - (last or arrived))
                        last = now
                        completion_tokens = delta.completion_tokens
                        metrics.COMPLETION_TOKENS.inc(len(delta.token_ids))
                        finished = bool(delta.finish_reason)
                        yield delta
        except SplitserveError as err:
            status, error = err.code.name.lower(), err
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # A consumer that stops reading after the last delta has not cancelled anything.
            status = "ok" if finished else "cancelled"
            raise
        except Exception as err:
            status, error = "internal", err
            raise
        finally:
            metrics.REQUESTS.labels(api, status).inc()
            metrics.E2E.observe(loop.time() - arrived)
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
            span.set_attribute("splitserve.status", status)
            end_span(span, error)
