"""Requests that span workers (PD disaggregation, split at any token) equal the colocated output."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from splitserve.client import Client
from splitserve.cli.launcher import ClusterSpec, start_cluster
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from splitserve.redis_server import free_port
from splitserve.state.store import StateStore
from workers.engine import LLM, SamplingParams
from engine_support import single_thread_generate

P, MAX_TOKENS = 29, 14
L = P + MAX_TOKENS
PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(P)]
CASES = [dict(temperature=0.0), dict(temperature=0.8, top_k=50, seed=4242)]


def _start(tiny_model_dirs, tmp_path_factory, **overrides):
    spec = ClusterSpec(
        model=str(tiny_model_dirs["llama"]), workers=2, policy="split",
        http_port=free_port(), grpc_port=free_port(), redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"],
        redis_prefix=f"ss:stages-{uuid.uuid4().hex[:8]}:", log_dir=tmp_path_factory.mktemp("stage-logs"),
        coordinator_args={"kv_chunk_tokens": 8},
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    spec.worker_args = {"kv_cache_memory_bytes": 8 << 20, "max_num_seqs": 16, "block_size": 4,
                        **spec.worker_args}
    return start_cluster(spec)


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]))
    return {i: llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **case))[0].token_ids
            for i, case in enumerate(CASES)}


def _scheduler(cluster):
    return scheduler_pb2_grpc.GlobalSchedulerStub(grpc.insecure_channel(cluster.scheduler_address))


def _set_split(cluster, split: int) -> None:
    # phi = (s - 0.5) / L so that ceil(phi * L) == s exactly despite floating point.
    _scheduler(cluster).SetPolicy(scheduler_pb2.SetPolicyRequest(
        policy="split", params={"split_ratio": repr((split - 0.5) / L)}), timeout=5)


def _metric(cluster, child: str, name: str, **labels) -> float:
    text = httpx.get(f"http://127.0.0.1:{cluster.child(child).metrics_port}/metrics", timeout=5).text
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{{{re.escape(label)}}} (\S+)$" if label else rf"^{re.escape(name)} (\S+)$"
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def _kv_used(cluster) -> float:
    return sum(_metric(cluster, f"worker-{i}", "splitserve_worker_kv_incoming_total", outcome="used")
               for i in range(len(cluster.worker_addresses)))


def _kv_recomputed(cluster) -> float:
    return sum(_metric(cluster, f"worker-{i}", "splitserve_worker_kv_incoming_total", outcome="recomputed")
               for i in range(len(cluster.worker_addresses)))


def _stages_of(cluster, request_id: str, finished: bool = True, timeout_s: float = 10.0) -> list[dict]:
    """The stages in the request's record; the coordinator writes records in batches, so poll."""
    async def read():
        deadline = time.monotonic() + timeout_s
        async with StateStore(cluster.redis_url, cluster.redis_prefix) as store:
            while True:
                record = await store.get_request(request_id)
                if record is not None and (record.state != "running" or not finished):
                    return record.stages
                if time.monotonic() > deadline:
                    return record.stages if record else []
                await asyncio.sleep(0.02)  # polling the record, bounded by the deadline
    return asyncio.run(read())


def _assert_all_kv_freed(cluster, timeout_s: float = 10.0) -> None:
    """Every worker's blocks are free again: no stage, kept KV or reservation outlives its request."""
    for address in cluster.worker_addresses:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            deadline = time.monotonic() + timeout_s
            load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            while load.free_blocks != load.total_blocks and time.monotonic() < deadline:
                time.sleep(0.05)  # polling the worker's load, bounded by the deadline
                load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            assert load.free_blocks == load.total_blocks, f"{load.worker_id} still holds KV blocks"


def _generate(cluster, case: dict, request_id: str):
    with Client(cluster.gateway_grpc, timeout_s=60) as client:
        return client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=request_id, **case)


