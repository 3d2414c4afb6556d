"""Per-API-key request and token rates, shared by every gateway replica (issue 18: overload).

Two token buckets per caller in Redis, as AIBrix and hosted APIs limit: requests per minute
and tokens per minute, a request's tokens being its prompt plus its `max_tokens` (what it may
cost, known before it runs). A bucket holds a minute's worth, so a quiet caller may burst up to
its per-minute limit. Both buckets are taken in one script (`StateStore.take_tokens`), all or
nothing: a request refused by one bucket takes nothing from the other. The buckets
refill by Redis's clock (`TIME`), never a gateway's, so replicas whose clocks disagree share
one budget exactly. When a request ends, the output it was charged for and did not generate
(`max_tokens` minus the tokens generated) goes back to the token bucket (`give_back`).
Over a limit: `Overloaded` (HTTP 429 / RESOURCE_EXHAUSTED) with the seconds until the
request would pass. A request larger than a whole minute's tokens could never pass: 400
naming the limit. Redis unreachable: the request is let through and counted
(`splitserve_gateway_rate_limit_unavailable_total`): a limiter outage must not stop serving
(and a give-back that cannot reach Redis is dropped, logged).

Tenants (`--api-keys-file`): the buckets of a tenant's keys are the tenant's (owner
`tenant:<name>`), sized by its own `requests_per_minute` / `tokens_per_minute` when the file
sets them, else by the gateway's defaults; 0 is no limit for that tenant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import Counter

from splitserve.errors import InvalidArgument, Overloaded
from splitserve.keys import TenantLimits
from splitserve.state.store import BucketTake, StateStore, StateUnavailableError

log = logging.getLogger(__name__)

LIMITED = Counter("splitserve_gateway_rate_limited_total", "Requests refused by a per-key rate limit", ["limit"])
UNAVAILABLE = Counter("splitserve_gateway_rate_limit_unavailable_total",
                      "Requests let through because the rate limiter's Redis did not answer")

ANONYMOUS = "anonymous"  # the caller when no API keys are configured: one bucket for all


@dataclass(frozen=True)
class TokensTaken:
    """What `KeyRateLimiter.check` took from a caller's token bucket, for `give_back`."""

    bucket: str
    tokens_per_minute: int
    tokens: int  # prompt + max_tokens


class KeyRateLimiter:
    """Requests and tokens per minute for each caller (the owner id `GatewayCore.authenticate`
    returns: a digest of its API key); 0 disables a limit."""

    def __init__(self, store: StateStore, requests_per_minute: int = 0, tokens_per_minute: int = 0,
                 tenant_limits: bool = False):
        """`tenant_limits`: some tenant has limits of its own (the limiter is on even when the
        defaults are 0)."""
        for name, value in (("rate_limit_requests_per_minute", requests_per_minute),
                            ("rate_limit_tokens_per_minute", tokens_per_minute)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {value}")
        self.store = store
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.tenant_limits = tenant_limits

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.tenant_limits)

    def limits_for(self, limits: TenantLimits | None) -> tuple[int, int]:
        """(requests, tokens) per minute for a caller with `limits` (None: the defaults)."""
        if limits is None:
            return self.requests_per_minute, self.tokens_per_minute
        return limits.resolve(self.requests_per_minute, self.tokens_per_minute)

    async def check(self, owner: str, tokens: int, limits: TenantLimits | None = None,
                    tenant: str = "") -> TokensTaken | None:
        """Take one request and `tokens` tokens from `owner`'s buckets (both or neither), or raise
        Overloaded. `limits`: the caller's tenant's own (None: the defaults); `tenant` names it in
        errors. What was taken from the token bucket (None: nothing), for `give_back`."""
        requests_per_minute, tokens_per_minute = self.limits_for(limits)
        whose = f"tenant {tenant}'s" if limits is not None and tenant else "this API key's"
        def setting(name: str) -> str:  # where the limit that applies was set
            own = limits is not None and getattr(limits, name) is not None
            return f"{name} in the API keys file" if own else f"--rate-limit-{name.replace('_', '-')}"
        if tokens_per_minute and tokens > tokens_per_minute:
            raise InvalidArgument(f"max_tokens: prompt + max_tokens = {tokens} tokens exceeds {whose} limit "
                                  f"of {tokens_per_minute} tokens per minute "
                                  f"({setting('tokens_per_minute')})", param="max_tokens")
        caller = owner or ANONYMOUS
        takes = [(limit, per_minute, BucketTake(f"{limit}:{caller}", per_minute / 60.0, float(per_minute),
                                                float(cost)))
                 for limit, per_minute, cost in (("requests", requests_per_minute, 1),
                                                 ("tokens", tokens_per_minute, tokens))
                 if per_minute and cost > 0]
        if not takes:
            return None
        try:
            allowed, retry_after_s, refused = await self.store.take_tokens([take for _, _, take in takes])
        except StateUnavailableError as err:
            UNAVAILABLE.inc()
            log.warning("rate limiter unavailable (%s); letting the request through", err)
            return None
        if not allowed:
            limit, per_minute, _ = takes[refused]
            LIMITED.labels(limit).inc()
            who = f"tenant {tenant} is" if limits is not None and tenant else "this API key is"
            raise Overloaded(f"{who} over its limit of {per_minute} {limit} per minute "
                             f"({setting(limit + '_per_minute')}); retry in {retry_after_s:.1f} s",
                             retry_after_s=max(retry_after_s, 0.001))
        return next((TokensTaken(take.key, per_minute, tokens) for limit, per_minute, take in takes
                     if limit == "tokens"), None)

    async def give_back(self, taken: TokensTaken, unused: int) -> None:
        """Return `unused` of the tokens `check` took (the output a request did not generate)."""
        amount = min(unused, taken.tokens)
        if amount <= 0:
            return
        per_minute = taken.tokens_per_minute
        try:
            await self.store.give_back_tokens(taken.bucket, per_minute / 60.0, float(per_minute), float(amount))
        except StateUnavailableError as err:
            log.warning("rate limiter unavailable (%s); %d unused tokens not given back", err, amount)
