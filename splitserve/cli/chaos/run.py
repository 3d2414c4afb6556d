"""`splitserve chaos`: kill services of a running local cluster on a seeded schedule while the
load generator sends requests whose outputs are known, and report what the clients saw.

Against a cluster started by `splitserve up` (which restarts a service that dies), it:

1. finds the cluster's processes: every service runs ``... splitserve.cli serve <service>
   --redis-prefix <prefix> ...`` (a worker also ``--worker-id <id>``), so the prefix names
   them; only processes of this user are considered;
2. sends each distinct request case once on the quiet cluster: its output is the reference
   (greedy cases and sampled cases with a fixed seed are deterministic, and ``ignore_eos``
   fixes the length);
3. runs open-loop Poisson traffic over those cases with the load generator's runner and,
   meanwhile, a seeded schedule of faults: SIGKILL of a worker (a random live one), of the
   coordinator, or of Redis (restarted by `splitserve up` when it started that Redis itself,
   else by this command); after each fault it waits until the service is back (a new process,
   SERVING, a worker registered again) before the next one, so at most one is down at a time;
4. reports every request as completed at the first try, completed after retries, or
   failed, every completed output that differs from its case's reference (a mismatch:
   corrupted, duplicated or missing tokens), every stream that broke after tokens had
   arrived, the faults with how many requests were running on the victim, and the restarts
   `splitserve up` recorded in Redis — as a rich table and JSON.

Bounds: at most ``worker_kills + coordinator_kills + redis_kills`` faults, traffic for
``duration_s``, then at most ``drain_timeout_s`` for the requests still running; every
attempt has its own deadline (``attempt_timeout_s``: a hang is a DEADLINE_EXCEEDED), and a
request has at most ``max_attempts``. Traffic goes to 127.0.0.1 only: a gateway or Redis
address that is not a loopback address is refused.

Killing Redis is refused unless every key in it belongs to this cluster's prefix (a Redis
shared with other clusters or other people is not this command's to kill).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from loadgen.arrivals import PoissonArrivals
from loadgen.plan import BenchRequest
from loadgen.runner import RunProgress, run_benchmark
from splitserve.cli.chaos.faults import Faults, plan_faults
from splitserve.cli.chaos.options import COORDINATOR, REDIS, WORKER, ChaosError, ChaosOptions
from splitserve.cli.chaos.processes import find_redis_process, find_service_processes
from splitserve.cli.chaos.report import ChaosReport
from splitserve.cli.chaos.traffic import ChaosCase, ChaosTarget, RequestOutcome, make_cases


# ---- the run --------------------------------------------------------------------------------


async def _restarts(options: ChaosOptions) -> dict[str, int] | None:
    from splitserve.state.store import RedisRetryPolicy, StateStore

    try:
        async with StateStore(options.redis_url, options.redis_prefix,
                              retry_policy=RedisRetryPolicy(attempts=3)) as store:
            return await asyncio.wait_for(store.get_restarts(), 5.0)
    except Exception:  # noqa: BLE001 -- informational (None: Redis did not answer)
        return None


async def run_chaos_async(options: ChaosOptions, log: Callable[[str], None] = lambda line: None) -> ChaosReport:
    """The whole run: find the cluster, take the references, traffic plus faults, the report."""
    started_unix = time.time()
    wall0 = time.perf_counter()
    services = await asyncio.to_thread(find_service_processes, options.redis_prefix)
    kinds = {s.service for s in services}
    if not services:
        raise ChaosError(f"no service process of a cluster with Redis prefix {options.redis_prefix!r} runs here "
                         f"(started by `splitserve up --redis-prefix ...`?)")
    if options.worker_kills and WORKER not in kinds:
        raise ChaosError("the cluster has no worker process to kill")
    if options.coordinator_kills and COORDINATOR not in kinds:
        raise ChaosError("the cluster has no coordinator process (embedded in the gateway?): "
                         "--coordinator-kills needs `splitserve up --coordinator process`")
    if options.redis_kills:
        await asyncio.to_thread(find_redis_process, options.redis_url, options.redis_prefix)  # refuses early
    log(f"cluster {options.redis_prefix!r}: " + ", ".join(f"{s.name} (pid {s.pid})" for s in services))

    rng = np.random.default_rng(options.seed)
    cases = make_cases(options, rng)
    target = ChaosTarget(options, cases)
    restarts_before = await _restarts(options)
    try:
        for case in cases:  # the references, one at a time on the quiet cluster
            outcome, tokens = await target.generate(f"chaos-{options.seed}-ref-{case.key}", case)
            if tokens is None or outcome.mismatch is not None:
                last = outcome.errors[-1] if outcome.errors else None
                raise ChaosError(f"the cluster did not answer case {case.key} before any fault: "
                                 f"{outcome.mismatch or (f'{last.code}: {last.message}' if last else 'no output')}")
            target.references[case.key] = tokens
        log(f"references: {len(cases)} cases ({sum(c.seed is not None for c in cases)} sampled with a fixed seed)")

        n = max(1, round(options.rate * options.duration_s))
        picks = rng.integers(0, len(cases), size=n)
        requests = []
        for i, pick in enumerate(picks):
            request_id = f"chaos-{options.seed}-{i}"
            target.case_of[request_id] = cases[int(pick)].key
            requests.append(BenchRequest(request_id, [], cases[int(pick)].max_tokens))
        offsets = PoissonArrivals(options.rate).offsets(n, rng)
        offsets = offsets[offsets < options.duration_s]
        requests = requests[:len(offsets)]
        plan = plan_faults(options, rng)
        latest: list[RunProgress] = []
        run_t0 = time.perf_counter()
        faults = Faults(options, rng, lambda: time.perf_counter() - run_t0,
                         lambda: latest[-1] if latest else None, log)

        def on_progress(state: RunProgress) -> None:
            if not latest:
                latest.append(state)

        fault_task = asyncio.create_task(faults.run(plan))
        try:
            await run_benchmark(target, requests, arrival=offsets, max_concurrency=options.max_concurrency,
                                duration_limit_s=options.duration_s + options.drain_timeout_s,
                                progress=on_progress)
        finally:
            if not fault_task.done():
                # Traffic ended (or the run was cut off) before the schedule did: bounded wait for
                # the fault in progress to recover, then stop.
                try:
                    await asyncio.wait_for(asyncio.shield(fault_task), options.recovery_timeout_s)
                except asyncio.TimeoutError:
                    fault_task.cancel()
        if fault_task.done() and not fault_task.cancelled() and fault_task.exception() is not None:
            raise fault_task.exception()
    finally:
        await target.aclose()
    restarts_after = await _restarts(options)
    return _report(options, started_unix, time.perf_counter() - wall0, cases, target.outcomes, faults,
                   restarts_before, restarts_after)


def _report(options: ChaosOptions, started_unix: float, wall_s: float, cases: Sequence[ChaosCase],
            outcomes: Sequence[RequestOutcome], faults: Faults, restarts_before: dict[str, int] | None,
            restarts_after: dict[str, int] | None) -> ChaosReport:
    completed = [o for o in outcomes if o.completed]
    mismatched = [o for o in outcomes if o.mismatch is not None]
    failed = [o for o in outcomes if not o.completed]
    attempt_errors: dict[str, int] = {}
    for o in outcomes:
        for e in o.errors:
            attempt_errors[e.code] = attempt_errors.get(e.code, 0) + 1
    problems = []
    if failed:
        problems.append(f"{len(failed)} of {len(outcomes)} requests failed")
    if mismatched:
        problems.append(f"{len(mismatched)} requests had output that differs from their case's reference")
    for record in faults.records:
        if record.error is not None:
            problems.append(f"fault {record.kind} at {record.planned_at_s:.1f} s: {record.error}")
    if restarts_after is None:
        problems.append("the restarts `splitserve up` recorded could not be read from Redis at the end")
    for name in {r.victim for r in faults.records if r.recovered and r.kind != REDIS} if restarts_after else ():
        killed = sum(1 for r in faults.records if r.victim == name and r.at_s is not None)
        counted = restarts_after.get(name, 0) - (restarts_before or {}).get(name, 0)
        if counted < killed:
            problems.append(f"{name} was killed {killed} times but `splitserve up` recorded {counted} restarts")
    return ChaosReport(
        options={k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(options).items()
                 if k != "api_key"},
        started_unix=round(started_unix, 3), wall_s=round(wall_s, 2), cases=len(cases), requests=len(outcomes),
        completed=len(completed), completed_first_try=sum(1 for o in completed if not o.retried),
        retried=sum(1 for o in outcomes if o.retried), completed_after_retry=sum(1 for o in completed if o.retried),
        failed=len(failed), mismatches=len(mismatched),
        broken_streams=sum(1 for o in outcomes for e in o.errors if e.tokens_before > 0),
        attempt_errors=dict(sorted(attempt_errors.items())), faults=faults.records,
        restarts_before=restarts_before, restarts_after=restarts_after,
        failures=[dataclasses.asdict(o) for o in outcomes if not o.completed or o.mismatch is not None][:50],
        redis_started_by_chaos=faults.spawned_redis, problems=problems)


def run_chaos(options: ChaosOptions, log: Callable[[str], None] = lambda line: None) -> ChaosReport:
    """Blocking form of :func:`run_chaos_async`."""
    return asyncio.run(run_chaos_async(options, log))