# NIXL with the last step's KV pushed layer by layer (kv_layer_push, the default; the chunks
# before it go whole), gRPC with whole chunks only.
@pytest.fixture(scope="module", params=["nixl", "grpc"])
def transport_cluster(request, tiny_model_dirs, tmp_path_factory):
    cluster = _start(tiny_model_dirs, tmp_path_factory,
                     worker_args={"kv_transport": request.param, "kv_layer_push": request.param == "nixl"})
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("split", [1, P - 1, P, P + 1, P + 7, L - 1])
def test_split_at_any_token_equals_colocated(transport_cluster, reference, split):
    _set_split(transport_cluster, split)
    for i, case in enumerate(CASES):
        used_before = _kv_used(transport_cluster)
        request_id = f"split-{split}-{i}-{uuid.uuid4().hex[:6]}"
        result = _generate(transport_cluster, case, request_id)
        assert result.token_ids == reference[i]
        stages = _stages_of(transport_cluster, request_id)
        assert [(s["start"], s["end"]) for s in stages] == [(0, split), (split, L)]
        assert stages[0]["worker_id"] != stages[1]["worker_id"]
        if split < L - 1:  # at L - 1 the first stage produces every token: nothing to hand over
            assert _kv_used(transport_cluster) == used_before + 1, "the second stage should use the pushed KV"
        # At L - 1 the second stage never runs: its worker's reservation must still be freed
        # although the client closes the stream at the last chunk.
        _assert_all_kv_freed(transport_cluster, timeout_s=5.0)


def test_an_unseeded_sampled_request_split_across_workers_samples_as_one_worker(transport_cluster, tiny_model_dirs):
    """Its seed is fixed once, by the coordinator, from the request id: both stages sample with it."""
    from splitserve.core.sampling import request_seed

    _set_split(transport_cluster, P + 5)
    case = dict(temperature=0.8, top_k=50)
    request_id = f"unseeded-{uuid.uuid4().hex[:8]}"
    expected = LLM(str(tiny_model_dirs["llama"])).generate([PROMPT], SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, seed=request_seed(request_id), **case))[0].token_ids
    result = _generate(transport_cluster, case, request_id)
    assert result.token_ids == expected
    stages = _stages_of(transport_cluster, request_id)
    assert [(s["start"], s["end"]) for s in stages] == [(0, P + 5), (P + 5, L)]
    assert stages[0]["worker_id"] != stages[1]["worker_id"]


# vLLM's penalties, min_p and min_tokens (issue 37): the second stage applies them over the
# request's whole prompt and output, as one worker would.
PENALISED = dict(temperature=0.9, top_k=50, seed=77, presence_penalty=0.8, frequency_penalty=0.6,
                 repetition_penalty=1.4, min_p=0.05, min_tokens=MAX_TOKENS)


@pytest.mark.parametrize("split", [P - 1, P + 4])
def test_penalties_min_p_and_min_tokens_split_across_workers_equal_the_offline_llm(transport_cluster,
                                                                                   tiny_model_dirs, split):
    expected = LLM(str(tiny_model_dirs["llama"])).generate([PROMPT], SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, **PENALISED))[0].token_ids
    _set_split(transport_cluster, split)
    request_id = f"penalised-{split}-{uuid.uuid4().hex[:6]}"
    assert _generate(transport_cluster, PENALISED, request_id).token_ids == expected
    stages = _stages_of(transport_cluster, request_id)
    assert [(s["start"], s["end"]) for s in stages] == [(0, split), (split, L)]
    assert stages[0]["worker_id"] != stages[1]["worker_id"]


def test_last_steps_went_layer_by_layer_over_nixl(transport_cluster):
    """The split requests above moved their last step's KV per layer (NIXL), whole (gRPC)."""
    slices = sum(_metric(transport_cluster, f"worker-{i}", "splitserve_worker_kv_layer_slices_total")
                 for i in range(len(transport_cluster.worker_addresses)))
    if transport_cluster.spec.worker_args["kv_transport"] == "nixl":
        assert slices > 0
    else:
        assert slices == 0


def test_pd_disaggregated_equals_colocated(transport_cluster, reference):
    for i, role in enumerate(("prefill", "decode")):
        with grpc.insecure_channel(transport_cluster.worker_addresses[i]) as channel:
            worker_pb2_grpc.WorkerStub(channel).SetRole(worker_pb2.SetRoleRequest(role=role), timeout=5)
    scheduler = _scheduler(transport_cluster)
    scheduler.SetPolicy(scheduler_pb2.SetPolicyRequest(policy="pd_disaggregated"), timeout=5)
    deadline = time.monotonic() + 10
    while {w.role for w in scheduler.ClusterState(scheduler_pb2.ClusterStateRequest(), timeout=5).workers} != {
            "prefill", "decode"}:
        assert time.monotonic() < deadline, "roles never reached the scheduler's view"
        time.sleep(0.05)  # polling the scheduler's view, bounded by the deadline
    try:
        for i, case in enumerate(CASES):
            request_id = f"pd-{i}-{uuid.uuid4().hex[:6]}"
            assert _generate(transport_cluster, case, request_id).token_ids == reference[i]
            stages = _stages_of(transport_cluster, request_id)
            assert [(s["start"], s["end"], s["worker_id"]) for s in stages] == [(0, P, "worker-0"), (P, L, "worker-1")]
    finally:
        for address in transport_cluster.worker_addresses:
            with grpc.insecure_channel(address) as channel:
                worker_pb2_grpc.WorkerStub(channel).SetRole(worker_pb2.SetRoleRequest(role="both"), timeout=5)


