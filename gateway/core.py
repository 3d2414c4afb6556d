"""What the HTTP and gRPC APIs share: limits, tokenizer, auth, admission, sessions, the coordinator."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from pathlib import Path
from typing import AsyncIterator

from prometheus_client import Counter

from gateway import metrics
from gateway.admission import Admission
from gateway.coordinator_client import CoordinatorClient, GenerationDelta
from gateway.priority_check import check_priority
from gateway.rate_limit import KeyRateLimiter, TokensTaken
from gateway.tokenization import Tokenization
from gateway.validation import GenerationRequest, Limits
from splitserve.config import GatewayConfig
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from splitserve.errors import DeadlineExceeded, Overloaded, SplitserveError, Unauthenticated
from splitserve.keys import ANONYMOUS, MAX_KEY_CHARS, WITHOUT_ID, Caller, KeyVerifier, Tenant, load_keys_file
from splitserve.telemetry import end_span, span_context, start_span

# Per tenant (a label only when API keys are configured: tenants come from the keys file, so
# the label's values are bounded by it; keys given with --api-keys are the tenant "default").
TENANT_REQUESTS = Counter("splitserve_gateway_tenant_requests_total", "Requests by tenant and final status",
                          ["tenant", "status"])
TENANT_TOKENS = Counter("splitserve_gateway_tenant_tokens_total", "Prompt and completion tokens by tenant",
                        ["tenant", "kind"])
log = logging.getLogger(__name__)

# Keys never seen before that need a slow hash (splitserve/keys.py: one entry for a key with a
# known id, every entry without an id otherwise; an unknown id is refused with none) are hashed
# off the event loop, one at a time per kind (with an id, without): a flood of wrong keys costs
# at most two cores, not the loop, and keys without an id never delay keys with one.
SLOW_VERIFICATIONS = 1
# Unseen keys waiting for that check, beyond which a request is refused at once (429): a
# flood of random keys must not queue every real, not yet cached key behind it without end.
MAX_WAITING_KEY_CHECKS = 64
# ... and per lane (one key id, or the entries without an id): tokens aimed at one lane
# cannot take every place in the queue, so keys of other lanes still get theirs.
MAX_WAITING_PER_LANE = 8


def served_model_name(config: GatewayConfig) -> str:
    """The model id clients send: served_model_name, else the model directory's name."""
    return config.served_model_name or Path(config.model).name


