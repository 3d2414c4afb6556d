"""Mixed samples in the perf-model fit: one step holding a prefill chunk beside a decode batch.

The model times a mixed step as the max of the two kinds' summed lines (no new coefficient:
benchmarks/profile_mixed.py measured that form within the target on the CPU engine). Mixed
samples settle how the two kinds' fitted lines add up, which prefill-only and decode-only
samples leave open, and the fit reports its error on them. Documents without mixed samples
are written and read exactly as before.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitserve.perf.model import (DecodeCoeffs, FitError, FitReport, PerfModel, PrefillCoeffs, ProfileSample,
                                   TransferCoeffs, fit_perf_model)
from splitserve.perf.presets import preset

# A CPU-like engine: kernels run one after another, every step is compute-bound (one line),
# and a mixed step shares its fixed cost (the larger intercept) and its GEMM rows.
CPU_LIKE = PerfModel(PrefillCoeffs(c0=2e-3, c_tok=3.5e-4, c_attn=6e-7),
                     DecodeCoeffs(c0=3e-3, c_seq=4e-4, c_ctx=1.5e-6),
                     TransferCoeffs(1e-4, 1e-6), label="cpu-like")
H100 = preset("H100", "llama-3-8b")

PREFILL_GRID = [(h, n) for h in (0, 256, 1024) for n in (16, 64, 128, 256, 512)]
DECODE_GRID = [(b, c) for b in (1, 4, 16, 32) for c in (64, 256, 1024)]
MIXED_GRID = [(h, n, b, c) for h in (0, 256) for n in (32, 128, 384) for b in (1, 8, 24) for c in (64, 512)]
HELD_OUT = [(h, n, b, c) for h in (128, 512) for n in (64, 256) for b in (4, 16) for c in (128, 768)]


def samples_of(model, noise: float = 0.0, seed: int = 0, decode_grid=DECODE_GRID) -> list[ProfileSample]:
    """`model` may be a PerfModel or any object with prefill_time / decode_time / mixed_step_time."""
    rng = np.random.default_rng(seed)

    def jitter(t: float) -> float:
        return t * (1 + noise * rng.standard_normal()) if noise else t

    out = [ProfileSample("prefill", l_hist=h, l_incr=n, batch=1, seconds=jitter(model.prefill_time(h, n)))
           for h, n in PREFILL_GRID]
    out += [ProfileSample("decode", batch=b, ctx=c, seconds=jitter(model.decode_time(b, c))) for b, c in decode_grid]
    out += [ProfileSample("transfer", tokens=n, seconds=1e-4 + 1e-6 * n) for n in (16, 256, 4096)]
    out += [ProfileSample("mixed", l_hist=h, l_incr=n, batch=b, ctx=c,
                          seconds=jitter(model.mixed_step_time(n, h, b, c))) for h, n, b, c in MIXED_GRID]
    return out


def held_out_errors(fitted: PerfModel, truth) -> np.ndarray:
    return np.array([abs(fitted.mixed_step_time(n, h, b, c) / truth.mixed_step_time(n, h, b, c) - 1)
                     for h, n, b, c in HELD_OUT])


def without_mixed(samples: list[ProfileSample]) -> list[ProfileSample]:
    return [s for s in samples if s.kind != "mixed"]


# ---- fitting ----------------------------------------------------------------------------------

@pytest.mark.parametrize("truth", [CPU_LIKE, H100], ids=["cpu-like", "h100-roofline"])
def test_the_fit_with_mixed_samples_recovers_a_known_model(truth):
    fitted = fit_perf_model(samples_of(truth), label="with mixed")
    assert fitted.fit.mixed.n == len(MIXED_GRID) and fitted.fit.mixed.max_rel < 1e-3
    assert fitted.fit.prefill.max_rel < 1e-3 and fitted.fit.decode.max_rel < 1e-3
    assert held_out_errors(fitted, truth).max() < 2e-3
    assert fitted.fit.overall.n == len(PREFILL_GRID) + len(DECODE_GRID) + 3 + len(MIXED_GRID)


def test_mixed_samples_settle_how_a_one_regime_decode_fit_composes():
    """Decode samples all memory-bound (a GPU's usual decode grid): the two decode lines have
    the same features, so the separate fit may name that line "compute" or split it into two
    near-equal lines, each carrying the weight read; added to a compute-bound chunk's line
    that reads the weights twice. The mixed samples choose the composition that is right."""
    one_regime = [(b, c) for b in (1, 4, 16) for c in (256, 1024, 4000)]
    samples = samples_of(H100, decode_grid=one_regime)
    assert {H100.decode_regime(b, c) for b, c in one_regime} == {"memory"}
    separate = fit_perf_model(without_mixed(samples))
    fitted = fit_perf_model(samples)
    assert separate.fit.decode.max_rel < 1e-3 and fitted.fit.decode.max_rel < 1e-3
    assert held_out_errors(separate, H100).max() > 0.3
    # What decode-only steps cannot tell, the decode's compute line under the memory line,
    # the mixed steps show: the joint refinement finds it.
    assert fitted.fit.mixed.max_rel < 0.02 and held_out_errors(fitted, H100).max() < 0.03
    assert fitted.decode_regime(1, 1024) == "memory"


def test_the_fit_with_noise_predicts_held_out_mixed_steps():
    errors = []
    for seed in range(3):
        fitted = fit_perf_model(samples_of(CPU_LIKE, noise=0.02, seed=seed))
        errors.append(held_out_errors(fitted, CPU_LIKE))
        assert 0.005 < fitted.fit.mixed.mean_rel < 0.03  # the noise, reported
    assert np.mean(errors) < 0.02 and np.max(errors) < 0.06


def test_an_engine_the_form_cannot_time_gets_its_mixed_error_reported():
    """An engine whose mixed step is the sum of its prefill and decode steps (no overlap at
    all, a fixed cost paid twice): beyond the max form, and `fit.mixed` says by how much."""
    class Sequential:
        def prefill_time(self, h, n):
            return CPU_LIKE.prefill_time(h, n)

        def decode_time(self, b, c):
            return CPU_LIKE.decode_time(b, c)

        def mixed_step_time(self, n, h, b, c):
            return CPU_LIKE.prefill_time(h, n) + CPU_LIKE.decode_time(b, c)

    fitted = fit_perf_model(samples_of(Sequential()))
    assert fitted.fit.mixed.mean_rel > 0.01
    assert fitted.fit.mixed.mean_rel == pytest.approx(np.mean([
        abs(fitted.mixed_step_time(n, h, b, c) / Sequential().mixed_step_time(n, h, b, c) - 1)
        for h, n, b, c in MIXED_GRID]))


def test_without_mixed_samples_nothing_changes():
    samples = without_mixed(samples_of(CPU_LIKE, noise=0.02, seed=5))
    plain = fit_perf_model(samples)
    assert plain.fit.mixed is None and set(plain.to_dict()["fit"]) == {"prefill", "decode", "transfer"}
    # The prefill and decode fits are each their kind's own: fitting one kind alone gives the same lines.
    assert fit_perf_model([s for s in samples if s.kind == "prefill"], base=CPU_LIKE).prefill == plain.prefill
    assert fit_perf_model([s for s in samples if s.kind == "decode"], base=CPU_LIKE).decode == plain.decode


def test_mixed_samples_on_a_base_model_only_report_its_error():
    mixed = [s for s in samples_of(CPU_LIKE) if s.kind == "mixed"]
    with pytest.raises(ValueError, match="prefill"):
        fit_perf_model(mixed)
    with pytest.raises(ValueError, match="mixed"):
        fit_perf_model(mixed[:2], base=CPU_LIKE)
    on_base = fit_perf_model(mixed, base=H100)
    assert (on_base.prefill, on_base.decode) == (H100.prefill, H100.decode)
    assert on_base.fit.mixed.n == len(MIXED_GRID) and on_base.fit.mixed.mean_rel > 0.5
    # A kind from the base stays as it is; the fitted kind moves to the mixed steps.
    half = fit_perf_model([s for s in samples_of(CPU_LIKE) if s.kind != "decode"], base=CPU_LIKE)
    assert half.decode == CPU_LIKE.decode and half.fit.mixed.max_rel < 1e-3


def test_mixed_samples_are_validated_and_reported():
    with pytest.raises(ValueError, match="batch"):
        ProfileSample("mixed", l_incr=16, batch=0, ctx=64, seconds=1.0)
    with pytest.raises(ValueError, match="l_incr"):
        ProfileSample("mixed", l_incr=0, batch=4, ctx=64, seconds=1.0)
    assert ProfileSample.from_dict({"kind": "mixed", "l_hist": 8, "l_incr": 16, "batch": 4, "ctx": 64,
                                    "tokens": 0, "seconds": 0.01}).batch == 4
    report = FitReport(prefill=FitError(10, 0.1, 0.2, 0.1), mixed=FitError(30, 0.2, 0.5, 0.25))
    assert report.overall.n == 40 and report.overall.mean_rel == pytest.approx(0.175)
    assert report.overall.max_rel == 0.5


# ---- documents --------------------------------------------------------------------------------

OLD_DOCUMENT = """{"format": "splitserve.perf.model", "version": 1, "label": "profile:w1 (cpu)",
 "diffusion": false, "kv_bytes_per_token": 512,
 "prefill": {"c0": 5.0e-4, "c_tok": 2.8e-5, "c_attn": 1.1e-9, "m0": 6.1e-3, "m_tok": 4.9e-8, "m_hist": 4.9e-8},
 "decode": {"c0": 5.0e-4, "c_seq": 3.5e-5, "c_ctx": 1.1e-9, "m0": 6.1e-3, "m_seq": 5.0e-6, "m_ctx": 4.9e-8},
 "transfer": {"latency": 3e-5, "per_token": 3.3e-6},
 "fit": {"prefill": {"n": 15, "mean_rel": 0.02, "max_rel": 0.05, "rms_rel": 0.03},
         "decode": {"n": 12, "mean_rel": 0.01, "max_rel": 0.04, "rms_rel": 0.02}, "transfer": null}}"""


def test_an_old_document_loads_and_predicts_as_before():
    data = json.loads(OLD_DOCUMENT)
    model = PerfModel.from_dict(data)
    assert model.fit.mixed is None and model.relative_error == pytest.approx((15 * 0.02 + 12 * 0.01) / 27)
    p, d = PrefillCoeffs(**data["prefill"]), DecodeCoeffs(**data["decode"])
    for h, n, b, c in MIXED_GRID + HELD_OUT:  # the max of the summed lines, bit for bit
        compute = max(p.c0, d.c0) + p.c_tok * n + p.c_attn * n * (h + n / 2) + d.c_seq * b + d.c_ctx * (b * c)
        memory = max(p.m0, d.m0) + p.m_tok * n + p.m_hist * h + d.m_seq * b + d.m_ctx * (b * c)
        assert model.mixed_step_time(n, h, b, c) == max(compute, memory)
    # Written back, nothing is added: a model fitted without mixed samples is stored as before.
    again = model.to_dict()
    assert set(again["fit"]) == {"prefill", "decode", "transfer"}
    assert PerfModel.from_dict(again) == model


def test_a_fit_with_mixed_samples_round_trips():
    fitted = fit_perf_model(samples_of(CPU_LIKE, noise=0.01), label="cpu")
    data = json.loads(fitted.to_json())
    assert data["fit"]["mixed"]["n"] == len(MIXED_GRID)
    assert set(data) == set(json.loads(CPU_LIKE.to_json()))  # no new top-level field
    loaded = PerfModel.from_dict(data)
    assert loaded == fitted and loaded.fit.mixed == fitted.fit.mixed
    assert loaded.relative_error == fitted.relative_error