# corrupt: the bytes that land differ from those whose digest was sent: on gRPC a payload byte
# is flipped in flight, over NIXL each WRITE reads the wrong source blocks (a misaddressed DMA).
# fail: the push fails at the sender, which tells the receiver at once. truncate: the last
# chunk is never sent.
# One corrupt and one truncated transfer (both transports, both reasons) in the default suite;
# the rest in the extended tier (make test-all): each case starts a cluster of its own.
@pytest.mark.parametrize("fault, transport, reason", [
    ("corrupt", "grpc", "failed"), pytest.param("corrupt", "nixl", "failed", marks=pytest.mark.slow),
    pytest.param("fail", "nixl", "failed", marks=pytest.mark.slow), ("truncate", "nixl", "timeout")])
def test_bad_transfer_is_detected_and_recomputed(fault, transport, reason, tiny_model_dirs, tmp_path_factory,
                                                 reference):
    cluster = _start(tiny_model_dirs, tmp_path_factory, worker_args={
        "kv_fault_injection": fault, "kv_transfer_timeout_s": 2.0, "kv_transport": transport})
    try:
        _set_split(cluster, P + 1)
        for i, case in enumerate(CASES):
            result = _generate(cluster, case, f"{fault}-{i}-{uuid.uuid4().hex[:6]}")
            assert result.token_ids == reference[i]
        assert _kv_recomputed(cluster) == len(CASES)
        assert _kv_used(cluster) == 0
        # Detected for what it is: a failed transfer is known at once, without waiting out the timeout.
        assert _kv_unusable(cluster, reason) == len(CASES)
        if fault == "fail":
            assert sum(_metric(cluster, f"worker-{i}", "splitserve_worker_kv_failure_notices_total", result="sent")
                       for i in range(len(cluster.worker_addresses))) == len(CASES)
    finally:
        cluster.stop()


def _kv_unusable(cluster, reason: str) -> float:
    return sum(_metric(cluster, f"worker-{i}", "splitserve_worker_kv_unusable_total", reason=reason)
               for i in range(len(cluster.worker_addresses)))


def test_killing_the_first_stage_worker_mid_request(tiny_model_dirs, paced_model_dir, tmp_path_factory):
    # The paced model: on the tiny one a loaded machine let the request finish before the kill.
    cluster = _start(tiny_model_dirs, tmp_path_factory, workers=3, model=str(paced_model_dir),
                     worker_args={"heartbeat_ttl_s": 1.5, "heartbeat_interval_s": 0.5})
    try:
        long_tokens = 200
        total = P + long_tokens
        # alpha runs almost everything, so it is still generating when killed
        _scheduler(cluster).SetPolicy(scheduler_pb2.SetPolicyRequest(
            policy="split", params={"split_ratio": repr((total - 2) / total)}), timeout=5)
        expected = single_thread_generate(paced_model_dir, [PROMPT], SamplingParams(
            max_tokens=long_tokens, ignore_eos=True, temperature=0.0))[0]
        started = time.monotonic()
        tokens, killed = [], False
        with Client(cluster.gateway_grpc, timeout_s=60, max_retries=0) as client:
            # No retry by the client: the stream itself must survive the kill.
            for chunk in client.stream(PROMPT, max_tokens=long_tokens, ignore_eos=True, temperature=0.0,
                                       request_id="kill-alpha"):
                tokens += chunk.token_ids
                if len(tokens) >= 10 and not killed:
                    killed = True
                    alpha = _stages_of(cluster, "kill-alpha", finished=False)[0]["worker_id"]
                    os.killpg(cluster.child(alpha).process.pid, signal.SIGKILL)
        assert killed and time.monotonic() - started < 45
        assert tokens == expected.token_ids  # migrated: complete, and exactly
        # Migrated, not finished before the kill reached it (a client may read behind the worker).
        assert _metric(cluster, "coordinator", "splitserve_coordinator_migrations_total") >= 1
        with Client(cluster.gateway_grpc, timeout_s=60) as client:
            assert len(client.generate("next", max_tokens=5, temperature=0).token_ids) == 5
    finally:
        cluster.stop()


