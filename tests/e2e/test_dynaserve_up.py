"""`splitserve up --workers 2 --policy dynaserve` on the real model (SmolLM2-135M-Instruct).

DynaServe (issue 12, `services.global_scheduler.dynaserve`) cuts each request where its
worker pair is predicted to balance, so the split point differs from request to request
(cold start: prefill/decode disaggregation; under load: wherever the probes land, φ = 0 or
1 included). Whatever it chooses, the answer must be the one a single worker gives: greedy
and seeded sampling, through the OpenAI HTTP API and the gRPC SDK, sent concurrently so
that the pair is loaded while it decides.

Whether a request is split depends on the load the policy sees (on these short requests:
only the cold start's first one by default, and then only if it is the first placed), so
the cluster runs with `always_split=true`: every request is cut across the two workers,
wherever the search lands, unless the split would overflow a worker's KV (each worker has
KV for all the cases in flight at once, so none does). Token-exactness is checked for every
request, whatever its φ.
"""

from __future__ import annotations

import pytest

from services.global_scheduler.dynaserve import DynaServePolicy
from services.global_scheduler.policy import ClusterView, PlacementRequest, WorkerView
from splitserve.core.records import WorkerLoad
from real_model_support import (FRANCE, PHOTOSYNTHESIS, engine_reference, finished_record,  # noqa: F401 (fixtures)
                                real_model, real_tokenizer, send_chat_cases, splitserve_up, wait_for_workers)

MAX_TOKENS = 40
CHATS = [
    FRANCE,
    PHOTOSYNTHESIS,
    [{"role": "user", "content": "Name three primary colours and say why they are called primary."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=7)]
# 96 MiB of float32 KV per worker: 136 blocks of 16 tokens = 2,176 tokens, more than all 16
# cases (4 chats x 2 samplings x HTTP and SDK) hold at once (prompt + MAX_TOKENS: 1,220), so
# no split falls back to a whole request for want of KV (48 MiB: the last two could).
KV_CACHE_BYTES = 96 << 20


@pytest.fixture(scope="module")
def up(real_model, tmp_path_factory):
    with splitserve_up(real_model, tmp_path_factory.mktemp("dynaserve-up-logs"), "--workers", "2", "--policy",
                       "dynaserve", "--policy-param", "always_split=true", "--max-num-seqs", "8",
                       "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--batch-policy", "slo_aware") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(real_model, real_tokenizer):
    return engine_reference(real_model, real_tokenizer, CHATS, SAMPLING, MAX_TOKENS)


def test_dynaserve_up_answers_exactly_as_one_worker(up, real_tokenizer, reference):
    wait_for_workers(up["prefix"], 2)
    http_results, sdk_results = send_chat_cases(up, real_tokenizer, CHATS, SAMPLING, MAX_TOKENS, "dyn")

    for (chat, sampling), text, finish in http_results:
        expected = reference[sampling][chat]
        assert text == expected.text, (chat, SAMPLING[sampling])
        assert finish == expected.finish_reason
    unsplit = []
    for (chat, sampling), request_id, token_ids in sdk_results:
        assert token_ids == reference[sampling][chat].token_ids, (chat, SAMPLING[sampling])  # whatever phi is
        record = finished_record(up["prefix"], request_id)
        assert record is not None and record.state in ("stop", "length"), record
        assert {"phi", "probes", "t1_s", "t2_s"} <= set(record.decision), record.decision
        total = record.stages[-1]["end"]
        split_points = [s["end"] for s in record.stages[:-1]]
        assert all(0 < s < total for s in split_points)
        if not (len(record.stages) == 2 and record.stages[0]["worker_id"] != record.stages[1]["worker_id"]
                and 0 < record.decision["phi"] < 1):
            unsplit.append((request_id, record.decision["phi"], record.stages))
    # The test means nothing unless requests were really cut across the two workers: with
    # always_split and KV for all of them, every one is, however loaded the pair was.
    assert not unsplit, unsplit


def test_always_split_cuts_these_requests_whatever_the_load():
    """The policy the cluster above runs, on its requests' shapes placed all at once (the load
    grows with each; by default only the cold start's first one is split, the rest run whole,
    φ 0 or 1, as in the `make test` run that failed): with always_split every one is cut
    across the pair, and the KV the workers above have holds them all."""
    blocks = KV_CACHE_BYTES // (2 * 30 * 16 * 3 * 64 * 4)  # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32
    workers = ClusterView(tuple(WorkerView(w, f"{w}:1", WorkerLoad(w, role="both", running=1, total_blocks=blocks,
                                                                  free_blocks=blocks, block_size=16))
                                for w in ("worker-0", "worker-1")), 99.95)
    policy = DynaServePolicy(always_split="true")  # as --policy-param gives it; the cluster's default perf model
    prompts = [29, 37, 37, 42] * 2 * len(SAMPLING)  # the chats' prompt lengths, over HTTP and the SDK
    placements = [policy.place(PlacementRequest(f"r{i}", prompt, MAX_TOKENS), workers, 100.0 + i * 1e-3)
                  for i, prompt in enumerate(prompts)]
    cuts = [(len(p.stages), p.worker_ids, p.decision["phi"]) for p in placements]
    assert all(n == 2 and ids == ("worker-0", "worker-1") and 0 < phi < 1 for n, ids, phi in cuts), cuts
    with pytest.raises(ValueError, match="always_split"):
        DynaServePolicy(always_split="sometimes")
