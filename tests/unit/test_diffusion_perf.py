"""The diffusion performance and memory model (splitserve/core/diffusion_perf.py): pure arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.core.diffusion import DiffusionBatch, DiffusionParams, DiffusionSequence, DiffusionWork, Phase
from splitserve.core.diffusion_perf import LOGIT_BYTES_PER_ELEMENT, DiffusionPerfModel

PARAMS = DiffusionParams(gen_length=256, block_length=32, steps=256)  # dLLM-Serve Table 3


@pytest.fixture(scope="module", params=["RTX4090", "L40S"])
def perf(request) -> DiffusionPerfModel:
    return DiffusionPerfModel.preset(request.param, "LLaDA-8B")


def _work(prompt_len: int, phase: Phase, params: DiffusionParams = PARAMS, key: str = "r") -> DiffusionWork:
    seq = DiffusionSequence(key, prompt_len, params, step_in_block=0 if phase is Phase.REFRESH else 1)
    return DiffusionWork(seq, phase, seq.query_tokens("dual"), admitted=False)


def _batch(*works: DiffusionWork) -> DiffusionBatch:
    return DiffusionBatch(list(works))


def test_the_preset_is_llada_8b_from_the_datasheet_tables(perf):
    assert perf.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # MHA: K and V, 32 layers x 32 heads x 128, bf16
    assert 15.9e9 < perf.weight_bytes < 16.2e9  # 8.02 B parameters in bf16 (the paper's "about 17 GB")
    with pytest.raises(ValueError, match="autoregressive"):
        DiffusionPerfModel.preset(perf.gpu, "Llama-3-8B")


def test_a_refresh_costs_more_than_a_reuse_of_the_same_request(perf):
    refresh = perf.step_cost(_batch(_work(384, Phase.REFRESH)))
    reuse = perf.step_cost(_batch(_work(384, Phase.REUSE)))
    assert refresh.query_tokens == 384 + 256 and reuse.query_tokens == 32
    assert refresh.seconds > 2 * reuse.seconds and refresh.flops > 15 * reuse.flops
    assert refresh.bound == "compute"  # 640 tokens through 8 B parameters
    assert reuse.bound == "memory"  # one block: the step waits on the weights streaming from HBM
    assert reuse.logit_rows == refresh.logit_rows == 32  # dLLM-Serve's runner: the block's rows only


def test_full_sequence_logits_and_padding_cost_more(perf):
    short, long = _work(100, Phase.REFRESH, key="a"), _work(700, Phase.REFRESH, key="b")
    plain = perf.step_cost(_batch(short, long))
    full = perf.step_cost(_batch(short, long), full_sequence_logits=True)
    padded = perf.step_cost(_batch(short, long), pad_to_longest=True)
    assert full.logit_rows == 356 + 956 and full.seconds > plain.seconds
    assert padded.query_tokens == 2 * 956 and padded.seconds > plain.seconds


def test_sparse_kv_reads_less_in_reuse(perf):
    sparse = DiffusionParams(gen_length=256, block_length=32, steps=256, retention_ratio=0.5)
    dense = perf.step_cost(_batch(*[_work(1024, Phase.REUSE, key=str(i)) for i in range(4)]))
    half = perf.step_cost(_batch(*[_work(1024, Phase.REUSE, sparse, key=str(i)) for i in range(4)]))
    assert half.hbm_bytes < dense.hbm_bytes and half.attention_pairs < dense.attention_pairs


def test_an_empty_step_takes_no_time(perf):
    assert perf.step_time(DiffusionBatch()) == 0.0


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(1, 2000), min_size=1, max_size=6),
       phases=st.lists(st.booleans(), min_size=6, max_size=6), extra=st.integers(1, 2000),
       extra_refresh=st.booleans(), gpu=st.sampled_from(["RTX4090", "L40S"]))
def test_step_time_is_monotone_in_the_work(prompts, phases, extra, extra_refresh, gpu):
    perf = DiffusionPerfModel.preset(gpu, "LLaDA-8B")
    works = [_work(p, Phase.REFRESH if r else Phase.REUSE, key=str(i))
             for i, (p, r) in enumerate(zip(prompts, phases))]
    base = perf.step_time(_batch(*works))
    more = perf.step_time(_batch(*works, _work(extra, Phase.REFRESH if extra_refresh else Phase.REUSE, key="x")))
    assert more >= base > 0
    longer = [_work(p + 1, Phase.REFRESH if r else Phase.REUSE, key=str(i))
              for i, (p, r) in enumerate(zip(prompts, phases))]
    assert perf.step_time(_batch(*longer)) >= base


def test_the_logit_peak_with_and_without_decomposition(perf):
    row = 126464 * LOGIT_BYTES_PER_ELEMENT  # vocab x fp32 logit + fp32 probability
    assert perf.logit_peak_bytes(10_000) == 10_000 * row
    assert perf.logit_peak_bytes(10_000, max_num_logits=2048) == 2048 * row
    assert perf.logit_peak_bytes(100, max_num_logits=2048) == 100 * row
    assert perf.logit_peak_bytes(0) == 0


@pytest.mark.parametrize("gpu, budget", [("RTX4090", 4000), ("L40S", 16384)])  # Table 3
def test_the_logit_aware_profile_gives_the_kv_pool_more(gpu, budget):
    perf = DiffusionPerfModel.preset(gpu, "LLaDA-8B")
    aware, monolithic = perf.logit_aware_plan(budget, 2048), perf.monolithic_plan(budget)
    assert aware.kv_pool_bytes > monolithic.kv_pool_bytes
    assert aware.logit_bytes == 2048 * perf.logit_row_bytes
    assert monolithic.logit_bytes == budget * perf.logit_row_bytes
    for plan in (aware, monolithic):  # the parts never exceed the device's share
        parts = plan.weight_bytes + plan.activation_bytes + plan.logit_bytes + plan.guard_bytes + plan.kv_pool_bytes
        assert parts <= plan.usable_bytes == int(perf.gpu.mem_gb * 1e9 * 0.9)


@pytest.mark.parametrize("seq_len", [160, 640, 1280, 2048])
def test_the_largest_static_batch_fits_and_one_more_does_not(perf, seq_len):
    plan = perf.largest_static_batch(seq_len)
    batch = plan.static_batch_size
    assert batch >= 1
    assert perf.static_fits(batch, seq_len) and not perf.static_fits(batch + 1, seq_len)
    assert plan.kv_capacity_tokens == batch * seq_len
    assert plan.reserved_logit_rows == batch * seq_len  # Fast-dLLM: every position's logits at the Refresh
    # With decomposition the same memory holds a larger static batch.
    decomposed = perf.largest_static_batch(seq_len, logit_rows_per_request=32, max_num_logits=2048)
    assert decomposed.static_batch_size > batch


def test_a_request_that_cannot_fit_is_refused():
    perf = DiffusionPerfModel.preset("RTX4090", "LLaDA-8B")
    with pytest.raises(ValueError, match="not even one request"):
        perf.largest_static_batch(8000)
    with pytest.raises(ValueError, match="max_num_logits"):
        perf.logit_peak_bytes(10, max_num_logits=0)