class GatewayCore:
    """One gateway's shared state and the admitted, measured generation path."""

    def __init__(self, config: GatewayConfig, tokenization: Tokenization, coordinator: CoordinatorClient,
                 rate_limiter: KeyRateLimiter | None = None, tenants: list[Tenant] | None = None):
        """`tenants`: the parsed --api-keys-file (read from config.api_keys_file when None)."""
        self.config = config
        # Keys first: a bad keys file stops the start naming it, before anything else is set up.
        if tenants is None:
            tenants = load_keys_file(config.api_keys_file) if config.api_keys_file else []
        plain = [k for k in config.api_keys if k] if isinstance(config.api_keys, (list, tuple)) else []
        self.keys = KeyVerifier(tenants, plain)
        self._slow_checks = asyncio.Semaphore(SLOW_VERIFICATIONS)  # keys with an id
        self._slow_checks_without_id = asyncio.Semaphore(SLOW_VERIFICATIONS)
        self._waiting_key_checks = 0
        self._waiting_by_lane: collections.Counter[str] = collections.Counter()
        self._give_backs: set[asyncio.Task] = set()  # unused tokens on their way back to the limiter
        self.tokenization = tokenization
        self.coordinator = coordinator
        self.model_name = served_model_name(config)
        check_priority(0, config.scheduling_policy)  # an unknown --scheduling-policy stops the start
        self.limits = Limits(served_model=self.model_name, max_model_len=config.max_model_len or tokenization.max_model_len,
                             default_max_tokens=config.default_max_tokens, max_tokens_limit=config.max_tokens_limit,
                             max_n=config.max_n,
                             engine_family=tokenization.engine_family, mask_token_id=tokenization.mask_token_id)
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout_s)
        self.rate_limiter = rate_limiter if rate_limiter is not None and rate_limiter.enabled else None
        self.created = int(time.time())
        metrics.IN_FLIGHT.set_function(lambda: self.admission.in_flight)
        metrics.QUEUED.set_function(lambda: self.admission.queued)

    async def ready(self, timeout_s: float = 1.0) -> tuple[bool, str]:
        """Whether a request sent now would be served; (ready, why not)."""
        if not self.admission.admitting:
            return False, "draining"
        return await self.coordinator.ready(timeout_s, self.tokenization.engine_family)

    def _presented_key(self, authorization: str | None) -> bytes | None:
        """The key of an `Authorization: Bearer <key>` value; None when no keys are configured."""
        if not self.keys.enabled:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        if len(key) > MAX_KEY_CHARS:
            raise Unauthenticated("invalid API key")
        return key.strip().encode()

    def authenticate(self, authorization: str | None) -> str:
        """Check an `Authorization: Bearer <key>` value when API keys are configured; the
        caller's owner id for sessions and rate limits ("" without keys). Blocking: a key not
        seen before is hashed here (see `authorize` for the event loop)."""
        return self._caller(self._presented_key(authorization)).owner

    def _caller(self, key: bytes | None) -> Caller:
        if key is None:
            return ANONYMOUS
        caller = self.keys.verify(key)
        if caller is None:
            raise Unauthenticated("invalid API key")  # never the key in a message or a log
        return caller

    async def authorize(self, authorization: str | None) -> Caller:
        """`authenticate` for the event loop: a known key (cached verdict) costs one HMAC, an
        unseen one whose verdict needs no slow hash (an unknown key id) a lookup; the rest are
        hashed in a thread, one at a time. The caller: tenant, owner id, limits."""
        key = self._presented_key(authorization)
        if key is None:
            return ANONYMOUS
        verdict = self.keys.cached(key)
        if verdict is None:
            lane = self.keys.slow_lane(key)
            verdict = (self.keys.verify(key) or False) if lane is None else await self._verify_unseen(key, lane)
        if verdict is False:
            raise Unauthenticated("invalid API key")
        return verdict

    async def _verify_unseen(self, key: bytes, lane: str) -> Caller | bool:
        """Hash an unseen key in a thread, SLOW_VERIFICATIONS at a time for keys with an id and
        as many for keys without, at most MAX_WAITING_KEY_CHECKS waiting, MAX_WAITING_PER_LANE of
        them for one `lane` (a key id, or WITHOUT_ID). A caller that leaves does not free its
        slot before its hash is done: the slot bounds the threads hashing, not the callers waiting."""
        if (self._waiting_key_checks >= MAX_WAITING_KEY_CHECKS
                or self._waiting_by_lane[lane] >= MAX_WAITING_PER_LANE):
            raise Overloaded("too many new API keys are being checked; retry shortly", retry_after_s=1.0)
        self._waiting_key_checks += 1
        self._waiting_by_lane[lane] += 1
        try:
            async with self._slow_checks_without_id if lane == WITHOUT_ID else self._slow_checks:
                verdict = self.keys.cached(key)  # another request may just have checked it
                if verdict is not None:
                    return verdict
                check = asyncio.ensure_future(asyncio.to_thread(self.keys.verify, key))
                try:
                    return await asyncio.shield(check) or False
                except asyncio.CancelledError:
                    await asyncio.wait([check])  # hold the slot until the thread is done
                    raise
        finally:
            self._waiting_key_checks -= 1
            self._waiting_by_lane[lane] -= 1
            if not self._waiting_by_lane[lane]:
                del self._waiting_by_lane[lane]

    async def open_session(self, session_id: str, ttl_s: float, owner: str) -> tuple[str, float]:
        """Open a multi-turn session (its state lives in Redis; any gateway serves its rounds)."""
        return await self.coordinator.open_session(session_id, ttl_s, owner)

    async def close_session(self, session_id: str, owner: str) -> bool:
        return await self.coordinator.close_session(session_id, owner)

    async def generate(self, request: GenerationRequest, api: str, deadline: float | None = None,
                       trace_parent: Context | None = None, owner: str = "",
                       caller: Caller | None = None) -> AsyncIterator[GenerationDelta]:
        """Admit, run and measure one request; `deadline` is on the loop clock (covers queueing).
        Traced as `gateway.request` under the caller's W3C trace context, if it sent one.
        `caller` (from `authorize`): its tenant labels the metrics and its limits apply;
        without it, `owner` alone (the gateway's default limits)."""
        check_priority(request.priority, self.config.scheduling_policy)  # 400 naming priority unless honoured
        caller = caller or Caller(owner=owner)
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        status = "ok"
        finished = False
        error: BaseException | None = None
        span = start_span("gateway.request", trace_parent, kind=SpanKind.SERVER, attributes={
            "splitserve.request_id": request.request_id, "splitserve.api": api, "gen_ai.request.model": self.model_name,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "gen_ai.request.max_tokens": request.max_tokens, "splitserve.tenant": caller.tenant})
        completion_tokens = 0
        taken: TokensTaken | None = None
        try:
            if self.rate_limiter is not None:  # per API key, before it takes a slot
                taken = await self.rate_limiter.check(caller.owner, len(request.prompt_token_ids) + request.max_tokens,
                                                      caller.limits, caller.tenant)
            async with self.admission.slot(request.priority):
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
            if taken is not None:
                self._give_back(taken, request.max_tokens - completion_tokens)
            metrics.REQUESTS.labels(api, status).inc()
            if caller.tenant:
                TENANT_REQUESTS.labels(caller.tenant, status).inc()
                TENANT_TOKENS.labels(caller.tenant, "prompt").inc(len(request.prompt_token_ids))
                TENANT_TOKENS.labels(caller.tenant, "completion").inc(completion_tokens)
            metrics.E2E.observe(loop.time() - arrived)
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
            span.set_attribute("splitserve.status", status)
            end_span(span, error)

    def _give_back(self, taken: TokensTaken, unused: int) -> None:
        """Return a finished request's unused output tokens to its bucket, in the background:
        the reply does not wait for Redis (nor for its retries while Redis is down)."""
        if unused <= 0 or self.rate_limiter is None:
            return
        try:
            task = asyncio.get_running_loop().create_task(self.rate_limiter.give_back(taken, unused))
        except RuntimeError:  # no loop: a generator finalised at interpreter exit
            log.debug("no event loop to give back %d unused tokens", unused)
            return
        self._give_backs.add(task)
        task.add_done_callback(self._given_back)

    def _given_back(self, task: asyncio.Task) -> None:
        self._give_backs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("giving back unused tokens failed: %r", task.exception())
