"""Mixture-of-experts models (Mixtral-8x7B) in the step-time models: the preset's shape, the
roofline's expert arithmetic, and the measured tables against aiconfigurator's own estimator."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import numpy as np
import pytest

from splitserve.perf.presets import fits_in_memory, model_spec, preset
from splitserve.perf.roofline import RooflineKernels, constants_for

MIXTRAL = "Mixtral-8x7B"


def test_the_mixtral_preset_has_mixtrals_shape_and_published_sizes():
    m = model_spec(MIXTRAL)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.vocab, m.context_len) == \
        (32, 4096, 32, 8, 128, 32000, 32768)
    assert (m.experts, m.experts_per_token, m.expert_intermediate, m.is_moe) == (8, 2, 14336, True)
    # Mixtral of Experts (arXiv:2401.04088): 46.7B parameters, 12.9B active per token.
    assert m.total_params / 1e9 == pytest.approx(46.7, abs=0.05)
    assert (m.linear_params + 2 * m.vocab_params) / 1e9 == pytest.approx(12.9, abs=0.05)
    for name in ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"):
        assert model_spec(name) is m
    # 93 GB of BF16 weights: one H200 holds them, one H100 does not.
    assert fits_in_memory("H200", m, 1) and not fits_in_memory("H100", m, 1) and fits_in_memory("H100", m, 2)


def test_dense_models_are_unchanged_and_bad_expert_fields_are_named():
    llama = model_spec("Llama-3-8B")
    assert not llama.is_moe and llama.stored_linear_params == llama.linear_params
    assert llama.linear_params_read(1) == llama.linear_params and llama.experts_touched(64) == 0
    m = model_spec(MIXTRAL)
    with pytest.raises(ValueError, match="experts_per_token must be in"):
        dataclasses.replace(m, experts_per_token=9)
    with pytest.raises(ValueError, match="expert_intermediate must be > 0"):
        dataclasses.replace(m, expert_intermediate=0)
    with pytest.raises(ValueError, match="dense model"):
        dataclasses.replace(llama, experts_per_token=2)
    with pytest.raises(ValueError, match="experts must be >= 0"):
        dataclasses.replace(llama, experts=-1)


@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16, 64, 512])
def test_a_step_reads_the_experts_its_tokens_touch(tokens):
    m = model_spec(MIXTRAL)
    touched = 8 * (1 - (1 - 2 / 8) ** tokens)
    assert m.experts_touched(tokens) == pytest.approx(touched)
    per_expert = 3 * 4096 * 14336 * 32
    assert m.linear_params_read(tokens) == pytest.approx(m.attention_params + m.router_params + touched * per_expert)
    assert m.linear_params_read(tokens) <= m.stored_linear_params
    assert m.experts_touched(1) == pytest.approx(2)  # one decode: its top-2
    assert m.experts_touched(16) > 7.9  # a batch of 16 touches nearly all 8


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_rooflines_gemms_read_the_experts_touched_and_compute_the_top_k(tp):
    k = RooflineKernels("H200", MIXTRAL, tp)
    m, c = k.model, constants_for("H200")
    attention = m.attention_params / tp  # kv heads 8 >= tp: split evenly
    expert = 32 * 3 * 4096 * 14336 / tp
    assert k.p_expert == pytest.approx(expert) and k.p_dense == pytest.approx(attention)
    assert k.p_lin == pytest.approx(attention + 2 * expert)  # FLOPs: the top-2 experts per token
    for t in (1.0, 4.0, 16.0, 256.0, 4096.0):
        touched = 8 * (1 - 0.75 ** t)
        compute = 2 * (attention * (t + c.gemm_t_half) + expert * (2 * t + touched * c.gemm_t_half)) \
            / (k.peak_lin * c.gemm_eff)
        memory = ((attention + touched * expert) * 2 + t * k.io) / (k.hbm * c.weight_bw)
        rest = 7 * 32 * c.kernel_latency_s + t * k.elem / (k.hbm * c.weight_bw)
        if tp > 1:
            rest += 2 * 32 * c.allreduce_latency_s + t * k.ar_bytes / (k.link * c.allreduce_eff)
        assert float(k.linear_s(t)) == pytest.approx(max(compute, memory) + rest, rel=1e-12)
    # One decode reads 2 of 8 experts: far less than a step that touches all of them.
    assert float(k.linear_s(1)) < 0.45 * float(k.linear_s(64))


def test_the_datasheet_roofline_computes_the_active_parameters_and_reads_every_expert():
    m = model_spec(MIXTRAL)
    dense_twin = dataclasses.replace(m, experts=0, experts_per_token=0, expert_intermediate=0)  # one 14336 MLP
    moe, dense = preset("H200", m, 2), preset("H200", dense_twin, 2)
    # FLOPs per token: attention + top-2 experts (+ the router), twice the dense twin's MLP.
    active = m.linear_params / dense_twin.linear_params
    assert active == pytest.approx((m.attention_params + 2 * m.layers * m.expert_params) / dense_twin.linear_params,
                                   rel=1e-3)
    assert moe.prefill.c_tok > dense.prefill.c_tok * 1.5
    # Memory: its weight read is one constant per step, so it reads all 8 experts (exact from
    # ~16 tokens up, 2.5x too much for one decode; see perf_presets._weight_bytes).
    per_expert_s = 2 * m.layers * m.expert_params / (4800e9 * 2 * 0.8)
    assert moe.decode.m0 - dense.decode.m0 == pytest.approx(7 * per_expert_s + 2 * m.router_params / (4800e9 * 2 * 0.8),
                                                            rel=1e-9)


# ---- the measured backend ------------------------------------------------------------------

aic = pytest.importorskip("aiconfigurator_core")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("perf-cache-moe")


def _reference(tmp_path_factory, system: str, tp: int):
    from aiconfigurator_core.sdk.engine import EngineHandle

    from splitserve.perf.aiconfigurator import hf_config

    d = tmp_path_factory.mktemp(f"mixtral-{system}-{tp}")
    (d / "config.json").write_text(json.dumps(hf_config(model_spec(MIXTRAL))))
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    return EngineHandle.compile(str(d), system, "vllm", tp_size=tp, moe_tp_size=tp)


@pytest.fixture(scope="module", params=[("H200", "h200_sxm", 2), ("H100", "h100_sxm", 4)], ids=["h200-tp2", "h100-tp4"])
def measured(request, cache, tmp_path_factory):
    from splitserve.perf.aiconfigurator import tabulate

    gpu, system, tp = request.param
    return tabulate(gpu, MIXTRAL, tp, cache_dir=cache), _reference(tmp_path_factory, system, tp)


def test_mixtrals_config_for_aiconfigurator_is_its_moe_family_and_dense_configs_are_unchanged():
    from splitserve.perf.aiconfigurator import hf_config

    config = hf_config(model_spec(MIXTRAL))
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == \
        (8, 2, 14336)
    assert not {"num_local_experts", "num_experts_per_tok", "moe_intermediate_size"} & set(hf_config(
        model_spec("Qwen3-32B")))  # dense cache keys hash this dict: they must not move


def test_measured_mixtral_is_labelled_and_records_its_expert_parallelism(measured):
    model, _ = measured
    assert model.backend == "aiconfigurator" and "Mixtral-8x7B" in model.label
    src = model.tables.source
    assert (src["moe_tp"], src["moe_ep"]) == (src["tp"], 1) and src["moe_distribution"] == "power_law_1.2"


def test_measured_step_times_are_finite_and_grow_with_the_tokens(measured):
    model, _ = measured
    prefills = [model.prefill_time(0, n) for n in (1, 8, 16, 64, 128, 512, 1024, 2048, 4096, 8192, 16384)]
    decodes = [model.decode_time(b, 2048) for b in (1, 2, 4, 8, 16, 64, 256, 1024)]
    mixed = [model.mixed_step_time(512, 0, b, 2048) for b in (0, 1, 16, 64, 256)]
    for series in (prefills, decodes, mixed):
        assert all(math.isfinite(t) and t > 0 for t in series)
        assert all(b >= a for a, b in zip(series, series[1:])), series
    # The experts: one decode touches 2 of 8, sixteen nearly all, so the step more than doubles.
    assert model.decode_time(16, 512) > 2 * model.decode_time(1, 512)


@pytest.mark.parametrize("kind,chunk,batch,isl", [
    ("prefill", 128, 0, 128), ("prefill", 512, 0, 512), ("prefill", 2048, 0, 2048), ("prefill", 8192, 0, 8192),
    ("decode", 0, 1, 512), ("decode", 0, 16, 2048), ("decode", 0, 64, 4096), ("decode", 0, 256, 1024),
    ("mixed", 256, 16, 256), ("mixed", 512, 64, 512), ("mixed", 2048, 32, 2048), ("mixed", 1024, 128, 1024),
])
def test_measured_steps_are_within_20_percent_of_aiconfigurators_estimator(measured, kind, chunk, batch, isl):
    # As benchmarks/perf_model_validation.py: aiconfigurator's chunk is a whole prompt of isl
    # tokens, and each decode reads isl + osl // 2 + 1 tokens (osl = 2).
    model, ref = measured
    if kind == "decode":
        want, got = ref.decode_step_latency(batch, isl, 2) / 1e3, model.decode_time(batch, isl + 2)
    else:
        want, got = ref.mixed_step_latency(chunk, batch, isl, 2, 0) / 1e3, model.mixed_step_time(chunk, 0, batch,
                                                                                                 isl + 2)
    assert got == pytest.approx(want, rel=0.20)
    assert got == pytest.approx(want, rel=0.05)  # in fact within 2% on these two set-ups


def test_an_moe_shape_the_database_lacks_is_an_error_naming_it(cache):
    from splitserve.perf.aiconfigurator import tabulate

    odd = dataclasses.replace(model_spec(MIXTRAL), name="Mixtral-16x", experts=16, expert_intermediate=11000)
    with pytest.raises(ValueError, match="cannot model Mixtral-16x tp2 on h200_sxm/vllm.*MoE data missing"):
        tabulate("H200", odd, 2, cache_dir=cache)


def test_mixtral_where_nothing_was_measured_is_an_error_or_the_roofline_with_a_warning(caplog):
    from splitserve.perf.aiconfigurator import coverage
    from splitserve.perf.backends import perf_model_for

    assert "vllm" in coverage().moe["h200_sxm"] and "MoE: " in coverage().describe()
    with pytest.raises(ValueError, match="no measured vllm data for H20-96GB"):
        perf_model_for("H20", MIXTRAL, 2, backend="aiconfigurator")
    with caplog.at_level(logging.WARNING, logger="splitserve.perf.aiconfigurator"):
        fallback = perf_model_for("H20", MIXTRAL, 2, backend="auto")
    assert fallback.backend == "roofline" and fallback.label.startswith("roofline:H20-96GB/Mixtral-8x7B/tp2")
    assert np.isfinite(fallback.decode_time(8, 1024))
