"""Small pure pieces of the control plane: token merging, thread count, embedded-coordinator env."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.config import CoordinatorConfig, load_config
from splitserve.cli.launcher import coordinator_environment
from workers.engine.engine import TokenEvent
from workers.server import resolve_num_threads
from workers.stage_call import merge_pending as _merge_pending


def _event(tokens, finish=None, n_out=0):
    return TokenEvent("r/0", list(tokens), "".join(chr(97 + t % 26) for t in tokens), finish, 5, n_out)


@given(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=3), min_size=1, max_size=8),
       st.integers(0, 7), st.booleans())
def test_merged_events_carry_every_queued_token_in_order(batches, finish_index, finish):
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        finish_at = min(finish_index, len(batches) - 1) if finish else None
        produced = 0
        for i, tokens in enumerate(batches):
            produced += len(tokens)
            queue.put_nowait(_event(tokens, "stop" if i == finish_at else None, produced))
        first = queue.get_nowait()
        merged = _merge_pending(first, queue)
        last = finish_at if finish_at is not None else len(batches) - 1
        expected = [t for tokens in batches[: last + 1] for t in tokens]
        assert merged.token_ids == expected
        assert merged.text == "".join(chr(97 + t % 26) for t in expected)
        assert merged.num_output_tokens == len(expected)
        assert merged.finish_reason == ("stop" if finish_at is not None else None)
        # Nothing after the finishing event is consumed: it belongs to nobody's stream.
        assert queue.qsize() == len(batches) - 1 - last
    asyncio.run(scenario())


def test_num_threads_auto_leaves_a_core_for_the_event_loop():
    assert resolve_num_threads(3) == 3
    assert resolve_num_threads(0) == max(1, len(os.sched_getaffinity(0)) - 1)


def test_embedded_coordinator_environment_round_trips_through_load_config():
    env = coordinator_environment({"placement": "local", "policy": "split", "split_ratio": 0.25,
                                   "kv_chunk_tokens": 8, "redis_url": "redis://x:1/0", "not_a_field": 3})
    assert "SPLITSERVE_REDIS_URL" not in env  # common options reach the gateway as its own flags
    config = load_config(CoordinatorConfig, environ=env)
    assert (config.placement, config.policy, config.split_ratio, config.kv_chunk_tokens) == ("local", "split", 0.25, 8)


def test_unknown_coordinator_topology_is_rejected(tmp_path):
    from splitserve.cli.launcher import ClusterSpec, start_cluster

    with pytest.raises(ValueError, match="coordinator must be process or embedded"):
        start_cluster(ClusterSpec(model=str(tmp_path), coordinator="sideways", redis_url="redis://127.0.0.1:6379/0"))


def test_a_worker_bound_to_every_address_advertises_one_peers_can_dial():
    import socket

    from workers.server import dialable_host

    assert dialable_host("10.1.2.3") == "10.1.2.3" and dialable_host("127.0.0.1") == "127.0.0.1"
    own = dialable_host("0.0.0.0")
    assert own not in ("0.0.0.0", "") and socket.inet_aton(own)  # an IPv4 address of this host
    assert dialable_host("::") == own


def test_up_shares_the_cores_among_its_workers_and_keeps_none_back():
    from splitserve.cli.launcher import threads_per_worker

    assert threads_per_worker(2, 1) == 2
    assert threads_per_worker(8, 3) == 2
    assert threads_per_worker(2, 4) == 1  # never zero threads
    assert threads_per_worker(1, 0) == 1


def test_up_places_in_the_coordinator_except_for_laps():
    from splitserve.cli.launcher import default_placement

    assert default_placement("least_loaded") == "local"
    assert default_placement("dynaserve") == "local"
    assert default_placement("laps") == "scheduler"
