"""The serving core: what a worker's step runs, decided once for every driver.

Pure (no torch, gRPC or Redis; the clock is injected): the real engine
(`workers.engine.Engine`), the emulated engine and the simulator's workers
(`services.planner`) are thin drivers over it. docs/architecture.md describes the
contract; `splitserve.core.scheduler` is where to start reading.
"""

from splitserve.core.block_manager import BlockManager
from splitserve.core.decode_run import DecodeRun
from splitserve.core.errors import InvalidInput, StageKeyTaken
from splitserve.core.policies import (FcfsPolicy, LatencyTable, SloAwarePolicy, build_batch_policy,
                                      known_batch_policies, make_batch_policy, register_batch_policy, takes_option,
                                      unregister_batch_policy)
from splitserve.core.policy import (BatchPolicy, ExecutedBatch, PolicyContractError, QueuedRequest, StepBudget,
                                    StepBuilder)
from splitserve.core.sampling import SamplingParams
from splitserve.core.scheduler import (KvCapacityError, ScheduledEntry, Scheduler, SchedulerConfig, SchedulerOutput,
                                       TokenEvent)
from splitserve.core.sequence import FinishReason, OutputConstraint, OutputText, Sequence, SequenceStatus, StageKey
from splitserve.core.stage import KvInBlocks, KvPayload, KvPushPlan, KvSink, StageSlo, StageSpec, whole_block_chunk
from splitserve.core.step_cost import StepShape, step_time

__all__ = [
    "BatchPolicy", "BlockManager", "DecodeRun", "FcfsPolicy", "ExecutedBatch", "LatencyTable", "SloAwarePolicy",
    "build_batch_policy", "takes_option", "FinishReason", "InvalidInput", "KvCapacityError", "KvInBlocks",
    "KvPayload", "KvPushPlan", "KvSink", "OutputConstraint", "OutputText", "PolicyContractError", "QueuedRequest", "SamplingParams",
    "ScheduledEntry", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Sequence", "SequenceStatus", "StageKey",
    "StageKeyTaken", "StageSlo", "StageSpec", "StepBudget", "StepBuilder", "StepShape", "TokenEvent", "known_batch_policies",
    "make_batch_policy", "register_batch_policy", "step_time", "unregister_batch_policy", "whole_block_chunk",
]
