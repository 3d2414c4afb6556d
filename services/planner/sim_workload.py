"""What the simulator serves: `splitserve bench` workloads as lengths, and token ids made on demand.

`build_sim_workload` reads the same options as `splitserve bench` (`BenchOptions`) with
the same loadgen functions and seeds, so a simulation and a benchmark of one option set
see the same request lengths, sessions and arrival offsets. Unlike `bench` it draws no
random prompt tokens up front (an hour of the Mooncake trace is 149M tokens): prompts are
made when a request starts, from runs of one id per prefix block, which is all the
prefix cache looks at:

* a Mooncake block with hash id h is `block_tokens` copies of the id `BLOCK_ID_BASE + h`,
  so equal hash ids are equal tokens and give real prefix-cache hits;
* everything else is request-unique: copies of `UNIQUE_ID_BASE + n` for the n-th prompt;
* a session round's prompt is the previous round's prompt and output (the simulated
  output ids are all `FAKE_TOKEN_ID`) followed by its own fresh tokens, as `bench` sends.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Union

import numpy as np

from loadgen.arrivals import ArrivalProcess
from loadgen.bench_config import DEFAULT_SHAPE, BenchOptions, Workload, build_workload, resolve_arrival
from loadgen.sessions import Session, generate_sessions, parse_tool_delay
from loadgen.traces import TraceRequest, limit, read_trace, scale_lengths
from loadgen.workloads import RequestShape, parse_shapes

__all__ = ["SimRequestSpec", "SimItem", "SimWorkload", "PromptIds", "build_sim_workload", "requests_from_shapes",
           "requests_from_trace", "BLOCK_ID_BASE", "UNIQUE_ID_BASE"]

BLOCK_ID_BASE = 1 << 32
UNIQUE_ID_BASE = 1 << 48


@dataclass(frozen=True, slots=True)
class SimRequestSpec:
    """One request to simulate: lengths and, for Mooncake rows, its prefix blocks."""

    request_id: str
    prompt_len: int
    output_len: int
    prefix_block_ids: tuple[int, ...] = ()
    block_tokens: int = 0
    # The client's output-length hint sent with the request (PlacementRequest.predicted_output_len,
    # as `bench` sends one); None: no hint, a policy that needs one predicts it.
    predicted_output_len: int | None = None


SimItem = Union[SimRequestSpec, Session]


@dataclass
class SimWorkload:
    """Items (requests or sessions), the arrival process, and the bench workload description.

    `items` are what one run sends (`workload.count` of them); `make_items(count)` makes
    `count` for a rate probe (a trace: at most `workload.max_count`).
    """

    items: list[SimItem]
    arrival: ArrivalProcess | None
    workload: Workload
    make_items: Callable[[int], list[SimItem]] | None = None

    @property
    def num_requests(self) -> int:
        """Requests in all items (a session counts its rounds)."""
        return sum(len(i.rounds) if isinstance(i, Session) else 1 for i in self.items)


def requests_from_shapes(shapes: list[RequestShape], n: int, id_prefix: str = "req") -> list[SimRequestSpec]:
    """`n` requests cycling through `shapes` (as `loadgen.plan.requests_from_shapes` orders them)."""
    if not shapes:
        raise ValueError("shapes: need at least one request shape")
    return [SimRequestSpec(f"{id_prefix}-{i}", s.prompt_len, s.output_len)
            for i, s in ((i, shapes[i % len(shapes)]) for i in range(n))]


def requests_from_trace(rows: list[TraceRequest], id_prefix: str = "req") -> list[SimRequestSpec]:
    """One request per trace row, keeping Mooncake prefix blocks."""
    specs = []
    for i, row in enumerate(rows):
        if row.output_len < 1 or row.prompt_len < 1:
            raise ValueError(f"trace row {i}: prompt and output lengths must be >= 1 (scale with min 1)")
        specs.append(SimRequestSpec(f"{id_prefix}-{i}", row.prompt_len, row.output_len, row.prefix_block_ids,
                                    row.block_tokens))
    return specs


def build_sim_workload(opts: BenchOptions) -> SimWorkload:
    """The workload and arrival process `splitserve bench` would run for `opts`, without token ids."""
    workload = build_workload(opts)  # validates the options and describes the workload as bench does
    arrival = resolve_arrival(opts, workload)
    make: Callable[[int], list[SimItem]]
    if workload.kind == "sessions":
        tool_delay = parse_tool_delay(opts.tool_delay)

        def make(count: int) -> list[SimItem]:
            return list(generate_sessions(opts.sessions, count, np.random.default_rng([opts.seed, 0]),
                                          length_scale=opts.length_scale, tool_delay=tool_delay))
    elif workload.kind == "trace":
        all_rows = scale_lengths(read_trace(opts.trace), opts.length_scale)

        def make(count: int) -> list[SimItem]:
            return list(requests_from_trace(limit(all_rows, n=count)))
    else:
        shapes = [s.scaled(opts.length_scale) if opts.length_scale != 1.0 else s
                  for spec in (opts.shapes or [DEFAULT_SHAPE]) for s in parse_shapes(spec)]

        def make(count: int) -> list[SimItem]:
            return list(requests_from_shapes(shapes, count))
    return SimWorkload(make(workload.count), arrival, workload, make)


class PromptIds:
    """Makes prompt token ids on demand (see the module docstring)."""

    def __init__(self) -> None:
        self._unique: Iterator[int] = itertools.count(UNIQUE_ID_BASE)

    def fresh(self, n: int) -> list[int]:
        """`n` tokens no other prompt shares."""
        return [next(self._unique)] * n

    def for_request(self, spec: SimRequestSpec) -> list[int]:
        """Exactly `spec.prompt_len` ids: its prefix blocks in order, then fresh ids."""
        ids: list[int] = []
        if spec.block_tokens > 0:
            for hash_id in spec.prefix_block_ids:
                if len(ids) >= spec.prompt_len:
                    break
                ids += [BLOCK_ID_BASE + hash_id] * spec.block_tokens
            del ids[spec.prompt_len:]
        return ids + self.fresh(spec.prompt_len - len(ids))

    def for_round(self, history: list[int], incr_prompt_len: int) -> list[int]:
        """A session round's prompt: the whole history, then the round's new tokens."""
        return history + self.fresh(incr_prompt_len)
