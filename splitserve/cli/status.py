"""`splitserve status`: workers, roles, load and windowed TTFT/ITL, read from Redis."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def status(
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", envvar="SPLITSERVE_REDIS_URL"),
    redis_prefix: str = typer.Option("ss:", envvar="SPLITSERVE_REDIS_PREFIX"),
    window_s: float = typer.Option(10.0, help="Latency window."),
) -> None:
    """Workers, roles, load and windowed TTFT/ITL, read from Redis."""
    import asyncio

    from splitserve.state.store import RedisRetryPolicy, StateStore, StateUnavailableError

    async def read():
        async with StateStore(redis_url, redis_prefix, retry_policy=RedisRetryPolicy(attempts=2)) as store:
            workers = await store.list_workers()
            loads = await store.get_loads()
            windows = {}
            for w in workers:
                windows[w.worker_id] = (await store.window_stats(w.worker_id, "ttft", window_s=window_s),
                                        await store.window_stats(w.worker_id, "itl", window_s=window_s))
            return workers, loads, windows, await store.get_restarts()

    try:
        workers, loads, windows, restarts = asyncio.run(read())
    except StateUnavailableError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    table = Table("worker", "address", "role", "pool", "L_m", "busy", "kind", "KV used", "running", "waiting",
                  "queued prefill", f"TTFT p50/p99 ms ({window_s:.0f}s)", "ITL p50/p99 ms", "restarts")
    for w in sorted(workers, key=lambda w: w.worker_id):
        load = loads.get(w.worker_id)
        ttft, itl = windows[w.worker_id]
        used = f"{load.total_blocks - load.free_blocks}/{load.total_blocks}" if load else "-"
        # L_m: LAPS' short/long boundary (new tokens, no history) by the worker's laps batch policy.
        l_m = "-" if not load or not load.length_boundary else \
            "inf" if load.length_boundary < 0 else f"{load.length_boundary:.0f}"
        table.add_row(w.worker_id, w.address, load.role if load else w.role, (load.pool or "-") if load else "-",
                      l_m, f"{load.busy_fraction:.0%}" if load else "-", w.engine_kind, used,
                      str(load.running) if load else "-", str(load.waiting) if load else "-",
                      str(load.queued_prefill_tokens) if load else "-",
                      f"{ttft.p50 * 1e3:.1f}/{ttft.p99 * 1e3:.1f} (n={ttft.count})",
                      f"{itl.p50 * 1e3:.1f}/{itl.p99 * 1e3:.1f} (n={itl.count})", str(restarts.get(w.worker_id, 0)))
    console.print(table if workers else f"no live workers under prefix {redis_prefix!r} at {redis_url}")
    others = {name: n for name, n in restarts.items() if name not in {w.worker_id for w in workers}}
    if others:  # services other than live workers that `splitserve up` restarted
        console.print("restarted by splitserve up: " + ", ".join(f"{n} x {name}" for name, n in sorted(others.items())))
