"""The workload: request cases with known outputs, sent with retries through the SDK."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from loadgen.plan import BenchRequest, StreamedResult
from loadgen.targets import synthetic_text
from splitserve.cli.chaos.options import ChaosOptions


# ---- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosCase:
    """A distinct request: every request of the run repeats one case, so all its outputs must be equal."""

    key: str
    prompt: str
    max_tokens: int
    temperature: float  # 0: greedy
    seed: int | None  # the sampled cases' fixed seed


def make_cases(options: ChaosOptions, rng: np.random.Generator) -> list[ChaosCase]:
    """The run's distinct cases: seeded prompts of random common words, greedy or seeded sampled."""
    sampled = round(options.cases * options.sampled_fraction)
    cases = []
    for i in range(options.cases):
        words = int(rng.integers(options.prompt_words[0], options.prompt_words[1] + 1))
        prompt = f"case {i}: " + synthetic_text(rng.integers(0, 1 << 16, size=words).tolist())
        max_tokens = int(rng.integers(options.max_tokens[0], options.max_tokens[1] + 1))
        is_sampled = i < sampled
        cases.append(ChaosCase(f"c{i}-{'sampled' if is_sampled else 'greedy'}", prompt, max_tokens,
                               options.temperature if is_sampled else 0.0,
                               int(rng.integers(0, 1 << 31)) if is_sampled else None))
    return cases


@dataclass
class AttemptError:
    """One failed attempt of a request."""

    attempt: int
    code: str
    message: str
    at_s: float
    tokens_before: int  # tokens the attempt had streamed before it failed (> 0: a broken stream)


@dataclass
class RequestOutcome:
    """What one request went through."""

    request_id: str
    case: str
    arrival_s: float
    end_s: float = 0.0
    attempts: int = 0
    completed: bool = False
    matches: bool | None = None  # None: not completed or no reference
    mismatch: str | None = None  # what differs
    errors: list[AttemptError] = field(default_factory=list)

    @property
    def retried(self) -> bool:
        return self.attempts > 1


def _first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"{len(got)} tokens vs {len(want)} expected; first difference at position {at}: "
            f"got {list(got[at:at + 4])}, expected {list(want[at:at + 4])}")


class ChaosTarget:
    """A loadgen target over the gateway's gRPC API that retries retriable failures (each
    attempt a new request id) and checks each output against its case's reference."""

    kind = "grpc-chaos"

    def __init__(self, options: ChaosOptions, cases: Sequence[ChaosCase]):
        self.options = options
        self.cases = {case.key: case for case in cases}
        self.case_of: dict[str, str] = {}  # request id -> case key
        self.references: dict[str, list[int]] = {}
        self.outcomes: list[RequestOutcome] = []
        self.origin_s = time.perf_counter()
        self._client: Any = None

    def now(self) -> float:
        return time.perf_counter() - self.origin_s

    def _sdk(self):
        if self._client is None:
            from splitserve.client import AsyncClient

            # Retries are this target's, counted; the SDK's own are off.
            tls = self.options.gateway_tls.sdk_options() if self.options.gateway_tls else {}
            self._client = AsyncClient(self.options.target, api_key=self.options.api_key, max_retries=0, **tls)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def generate(self, request_id: str, case: ChaosCase) -> tuple[RequestOutcome, list[int] | None]:
        """Run one request of `case` to completion or to its last attempt."""
        from splitserve.client import RateLimitedError, SplitserveClientError

        outcome = RequestOutcome(request_id, case.key, self.now())
        tokens: list[int] | None = None
        reference = self.references.get(case.key)
        try:
            for attempt in range(1, self.options.max_attempts + 1):
                outcome.attempts = attempt
                got: list[int] = []
                try:
                    stream = self._sdk().stream(
                        case.prompt, max_tokens=case.max_tokens, temperature=case.temperature, seed=case.seed,
                        ignore_eos=True, request_id=f"{request_id}.a{attempt}",
                        timeout_s=self.options.attempt_timeout_s)
                    async for chunk in stream:
                        got.extend(chunk.token_ids)
                    tokens = got
                    break
                except RateLimitedError as err:
                    code, retry_after, message = err.code.name, err.retry_after_s, err.message
                except SplitserveClientError as err:
                    code, retry_after, message = err.code.name, None, err.message
                except Exception as err:  # noqa: BLE001 -- a client-side failure is recorded, not raised
                    code, retry_after, message = "CLIENT_ERROR", None, f"{type(err).__name__}: {err}"
                outcome.errors.append(AttemptError(attempt, code, message[:300], round(self.now(), 3), len(got)))
                if got and reference is not None and got != reference[:len(got)]:
                    # Tokens that reached the client before the break are already wrong.
                    outcome.mismatch = f"attempt {attempt} streamed wrong tokens before failing: " + \
                        _first_difference(got, reference[:len(got)])
                if code not in self.options.retriable or attempt == self.options.max_attempts:
                    break
                backoff = min(self.options.backoff_s * 2 ** (attempt - 1), 4.0)
                # The server's Retry-After when it gave one (overload), else exponential backoff.
                await asyncio.sleep(min(retry_after, 10.0) if retry_after else backoff)
        except asyncio.CancelledError:
            outcome.errors.append(AttemptError(outcome.attempts, "CUT_OFF", "cut off at the run's time limit",
                                               round(self.now(), 3), 0))
            tokens = None
        outcome.end_s = self.now()
        outcome.completed = tokens is not None
        if tokens is not None and reference is not None:
            outcome.matches = tokens == reference and outcome.mismatch is None
            if tokens != reference:
                outcome.mismatch = _first_difference(tokens, reference)
        elif tokens is not None and len(tokens) != case.max_tokens:
            outcome.mismatch = f"{len(tokens)} tokens, expected {case.max_tokens} (ignore_eos)"
        return outcome, tokens

    async def send(self, request: BenchRequest) -> StreamedResult:
        """The loadgen Target interface: one request of the case its id was planned with."""
        case = self.cases[self.case_of[request.request_id]]
        outcome, tokens = await self.generate(request.request_id, case)
        self.outcomes.append(outcome)
        ok = outcome.completed and outcome.mismatch is None
        error = None if ok else (outcome.mismatch or (outcome.errors[-1].code if outcome.errors else "failed"))
        return StreamedResult(request.request_id, None, 0, outcome.arrival_s, None, [], outcome.end_s, 0,
                              len(tokens or ()), ok, error, list(tokens or ()))
