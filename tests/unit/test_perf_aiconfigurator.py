"""splitserve.perf.aiconfigurator: NVIDIA aiconfigurator's measured per-op database, tabulated,
checked against aiconfigurator's own estimator of whole prefill, decode and mixed steps."""

from __future__ import annotations

import json
import logging
import random

import pytest

pytest.importorskip("aiconfigurator_core")

from aiconfigurator_core.sdk.engine import EngineHandle  # noqa: E402

from splitserve.perf.aiconfigurator import _cache_key, _read_cache, coverage, hf_config, tabulate  # noqa: E402
from splitserve.perf.backends import perf_model_for  # noqa: E402
from splitserve.perf.presets import model_spec  # noqa: E402
from splitserve.perf.store import resolve_perf_model  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("perf-cache")


@pytest.fixture(scope="module")
def qwen_a100(cache):
    return tabulate("A100", "Qwen2.5-14B", cache_dir=cache)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """aiconfigurator's own compiled engine for the same model (its mixed/decode step estimators)."""
    d = tmp_path_factory.mktemp("qwen25")
    (d / "config.json").write_text(json.dumps(hf_config(model_spec("Qwen2.5-14B"))))
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    return EngineHandle.compile(str(d), "a100_sxm", "vllm", tp_size=1)


def test_the_issues_measured_anchor_points(qwen_a100):
    # Issue 34: Qwen2.5-14B on an A100 measured with vLLM: a 2,048-token prefill 226 ms, 8,192
    # tokens 1,005 ms; a 512-token chunk alone 69 ms, beside 64 decodes 95 ms; 256 tokens 42 ms.
    assert qwen_a100.prefill_time(0, 2048) == pytest.approx(0.226, rel=0.01)
    assert qwen_a100.prefill_time(0, 8192) == pytest.approx(1.005, rel=0.01)
    assert qwen_a100.prefill_time(0, 512) == pytest.approx(0.068, rel=0.02)
    assert qwen_a100.prefill_time(0, 256) == pytest.approx(0.042, rel=0.02)
    assert qwen_a100.backend == "aiconfigurator" and "vllm" in qwen_a100.label


def test_qwen25_72b_on_tp4_a100s_as_dynaserve_deploys_it(qwen_a100, tmp_path):
    # DynaServe §6.1 runs 72B as TP4 instances on A100s; the A100 vLLM database must cover it.
    tp4 = tabulate("A100", "Qwen2.5-72B", tp=4, cache_dir=tmp_path)
    tp1 = tabulate("A100", "Qwen2.5-72B", cache_dir=tmp_path)
    assert tp4.backend == "aiconfigurator" and "Qwen2.5-72B/tp4/vllm" in tp4.label
    prefills = [tp4.prefill_time(0, n) for n in (256, 512, 2048, 8192)]
    assert prefills == sorted(prefills) and prefills[-1] > 3 * prefills[-2]  # compute-bound: ~linear
    decodes = [tp4.decode_time(b, ctx) for b, ctx in ((1, 1024), (32, 1024), (32, 8192), (128, 8192))]
    assert decodes == sorted(decodes)
    # Four GPUs each do a quarter of the GEMMs and attention, plus all-reduces: faster than one,
    # not four times.
    for step in (lambda m: m.prefill_time(0, 2048), lambda m: m.decode_time(32, 4096)):
        assert step(tp1) / 4 < step(tp4) < step(tp1) / 2
    # ~5x Qwen2.5-14B's linear FLOPs per token (72.7B vs 14.7B parameters, longer attention).
    assert 4.0 < tp1.prefill_time(0, 2048) / qwen_a100.prefill_time(0, 2048) < 6.0


@pytest.mark.parametrize("chunk,decodes", [(512, 0), (256, 0), (2048, 0), (512, 64), (128, 32), (1, 16)])
def test_mixed_steps_match_aiconfigurators_estimator_at_grid_points(qwen_a100, reference, chunk, decodes):
    # aiconfigurator's mixed step: the chunk is a whole prompt (isl = chunk, no prefix) and each
    # decode reads isl + osl // 2 + 1 tokens of context.
    want = reference.mixed_step_latency(chunk, decodes, chunk, 2, 0) / 1e3
    got = qwen_a100.mixed_step_time(chunk, 0, decodes, chunk + 2)
    assert got == pytest.approx(want, rel=0.02)