def test_lazy_pull_of_kept_kv_equals_colocated(transport_cluster, reference):
    """A stage keeps its KV; a later stage on another worker pulls it lazily (AMPD's history read)."""
    from splitserve.proto import types_pb2

    split = P + 3
    case = CASES[1]
    sampling = types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=case["temperature"], top_k=case["top_k"],
                                        seed=case["seed"], ignore_eos=True)
    alpha_address, beta_address = transport_cluster.worker_addresses
    pulled_before = _metric(transport_cluster, "worker-1", "splitserve_worker_kv_incoming_tokens_total", how="pulled")
    cached_before = _metric(transport_cluster, "worker-1", "splitserve_worker_history_cached_tokens_total")
    with grpc.insecure_channel(alpha_address) as a_channel, grpc.insecure_channel(beta_address) as b_channel:
        alpha, beta = worker_pb2_grpc.WorkerStub(a_channel), worker_pb2_grpc.WorkerStub(b_channel)
        first = list(alpha.Execute(types_pb2.Stage(
            request_id="lazy", stage_index=0, start=0, end=split, prompt_token_ids=PROMPT, sampling=sampling,
            keep_kv=True), timeout=30))
        tokens = [t for c in first for t in c.token_ids]
        last = first[-1]
        assert last.finish_reason == "stage_end" and last.kv_tokens == split and last.kv_block_ids
        second = list(beta.Execute(types_pb2.Stage(
            request_id="lazy", stage_index=1, start=split, end=L, prompt_token_ids=PROMPT,
            generated_token_ids=tokens, sampling=sampling, emit=True,
            kv_sources=[types_pb2.KvSource(worker_id="worker-0", start=0, end=split, lazy=True,
                                           transfer_id="lazy:0", block_ids=last.kv_block_ids)]), timeout=30))
        tokens += [t for c in second for t in c.token_ids]
        assert tokens == reference[1]
        # Every token of [0, split) was pulled, except the whole blocks beta's own prefix cache
        # holds (PROMPT ran there in earlier tests): those it did not fetch again.
        pulled = _metric(transport_cluster, "worker-1", "splitserve_worker_kv_incoming_tokens_total",
                         how="pulled") - pulled_before
        cached = _metric(transport_cluster, "worker-1", "splitserve_worker_history_cached_tokens_total") - cached_before
        assert pulled + cached == split
        # the kept KV is freed on cancel
        assert alpha.Cancel(types_pb2.CancelRequest(request_id="lazy"), timeout=5).cancelled
    _assert_all_kv_freed(transport_cluster, timeout_s=5.0)


