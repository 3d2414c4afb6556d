"""`splitserve up --workers 2 --policy dynaserve` on the real model (SmolLM2-135M-Instruct).

DynaServe (issue 12, `services.global_scheduler.dynaserve`) cuts each request where its
worker pair is predicted to balance, so the split point differs from request to request
(cold start: prefill/decode disaggregation; under load: wherever the probes land, φ = 0 or
1 included). Whatever it chooses, the answer must be the one a single worker gives: greedy
and seeded sampling, through the OpenAI HTTP API and the gRPC SDK, sent concurrently so
that the pair is loaded while it decides.
"""

from __future__ import annotations

import pytest
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


@pytest.fixture(scope="module")
def up(real_model, tmp_path_factory):
    with splitserve_up(real_model, tmp_path_factory.mktemp("dynaserve-up-logs"), "--workers", "2", "--policy",
                       "dynaserve", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(48 << 20),
                       "--batch-policy", "slo_aware") as cluster:
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
    splits, phis = 0, []
    for (chat, sampling), request_id, token_ids in sdk_results:
        assert token_ids == reference[sampling][chat].token_ids, (chat, SAMPLING[sampling])
        record = finished_record(up["prefix"], request_id)
        assert record is not None and record.state in ("stop", "length"), record
        assert {"phi", "probes", "t1_s", "t2_s"} <= set(record.decision), record.decision
        phis.append(record.decision["phi"])
        total = record.stages[-1]["end"]
        split_points = [s["end"] for s in record.stages[:-1]]
        assert all(0 < s < total for s in split_points)
        splits += len(record.stages) == 2 and record.stages[0]["worker_id"] != record.stages[1]["worker_id"]
    # The test means nothing unless requests were really cut across the two workers.
    assert splits >= 1, phis
