"""`splitserve serve scheduler --design NAME` (or `SPLITSERVE_DESIGN`) places with the design's
placement policy unless `--policy` names another: the real service, real gRPC and Redis."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from services.global_scheduler.server import start_scheduler
from splitserve.config import SchedulerConfig, load_config
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc

REDIS_URL = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.mark.parametrize("options, environ, policy", [
    ({"design": "dynaserve"}, {}, "dynaserve"),
    ({}, {"SPLITSERVE_DESIGN": "ampd"}, "ampd"),
    ({"design": "dynaserve", "policy": "round_robin"}, {}, "round_robin"),  # an ablation, explicit
    ({}, {}, "least_loaded"),
])
def test_the_scheduler_places_with_the_designs_policy(prefix, options, environ, policy):
    values = dict(redis_url=REDIS_URL, redis_prefix=prefix, port=0, metrics_port=0, host="127.0.0.1",
                  view_refresh_s=0.02, log_json=False, redis_connect_attempts=2, **options)

    async def scenario():
        handle = await start_scheduler(load_config(SchedulerConfig, values, environ=environ))
        try:
            async with grpc.aio.insecure_channel(handle.address) as channel:
                state = await scheduler_pb2_grpc.GlobalSchedulerStub(channel).ClusterState(
                    scheduler_pb2.ClusterStateRequest(), timeout=5)
            return state.policy
        finally:
            await handle.stop(grace_s=0)

    assert asyncio.run(scenario()) == policy


def test_an_unknown_design_stops_the_start_naming_it(prefix):
    config = load_config(SchedulerConfig, dict(redis_url=REDIS_URL, redis_prefix=prefix, port=0, metrics_port=0,
                                               log_json=False, design="dyna"), environ={})
    with pytest.raises(ValueError, match="design must be one of ampd, dynaserve, laps"):
        asyncio.run(start_scheduler(config))