@pytest.mark.parametrize("case_index", [0, 1])
def test_remote_incremental_prefill_pulls_the_history_and_pushes_back_only_new_kv(transport_cluster, reference,
                                                                                   case_index):
    """AMPD's remote incremental prefill, worker by worker over the real transport: beta (the
    session's decode worker) holds round 1's history pinned and lends it; alpha pulls it lazily,
    computes only the new tokens and pushes only their KV back; beta continues on its own history
    plus that KV. The output equals one worker's for the whole prompt."""
    from splitserve.proto import types_pb2

    history = 20  # round 1's prompt: 5 whole blocks of 4, all pinned once it finishes
    case = CASES[case_index]
    session_id = f"hist-{uuid.uuid4().hex[:6]}"
    sampling = types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=case["temperature"],
                                        top_k=case.get("top_k", 0), ignore_eos=True,
                                        **({"seed": case["seed"]} if "seed" in case else {}))
    hold = types_pb2.SessionHold(session_id=session_id, ttl_s=60)
    alpha_address, beta_address = transport_cluster.worker_addresses
    pulled_before = _metric(transport_cluster, "worker-0", "splitserve_worker_kv_incoming_tokens_total", how="pulled")
    cached_before = _metric(transport_cluster, "worker-0", "splitserve_worker_history_cached_tokens_total")
    pushed_before = _metric(transport_cluster, "worker-1", "splitserve_worker_kv_incoming_tokens_total", how="pushed")
    with grpc.insecure_channel(alpha_address) as a_channel, grpc.insecure_channel(beta_address) as b_channel:
        alpha, beta = worker_pb2_grpc.WorkerStub(a_channel), worker_pb2_grpc.WorkerStub(b_channel)
        round_1 = list(beta.Execute(types_pb2.Stage(
            request_id=f"{session_id}-1", start=0, end=history + 1, prompt_token_ids=PROMPT[:history],
            sampling=types_pb2.SamplingParams(max_tokens=1, temperature=0.0), emit=True, session=hold), timeout=30))
        assert round_1[-1].finish_reason == "length"

        request_id = f"{session_id}-2"
        lease = beta.LeaseSessionKv(worker_pb2.LeaseSessionKvRequest(
            session_id=session_id, request_id=request_id, max_tokens=history), timeout=5)
        assert lease.num_tokens == history and len(lease.block_ids) == history // 4
        reserved = beta.PrepareKv(worker_pb2.PrepareKvRequest(
            request_id=request_id, transfer_id=f"{request_id}:0", num_tokens=P, start=history), timeout=5)
        assert reserved.ok and len(reserved.block_ids) == -(-P // 4) - history // 4  # the new tokens' blocks only
        prefill = list(alpha.Execute(types_pb2.Stage(
            request_id=request_id, stage_index=0, start=0, end=P, prompt_token_ids=PROMPT, sampling=sampling,
            push_kv=True, emit=True,
            kv_sources=[types_pb2.KvSource(worker_id="worker-1", start=0, end=history, lazy=True,
                                           transfer_id=f"{request_id}:history", block_ids=lease.block_ids)],
            kv_sink=types_pb2.KvSink(worker_id="worker-1", transfer_id=f"{request_id}:0", chunk_tokens=4,
                                     start=history, block_ids=reserved.block_ids)), timeout=30))
        tokens = [t for c in prefill for t in c.token_ids]
        assert prefill[-1].finish_reason == "stage_end"
        decode = list(beta.Execute(types_pb2.Stage(
            request_id=request_id, stage_index=1, start=P, end=L, prompt_token_ids=PROMPT,
            generated_token_ids=tokens, sampling=sampling, emit=True,
            kv_sources=[types_pb2.KvSource(worker_id="worker-0", start=history, end=P,
                                           transfer_id=f"{request_id}:0")],
            session=types_pb2.SessionHold(session_id=session_id, ttl_s=60, history_len=history)), timeout=30))
        tokens += [t for c in decode for t in c.token_ids]
        assert tokens == reference[case_index]
        # The history travelled once, decode worker -> prefill worker (but for what alpha's own
        # prefix cache holds of PROMPT from earlier tests), and only the new KV came back.
        pulled = _metric(transport_cluster, "worker-0", "splitserve_worker_kv_incoming_tokens_total",
                         how="pulled") - pulled_before
        cached = _metric(transport_cluster, "worker-0", "splitserve_worker_history_cached_tokens_total") - cached_before
        assert pulled + cached == history and cached % 4 == 0
        assert _metric(transport_cluster, "worker-1", "splitserve_worker_kv_incoming_tokens_total",
                       how="pushed") == pushed_before + P - history
        assert beta.ReleaseSession(worker_pb2.ReleaseSessionRequest(session_id=session_id), timeout=5).released
    _assert_all_kv_freed(transport_cluster, timeout_s=5.0)


def test_a_history_lease_is_freed_by_cancel_and_a_bad_start_is_refused(transport_cluster):
    from splitserve.proto import types_pb2

    session_id = f"lease-{uuid.uuid4().hex[:6]}"
    _, beta_address = transport_cluster.worker_addresses
    with grpc.insecure_channel(beta_address) as channel:
        beta = worker_pb2_grpc.WorkerStub(channel)
        list(beta.Execute(types_pb2.Stage(
            request_id=f"{session_id}-1", start=0, end=17, prompt_token_ids=PROMPT[:16],
            sampling=types_pb2.SamplingParams(max_tokens=1, temperature=0.0), emit=True,
            session=types_pb2.SessionHold(session_id=session_id, ttl_s=60)), timeout=30))
        lease = beta.LeaseSessionKv(worker_pb2.LeaseSessionKvRequest(
            session_id=session_id, request_id="r2", max_tokens=10), timeout=5)
        assert lease.num_tokens == 8  # whole blocks only
        # Closing the session does not free what is lent: the reader may still be pulling.
        assert beta.ReleaseSession(worker_pb2.ReleaseSessionRequest(session_id=session_id), timeout=5).released
        load = beta.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert load.free_blocks == load.total_blocks - 2
        assert beta.Cancel(types_pb2.CancelRequest(request_id="r2"), timeout=5).cancelled
        unknown = beta.LeaseSessionKv(worker_pb2.LeaseSessionKvRequest(
            session_id="never-opened", request_id="r3", max_tokens=10), timeout=5)
        assert unknown.num_tokens == 0 and not unknown.block_ids
        with pytest.raises(grpc.RpcError) as err:
            beta.PrepareKv(worker_pb2.PrepareKvRequest(request_id="r4", transfer_id="r4:0", num_tokens=12, start=6),
                           timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "start" in err.value.details()
    _assert_all_kv_freed(transport_cluster, timeout_s=5.0)


def test_a_stage_waits_in_line_for_room_on_the_next_worker_and_recomputes_nothing(tiny_model_dirs, reference,
                                                                                    tmp_path_factory):
    """The next worker's KV is full (a reservation holds every block): the coordinator's
    reservation waits in line there, the first stage is not sent meanwhile, and once room frees
    the request runs with its KV pushed, not recomputed; with a short wait and no room ever, it
    runs anyway and the second stage recomputes (the fallback), both token-exact."""
    cluster = _start(tiny_model_dirs, tmp_path_factory, worker_args={"kv_transport": "grpc"},
                     coordinator_args={"kv_chunk_tokens": 8, "kv_reserve_wait_s": 2.0})
    try:
        _set_split(cluster, P + 4)
        _, beta_address = cluster.worker_addresses
        with grpc.insecure_channel(beta_address) as channel:
            beta = worker_pb2_grpc.WorkerStub(channel)
            load = beta.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            blocks_per_stage = -(-(P + 4) // 4)

            def fill() -> None:  # leave fewer free blocks than the first stage's KV needs
                filler = beta.PrepareKv(worker_pb2.PrepareKvRequest(
                    request_id="filler", transfer_id="filler:0", num_tokens=4 * (load.total_blocks - 1)), timeout=5)
                assert filler.ok

            def waiting() -> float:
                return _metric(cluster, "worker-1", "splitserve_worker_kv_reservations_waiting")

            def free_the_filler() -> None:
                from splitserve.proto import types_pb2

                assert beta.Cancel(types_pb2.CancelRequest(request_id="filler"), timeout=5).cancelled

            assert blocks_per_stage > 1
            for i, case in enumerate(CASES):
                fill()
                used, recomputed = _kv_used(cluster), _kv_recomputed(cluster)
                with ThreadPoolExecutor(1) as pool:
                    result = pool.submit(_generate, cluster, case, f"wait-{i}-{uuid.uuid4().hex[:6]}")
                    deadline = time.monotonic() + 10
                    while waiting() < 1:  # the coordinator's reservation is in line on worker-1
                        assert time.monotonic() < deadline, "no reservation waited on the full worker"
                        time.sleep(0.02)  # polling the worker's gauge, bounded by the deadline
                    assert not result.done()  # the first stage was not sent meanwhile
                    free_the_filler()
                    assert result.result(timeout=60).token_ids == reference[i]
                assert _kv_used(cluster) == used + 1 and _kv_recomputed(cluster) == recomputed

            fill()  # freed only once the 2 s wait ran out: the stage is sent without a reservation
            used = _kv_used(cluster)

            def no_room() -> float:
                return _metric(cluster, "worker-1", "splitserve_worker_kv_reservations_total", outcome="no_room")

            refused = no_room()
            with ThreadPoolExecutor(1) as pool:
                started = time.monotonic()
                result = pool.submit(_generate, cluster, CASES[0], f"nowait-{uuid.uuid4().hex[:6]}")
                while no_room() < refused + 1:
                    assert time.monotonic() < started + 10, "the reservation's wait never ran out"
                    time.sleep(0.05)  # polling the worker's counter, bounded by the deadline
                assert time.monotonic() - started >= 2.0
                free_the_filler()  # room for the second stage to recompute the range
                assert result.result(timeout=60).token_ids == reference[0]
            assert _kv_used(cluster) == used  # no KV came: the second stage computed the range itself
        _assert_all_kv_freed(cluster, timeout_s=5.0)
    finally:
        cluster.stop()