def test_decode_steps_match_between_grid_points(qwen_a100, reference):
    rng = random.Random(7)
    for _ in range(40):
        batch, isl = rng.randint(1, 400), rng.randint(10, 30000)
        want = reference.decode_step_latency(batch, isl, 2) / 1e3
        assert qwen_a100.decode_time(batch, isl + 2) == pytest.approx(want, rel=0.05), (batch, isl)


def test_prefills_match_between_grid_points(qwen_a100, reference):
    rng = random.Random(8)
    for _ in range(40):
        n = rng.randint(1, 16000)
        want = reference.mixed_step_latency(n, 0, n, 2, 0) / 1e3
        assert qwen_a100.prefill_time(0, n) == pytest.approx(want, rel=0.05), n


def test_decode_attention_adds_to_a_chunk_instead_of_hiding_under_it(qwen_a100):
    # The interference the designs exist for: with the roofline's max(), 64 decodes beside a
    # 512-token chunk cost nothing; measured, their attention and GEMM rows add.
    alone, mixed = qwen_a100.prefill_time(0, 512), qwen_a100.mixed_step_time(512, 0, 64, 2048)
    assert mixed > alone * 1.15
    roof = perf_model_for("A100", "Qwen2.5-14B", backend="datasheet")
    assert roof.mixed_step_time(512, 0, 64, 2048) < roof.prefill_time(0, 512) * 1.15


def test_tables_are_cached_on_disk_as_plain_json(qwen_a100, cache):
    system = "a100_sxm"
    key = _cache_key(system, model_spec("Qwen2.5-14B"), 1, "vllm", None)
    files = list(cache.glob("*.json"))
    assert [f.stem for f in files] == [key]
    assert _read_cache(key, cache) == qwen_a100.tables
    assert qwen_a100.tables.source["database_version"] == "0.14.0"


def test_an_uncovered_combination_is_an_error_naming_what_is_covered_or_the_roofline_with_a_warning(caplog):
    with pytest.raises(ValueError, match="no measured vllm data for H20.*covers.*H100"):
        perf_model_for("H20", "Qwen3-32B", backend="aiconfigurator")
    with pytest.raises(ValueError, match="diffusion"):
        perf_model_for("H100", "LLaDA-8B", backend="aiconfigurator")
    with pytest.raises(ValueError, match="framework must be one of"):
        perf_model_for("H100", "Llama-3-8B", backend="aiconfigurator", framework="tgi")
    with pytest.raises(ValueError, match="backend must be one of"):
        perf_model_for("H100", "Llama-3-8B", backend="measured")
    with caplog.at_level(logging.WARNING, logger="splitserve.perf.aiconfigurator"):
        fallback = perf_model_for("H20", "Qwen3-32B", backend="auto", tp=2)
    assert fallback.backend == "roofline" and "roofline" in caplog.text and "H20" in caplog.text


def test_auto_is_measured_where_covered_and_names_select_a_backend():
    assert perf_model_for("H100", "Llama-3-8B").backend == "aiconfigurator"
    assert perf_model_for("H100", "Llama-3-8B", backend="roofline").backend == "roofline"
    assert resolve_perf_model("H100/llama-3-8b").backend == "aiconfigurator"
    assert resolve_perf_model("datasheet:H100/llama-3-8b/2").label.startswith("preset:")
    with pytest.raises(ValueError, match="BACKEND"):
        resolve_perf_model("measured:H100/llama-3-8b")


def test_frameworks_and_tp_change_the_tables():
    vllm = tabulate("H100", "Llama-3-8B")
    sglang = tabulate("H100", "Llama-3-8B", framework="sglang")
    tp2 = tabulate("H100", "Llama-3-8B", tp=2)
    assert sglang.tables != vllm.tables and "sglang" in sglang.label
    # TP 2 halves each GPU's GEMM and attention work and adds all-reduces.
    assert tp2.prefill_time(0, 4096) < vllm.prefill_time(0, 4096)
    assert coverage().systems["h100_sxm"] == ("vllm", "sglang", "trtllm")
