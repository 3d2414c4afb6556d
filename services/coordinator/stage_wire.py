"""The Stage messages the coordinator sends to workers, built in one place from plain values.

The global scheduler's `Plan` says where each range of a request runs; the coordinator adds
what only it knows at run time — the request's tokens and sampling, the tokens emitted so
far, the KV reservation the next worker granted (`KvLink`), the session history a decode
worker lent (`LentHistory`, AMPD §3) and the session hold — and builds each outgoing
`Stage` from those values right before `Worker.Execute`. The scheduler's plan is never
changed in place: it stays what the scheduler decided (and what the request record shows).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.proto import coordinator_pb2, types_pb2


@dataclass(frozen=True)
class KvLink:
    """KV of tokens [start, end) that one stage's worker pushes, in chunks, into blocks the
    next stage's worker reserved for it (`Worker.PrepareKv`), DynaServe §4.3."""

    transfer_id: str
    from_worker: str
    to_worker: str
    start: int  # > 0: the receiver holds [0, start) already (a session's lent history)
    end: int
    block_ids: tuple[int, ...]  # the receiver's reserved blocks for [0, end)
    chunk_tokens: int


@dataclass(frozen=True)
class LentHistory:
    """A session's pinned history [0, num_tokens) that its decode worker lends to a prefill
    stage elsewhere, pulled lazily instead of recomputed (AMPD §3, remote incremental prefill)."""

    worker_id: str
    transfer_id: str
    num_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SessionHoldSpec:
    """Keep the last stage's KV pinned under the session when the round ends."""

    session_id: str
    ttl_s: int
    history_len: int  # tokens of history expected on that worker (0: none there yet)


def stage_message(planned: types_pb2.Stage, index: int, request: coordinator_pb2.SubmitRequest,
                  emitted: list[int], *, pushes: KvLink | None = None, receives: KvLink | None = None,
                  history: LentHistory | None = None, hold: SessionHoldSpec | None = None) -> types_pb2.Stage:
    """The Stage `Worker.Execute` gets for plan stage `index`: a new message, the plan untouched.

    `pushes`: this stage's KV goes to the next stage's worker; `receives`: this stage reads the
    previous stage's pushed KV; `history`: it pulls a session's lent history first."""
    stage = types_pb2.Stage()
    stage.CopyFrom(planned)
    stage.stage_index = index
    stage.prompt_token_ids[:] = request.prompt_token_ids
    stage.generated_token_ids[:] = emitted
    stage.sampling.CopyFrom(request.sampling)
    stage.slo.CopyFrom(request.slo)  # local policies schedule by the request's slack
    stage.priority = request.priority
    if history is not None:
        stage.kv_sources.append(types_pb2.KvSource(
            worker_id=history.worker_id, start=0, end=history.num_tokens, lazy=True,
            transfer_id=history.transfer_id, block_ids=history.block_ids))
    if receives is not None:
        stage.kv_sources.append(types_pb2.KvSource(worker_id=receives.from_worker, start=receives.start,
                                                   end=receives.end, transfer_id=receives.transfer_id))
    if pushes is not None:
        stage.kv_sink.CopyFrom(types_pb2.KvSink(worker_id=pushes.to_worker, transfer_id=pushes.transfer_id,
                                                chunk_tokens=pushes.chunk_tokens, block_ids=pushes.block_ids,
                                                start=pushes.start))
    if hold is not None:
        stage.session.CopyFrom(types_pb2.SessionHold(session_id=hold.session_id, ttl_s=hold.ttl_s,
                                                     history_len=hold.history_len))
    return stage


def migration_plan(plan: types_pb2.Plan, request_id: str) -> types_pb2.Plan:
    """A migrating request's plan: one stage on the plan's last worker that recomputes
    everything from the prompt and the tokens emitted so far (counter-based sampling keeps
    the output identical), with the placement's policy and reasons kept."""
    last = plan.stages[-1]
    moved = types_pb2.Plan(policy=plan.policy, reason=plan.reason, report_completion=plan.report_completion,
                           decision=plan.decision)
    moved.stages.append(types_pb2.Stage(request_id=request_id, worker_id=last.worker_id, start=0, end=last.end,
                                        emit=True))
    return moved
