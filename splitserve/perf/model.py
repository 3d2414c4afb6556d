"""Performance model: seconds for a prefill, a decode step, a mixed step, a KV transfer.

Pure arithmetic on plain numbers (no torch, no clock, no I/O but JSON helpers). One
`PerfModel` serves the DynaServe predictor, AMPD's cost estimates (Eq. 1-2), LAPS'
short/long boundary, the emulated worker, the simulator and the planner. Coefficients
come from a fit of measured profiles (`fit_perf_model`) or from a roofline preset
(`splitserve.perf.presets.preset`, which imports this module, never the other way round).
docs/perf_model.md has the derivations.

Piecewise alpha-beta form. A step runs prefill chunks {(H_i, L_i)} (L_i new tokens on
H_i cached ones) and B decode sequences of mean context C. With
    T = sum L_i,  A = sum L_i (H_i + L_i/2),  R = sum H_i,
    compute = c0* + p.c_tok T + p.c_attn A + d.c_seq B + d.c_ctx B C
    memory  = m0* + p.m_tok T + p.m_hist R + d.m_seq B + d.m_ctx B C
    seconds = max(compute, memory)                 (0 for an empty step)
where c0*/m0* is the larger intercept among the parts present (prefill `p.c0`, `p.m0`;
decode `d.c0`, `d.m0`): fixed overhead and the weight read are paid once per step. The
regime changes where the two lines cross (`prefill_boundary`, `decode_breakpoint`).
All coefficients are >= 0, so every time is non-decreasing in every argument.
KV transfer: `latency + per_token * tokens` (0 for no tokens).

A model may also carry measured kernel tables (`tables`, `splitserve.perf.tables`; made by
`splitserve.perf.aiconfigurator` from GPU measurements). Then every step time comes from
the tables (a sum over kernel classes, not the max above) and the coefficients serve the
closed forms that need one (the regimes, `LengthBoundary`'s rescaling) and KV transfer.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from splitserve.perf.tables import StepTables

if TYPE_CHECKING:  # numpy and scipy are imported only by the fitting code
    import numpy as np

__all__ = [
    "DecodeCoeffs", "FitError", "FitReport", "PerfModel", "PrefillCoeffs", "ProfileSample",
    "TransferCoeffs", "fit_perf_model",
]

FORMAT = "splitserve.perf.model"
VERSION = 1
SAMPLE_KINDS = ("prefill", "decode", "transfer", "mixed")


def _check_nonneg(obj: Any) -> None:
    for f in fields(obj):
        v = getattr(obj, f.name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class PrefillCoeffs:
    """Prefill of L new tokens on H cached ones (seconds):
    compute = c0 + c_tok*L + c_attn*L*(H + L/2);  memory = m0 + m_tok*L + m_hist*H."""

    c0: float = 0.0
    c_tok: float = 0.0
    c_attn: float = 0.0
    m0: float = 0.0
    m_tok: float = 0.0
    m_hist: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg(self)


@dataclass(frozen=True)
class DecodeCoeffs:
    """Decode step of B sequences, mean context C (seconds):
    compute = c0 + c_seq*B + c_ctx*B*C;  memory = m0 + m_seq*B + m_ctx*B*C."""

    c0: float = 0.0
    c_seq: float = 0.0
    c_ctx: float = 0.0
    m0: float = 0.0
    m_seq: float = 0.0
    m_ctx: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg(self)


@dataclass(frozen=True)
class TransferCoeffs:
    """KV transfer of n tokens: latency + per_token*n seconds (Hockney alpha-beta)."""

    latency: float = 0.0
    per_token: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg(self)


@dataclass(frozen=True)
class FitError:
    """Relative error |pred - measured| / measured of a fit over n samples."""

    n: int
    mean_rel: float
    max_rel: float
    rms_rel: float

    @staticmethod
    def of(pred: np.ndarray, y: np.ndarray) -> FitError:
        import numpy as np

        rel = np.abs(pred - y) / y
        return FitError(int(len(y)), float(rel.mean()), float(rel.max()), float(np.sqrt((rel**2).mean())))


@dataclass(frozen=True)
class FitReport:
    """Per-kind fit errors; None for a kind not fitted (taken from the base model)."""

    prefill: FitError | None = None
    decode: FitError | None = None
    transfer: FitError | None = None
    mixed: FitError | None = None  # profiled mixed steps (prefill chunk beside decodes)

    @property
    def overall(self) -> FitError | None:
        parts = [e for e in (self.prefill, self.decode, self.transfer, self.mixed) if e is not None]
        if not parts:
            return None
        n = sum(e.n for e in parts)
        return FitError(
            n, sum(e.mean_rel * e.n for e in parts) / n, max(e.max_rel for e in parts),
            math.sqrt(sum(e.rms_rel**2 * e.n for e in parts) / n),
        )


@dataclass(frozen=True)
class PerfModel:
    """Predicted seconds for steps and KV transfers; see the module docstring."""

    prefill: PrefillCoeffs
    decode: DecodeCoeffs
    transfer: TransferCoeffs
    kv_bytes_per_token: float = 0.0
    label: str = ""
    diffusion: bool = False  # a diffusion LM (LLaDA): use diffusion_step_time for its steps
    fit: FitReport | None = None
    # Measured kernel tables: when present, every step time comes from them (see the module docstring).
    tables: StepTables | None = None

    @property
    def backend(self) -> str:
        """What times this model's steps: `aiconfigurator` (measured GPU tables), `roofline`
        (kernel-class tables fitted to them, `splitserve.perf.roofline`), `fit` (fitted to
        profiles of a real engine) or `datasheet` (the whole-step roofline at datasheet peaks)."""
        if self.tables is not None:
            return str(self.tables.source.get("backend", "tables"))
        return "fit" if self.fit is not None else "datasheet"

    @property
    def timing_note(self) -> str:
        """One line for a report: what timed the steps, in words, and the model's label."""
        what = {"aiconfigurator": "virtual time on measured GPU data (NVIDIA aiconfigurator)",
                "fit": "virtual time on a model fitted to profiled engine steps",
                "roofline": "virtual time on the kernel-class roofline fitted to measured GPU data (not measured "
                            "for this GPU x model)",
                "datasheet": "virtual time on the datasheet roofline (not measured)"}.get(self.backend, self.backend)
        return f"step times: {what}: {self.label or 'unlabelled'}"

    def __post_init__(self) -> None:
        k = self.kv_bytes_per_token
        if not isinstance(k, (int, float)) or not math.isfinite(k) or k < 0:
            raise ValueError(f"kv_bytes_per_token must be a finite number >= 0, got {k!r}")

    # ---- the two lines of a step ------------------------------------------------------
    def _lines(self, tok: float, pairs: float, hist: float, b: float, bctx: float) -> tuple[float, float]:
        p, d = self.prefill, self.decode
        if tok > 0 and b > 0:
            c0, m0 = max(p.c0, d.c0), max(p.m0, d.m0)
        elif tok > 0:
            c0, m0 = p.c0, p.m0
        elif b > 0:
            c0, m0 = d.c0, d.m0
        else:
            return 0.0, 0.0
        compute = c0 + p.c_tok * tok + p.c_attn * pairs + d.c_seq * b + d.c_ctx * bctx
        memory = m0 + p.m_tok * tok + p.m_hist * hist + d.m_seq * b + d.m_ctx * bctx
        return compute, memory

    @staticmethod
    def _nonneg(**kw: float) -> None:
        for name, v in kw.items():
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")

    def step_time(self, prefills: Iterable[tuple[int, int]] = (), decode_batch: int = 0,
                  decode_ctx: float = 0.0) -> float:
        """One engine step: prefill chunks `(l_hist, l_incr)` plus `decode_batch` decodes."""
        self._nonneg(decode_batch=decode_batch, decode_ctx=decode_ctx)
        if self.tables is not None:
            chunks = tuple(prefills)
            for h, n in chunks:
                self._nonneg(l_hist=h, l_incr=n)
            return self.tables.step_s(chunks, decode_batch, decode_ctx)
        tok = pairs = hist = 0.0
        for h, n in prefills:
            self._nonneg(l_hist=h, l_incr=n)
            if n > 0:
                tok += n
                pairs += n * (h + n / 2)
                hist += h
        return max(self._lines(tok, pairs, hist, decode_batch, decode_batch * decode_ctx))

    def step_times(self, prefill_tokens, prefill_history, decode_batch, decode_context_tokens,
                   prefill_pairs=None) -> np.ndarray:
        """`step_time` of many steps at once: arrays of equal length (numpy broadcasting). Each
        step has prefill chunks of `prefill_tokens` in all, on `prefill_history` tokens in all
        (the formula's T and R), and `decode_batch` decodes reading `decode_context_tokens` KV
        in all (B and B*C). `prefill_pairs` is the formula's A = sum L_i (H_i + L_i / 2); by
        default one chunk's, T (R + T / 2). Equals `step_time(((R, T),), B, BC / B)` element by
        element for one chunk."""
        import numpy as np

        tok = np.asarray(prefill_tokens, dtype=np.float64)
        hist = np.asarray(prefill_history, dtype=np.float64)
        if self.tables is not None:
            pairs = tok * (hist + tok / 2) if prefill_pairs is None else prefill_pairs
            return self.tables.step_array(tok, pairs, decode_batch, decode_context_tokens)
        b = np.asarray(decode_batch, dtype=np.float64)
        bctx = np.asarray(decode_context_tokens, dtype=np.float64)
        p, d = self.prefill, self.decode
        has_p, has_d = tok > 0, b > 0
        c0 = np.where(has_p & has_d, max(p.c0, d.c0), np.where(has_p, p.c0, d.c0))
        m0 = np.where(has_p & has_d, max(p.m0, d.m0), np.where(has_p, p.m0, d.m0))
        pairs = tok * (hist + tok / 2) if prefill_pairs is None else np.asarray(prefill_pairs, dtype=np.float64)
        hist = np.where(has_p, hist, 0.0)
        compute = c0 + p.c_tok * tok + p.c_attn * pairs + d.c_seq * b + d.c_ctx * bctx
        memory = m0 + p.m_tok * tok + p.m_hist * hist + d.m_seq * b + d.m_ctx * bctx
        return np.where(has_p | has_d, np.maximum(compute, memory), 0.0)

    def step_seconds(self, prefill_tokens: float, prefill_history: float, decode_batch: float,
                     decode_context_tokens: float, prefill_pairs: float) -> float:
        """`step_times` of one step in plain floats, the same arithmetic bit for bit, without
        numpy's per-call cost (the scheduler's timelines hold a handful of segments)."""
        if self.tables is not None:
            return self.tables.aggregate_step_s(prefill_tokens, prefill_pairs, decode_batch, decode_context_tokens)
        hist = prefill_history if prefill_tokens > 0 else 0.0
        return max(self._lines(prefill_tokens, prefill_pairs, hist, decode_batch, decode_context_tokens))

    def prefill_time(self, l_hist: int, l_incr: int) -> float:
        """Seconds to prefill `l_incr` new tokens on `l_hist` cached ones:
        max(c0 + c_tok*L + c_attn*L*(H + L/2), m0 + m_tok*L + m_hist*H); 0 if L == 0."""
        self._nonneg(l_hist=l_hist, l_incr=l_incr)
        if self.tables is not None:
            return self.tables.step_s(((l_hist, l_incr),), 0, 0.0)
        return max(self._lines(l_incr, l_incr * (l_hist + l_incr / 2), l_hist, 0, 0.0))

    def decode_time(self, batch: int, ctx: float) -> float:
        """Seconds for one decode step of `batch` sequences with mean context `ctx`:
        max(c0 + c_seq*B + c_ctx*B*C, m0 + m_seq*B + m_ctx*B*C); 0 if B == 0."""
        self._nonneg(batch=batch, ctx=ctx)
        if self.tables is not None:
            return self.tables.step_s((), batch, ctx)
        return max(self._lines(0, 0.0, 0, batch, batch * ctx))

    def decode_run_times(self, batch: int, decode_context_tokens: int, steps: int) -> np.ndarray:
        """`step_time` of `steps` consecutive decode-only steps of `batch` sequences, every one a
        token longer each step (summed context `decode_context_tokens` at the first), at once:
        the simulator's fast-forwarded runs. Equal to `step_time` step by step: the vector is
        the decode line of the formula, checked against `step_time` at both ends and
        recomputed step by step where a model of another form disagrees."""
        import numpy as np

        if self.tables is not None:
            return self.tables.decode_run(batch, decode_context_tokens, steps)
        ctx = (decode_context_tokens + batch * np.arange(steps, dtype=np.int64)) / batch
        d = self.decode
        bctx = batch * ctx  # as step_time computes it: batch * mean context
        times = np.maximum(d.c0 + d.c_seq * batch + d.c_ctx * bctx, d.m0 + d.m_seq * batch + d.m_ctx * bctx)
        if steps and (times[0] != self.step_time((), batch, float(ctx[0]))
                      or times[-1] != self.step_time((), batch, float(ctx[-1]))):
            times = np.array([self.step_time((), batch, c) for c in ctx.tolist()])
        return times

    def mixed_step_time(self, prefill_tokens: int, prefill_ctx: int, decode_batch: int,
                        decode_ctx: float) -> float:
        """A chunked-prefill step: `prefill_tokens` new tokens on `prefill_ctx` cached ones
        plus a decode batch. Equals prefill_time / decode_time when the other part is
        empty, and lies between max(prefill, decode) and prefill + decode."""
        return self.step_time(((prefill_ctx, prefill_tokens),), decode_batch, decode_ctx)

    def diffusion_step_time(self, seq_len: int, active_tokens: int | None = None, batch: int = 1) -> float:
        """One denoising step of a diffusion LM over `batch` sequences of `seq_len` tokens.
        Refresh (active_tokens None): a full bidirectional pass, T = b*n, A = b*n^2, R = 0.
        Reuse: only `active_tokens` k are recomputed against cached KV: T = b*k,
        A = b*k*n, R = b*(n-k). Uses the prefill coefficients."""
        self._nonneg(seq_len=seq_len, batch=batch)
        k = seq_len if active_tokens is None else active_tokens
        if not 0 <= k <= seq_len:
            raise ValueError(f"active_tokens must be in [0, seq_len], got {active_tokens}")
        return max(self._lines(batch * k, batch * k * seq_len, batch * (seq_len - k), 0, 0.0))

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of KV cache for `tokens` tokens (all layers, K and V)."""
        self._nonneg(tokens=tokens)
        return int(round(tokens * self.kv_bytes_per_token))

    def kv_transfer_time(self, tokens: int) -> float:
        """Seconds to move `tokens` tokens of KV: latency + per_token*tokens; 0 if none."""
        self._nonneg(tokens=tokens)
        return 0.0 if tokens == 0 else self.transfer.latency + self.transfer.per_token * tokens

    # ---- regimes and breakpoints --------------------------------------------------------
    def prefill_terms(self, l_hist: int, l_incr: int) -> tuple[float, float]:
        """(compute, memory) seconds of one prefill of `l_incr` tokens on `l_hist` cached ones."""
        return self._lines(l_incr, l_incr * (l_hist + l_incr / 2), l_hist, 0, 0.0)

    def prefill_regime(self, l_hist: int, l_incr: int) -> str:
        c, m = self._lines(l_incr, l_incr * (l_hist + l_incr / 2), l_hist, 0, 0.0)
        return "compute" if c >= m else "memory"

    def decode_regime(self, batch: int, ctx: float) -> str:
        c, m = self._lines(0, 0.0, 0, batch, batch * ctx)
        return "compute" if c >= m else "memory"

    def work_seconds(self, prefill: int, history: int, decode: int) -> float:
        """Seconds of device work a request of `prefill` tokens on `history` cached ones,
        then `decode` tokens, adds to its worker (DynaServe's execution clock, Alg. 1). With
        measured tables their kernel classes' shares (`StepTables.added_seconds`); else the
        compute line (prefill: c_tok·n + c_attn·n(h + n/2); decode: c_seq + c_ctx·context per
        token, the first reading h + n + 1 positions, each next one one more): memory-bound
        decode passes cost little compute, so a worker full of decodes still has room."""
        if self.tables is not None:
            return self.tables.added_seconds(prefill, history, decode)
        p, d = self.prefill, self.decode
        seconds = p.c_tok * prefill + p.c_attn * prefill * (history + prefill / 2)
        if decode:
            first_context = history + prefill + 1
            seconds += d.c_seq * decode + d.c_ctx * (decode * first_context + decode * (decode - 1) / 2)
        return seconds

    @property
    def attention_s_per_pair(self) -> float:
        """Seconds per (query, cached key) pair a prefill chunk pays to read its history."""
        return self.tables.attention_s_per_pair() if self.tables is not None else self.prefill.c_attn

    def prefill_boundary(self, l_hist: int = 0, *, compute_scale: float = 1.0,
                         memory_scale: float = 1.0) -> float:
        """LAPS' L_m: the smallest new-token count at which a prefill on `l_hist` cached
        tokens is compute-bound (root of compute = memory); inf if never. The scales multiply
        the compute and memory terms (LAPS' online refit, `core.length_class`). With measured
        tables, read off their curves (`StepTables.prefill_boundary`: a one-token prefill's
        cost over the GEMMs' seconds per token), so slower memory moves it up, slower compute
        down, in the same proportion."""
        if self.tables is not None:
            return self.tables.prefill_boundary(l_hist) * memory_scale / compute_scale
        p, cs, ms = self.prefill, compute_scale, memory_scale
        a = cs * p.c_attn / 2
        b = cs * (p.c_tok + p.c_attn * l_hist) - ms * p.m_tok
        c = cs * p.c0 - ms * (p.m0 + p.m_hist * l_hist)
        if c >= 0:
            return 0.0
        if a > 0:
            return 2 * -c / (b + math.sqrt(b * b - 4 * a * c))  # the positive root, stably
        return -c / b if b > 0 else math.inf

    def prefill_bounding_term(self, l_hist: int, l_incr: int, *, compute_scale: float = 1.0,
                              memory_scale: float = 1.0) -> tuple[str, float]:
        """("compute" or "memory", unscaled seconds of that term) for one prefill alone, the
        regime judged on the scaled model (the scales move the ridge). The closed form's term
        is its compute or memory line; measured tables' step is a sum of kernel classes, not a
        max, so their term is the whole predicted step and the regime the side of the scaled
        L_m the prefill is on."""
        if self.tables is not None:
            regime = "compute" if l_incr >= self.prefill_boundary(
                l_hist, compute_scale=compute_scale, memory_scale=memory_scale) else "memory"
            return regime, self.prefill_time(l_hist, l_incr)
        compute, memory = self.prefill_terms(l_hist, l_incr)
        if compute * compute_scale >= memory * memory_scale:
            return "compute", compute
        return "memory", memory

    def decode_breakpoint(self, ctx: float) -> float:
        """Batch size at which a decode step of mean context `ctx` turns compute-bound."""
        if self.tables is not None:
            return self.tables.decode_breakpoint(ctx)
        d = self.decode
        gap = d.m0 - d.c0
        slope = d.c_seq + d.c_ctx * ctx - d.m_seq - d.m_ctx * ctx
        if gap <= 0:
            return 0.0
        return gap / slope if slope > 0 else math.inf

    def max_prefill_tokens(self, budget_s: float, *, prefill_ctx: int = 0, decode_batch: int = 0,
                           decode_ctx: float = 0.0, limit: int = 1 << 20) -> int:
        """Most prefill tokens a step can take beside the decode batch and stay within
        `budget_s` (DynaServe's MaxPrefillAllowed); 0 if even one token does not fit."""
        def t(n: int) -> float:
            return self.mixed_step_time(n, prefill_ctx, decode_batch, decode_ctx)

        if t(1) > budget_s:
            return 0
        lo, hi = 1, limit
        if t(hi) <= budget_s:
            return hi
        while hi - lo > 1:  # t(lo) <= budget < t(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if t(mid) <= budget_s else (lo, mid)
        return lo

    @property
    def relative_error(self) -> float | None:
        """Mean relative error of the fit over all samples (None for a preset)."""
        overall = self.fit.overall if self.fit else None
        return overall.mean_rel if overall else None

    # ---- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (what `StateStore.put_perf` stores under `perf:{worker}`)."""
        fit = None
        if self.fit is not None:
            fit = {k: (asdict(e) if e is not None else None)
                   for k, e in (("prefill", self.fit.prefill), ("decode", self.fit.decode),
                                ("transfer", self.fit.transfer))}
            if self.fit.mixed is not None:  # only then: documents without mixed samples stay as they were
                fit["mixed"] = asdict(self.fit.mixed)
        return {
            "format": FORMAT, "version": VERSION, "label": self.label, "diffusion": self.diffusion,
            "kv_bytes_per_token": self.kv_bytes_per_token, "prefill": asdict(self.prefill),
            "decode": asdict(self.decode), "transfer": asdict(self.transfer), "fit": fit,
            "tables": self.tables.to_dict() if self.tables is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PerfModel:
        """Inverse of `to_dict`; ValueError naming the offending field on bad input."""
        if not isinstance(data, dict):
            raise ValueError("perf model must be a JSON object")
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} document: format={data.get('format')!r}, "
                             f"version={data.get('version')!r}")

        def group(name: str, klass: type) -> Any:
            raw = data.get(name)
            if not isinstance(raw, dict):
                raise ValueError(f"{name} must be an object")
            names = {f.name for f in fields(klass)}
            if set(raw) != names:
                raise ValueError(f"{name} must have exactly the keys {sorted(names)}, got {sorted(raw)}")
            return klass(**raw)

        fit = None
        if data.get("fit") is not None:
            raw_fit = data["fit"]
            if not isinstance(raw_fit, dict):
                raise ValueError("fit must be an object or null")
            try:
                fit = FitReport(**{k: FitError(**v) if v is not None else None
                                   for k, v in raw_fit.items() if k in SAMPLE_KINDS})
            except TypeError as exc:
                raise ValueError(f"fit: {exc}") from None
        label, diffusion = data.get("label", ""), data.get("diffusion", False)
        if not isinstance(label, str) or not isinstance(diffusion, bool):
            raise ValueError("label must be a string and diffusion a boolean")
        tables = StepTables.from_dict(data["tables"]) if data.get("tables") is not None else None
        return cls(prefill=group("prefill", PrefillCoeffs), decode=group("decode", DecodeCoeffs),
                   transfer=group("transfer", TransferCoeffs),
                   kv_bytes_per_token=data.get("kv_bytes_per_token", 0.0), label=label,
                   diffusion=diffusion, fit=fit, tables=tables)

    def describe(self) -> dict[str, Any]:
        """What a report prints about the model: `to_dict` with measured tables replaced by
        what measured them and their digest (the full tables are in `to_dict`)."""
        data = self.to_dict()
        data["backend"] = self.backend
        if self.tables is not None:
            data["tables"] = {"source": dict(self.tables.source), "digest": self.tables.digest}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PerfModel:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        return cls.from_json(Path(path).read_text())


# ---- fitting ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProfileSample:
    """One measured step. prefill: `batch` (>= 1, 0 means 1) identical chunks of l_incr new
    tokens on l_hist cached ones; decode: `batch` sequences of mean context `ctx`;
    mixed: ONE step holding a prefill chunk of l_incr new tokens on l_hist cached ones and a
    decode batch of `batch` sequences of context `ctx`; transfer: `tokens` tokens of KV
    moved. `seconds` is the measured time (> 0)."""

    kind: str
    l_hist: int = 0
    l_incr: int = 0
    batch: int = 0
    ctx: float = 0
    tokens: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SAMPLE_KINDS:
            raise ValueError(f"kind must be one of {SAMPLE_KINDS}, got {self.kind!r}")
        for name in ("l_hist", "l_incr", "batch", "ctx", "tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"seconds must be a finite number > 0, got {self.seconds!r}")
        needed = {"prefill": ("l_incr",), "decode": ("batch",), "transfer": ("tokens",),
                  "mixed": ("l_incr", "batch")}[self.kind]
        for name in needed:
            if getattr(self, name) <= 0:
                raise ValueError(f"a {self.kind} sample needs {name} > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileSample:
        return cls(**data)


def _rel_nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} sum ((X c - y) / y)^2, with columns rescaled for conditioning."""
    import numpy as np
    from scipy.optimize import nnls

    if len(y) == 0:
        return np.zeros(X.shape[1])
    A = X / y[:, None]
    scale = np.sqrt((A * A).sum(axis=0))
    scale[scale == 0] = 1.0
    coef, _ = nnls(A / scale, np.ones_like(y), maxiter=50 * X.shape[1] + 100)
    return coef / scale


def _fit_max_affine(Xc: np.ndarray, Xm: np.ndarray, y: np.ndarray, keys: Sequence[np.ndarray],
                    max_iter: int = 50, starts: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Fit y ~ max(Xc @ tc, Xm @ tm), tc, tm >= 0, in relative least squares.
    Seeds: every threshold split of every key (samples on one side compute-bound, on the
    other memory-bound, both ways round). From the `starts` best seeds: alternate (assign
    each sample to its larger piece, refit each piece by NNLS), then polish the joint
    non-smooth problem with scipy's bounded least_squares. Returns the best found."""
    import numpy as np
    from scipy.optimize import least_squares

    def loss(th: tuple[np.ndarray, np.ndarray]) -> float:
        r = (np.maximum(Xc @ th[0], Xm @ th[1]) - y) / y
        return float(r @ r)

    def refit(on_c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _rel_nnls(Xc[on_c], y[on_c]), _rel_nnls(Xm[~on_c], y[~on_c])

    seeds = [refit(np.ones(len(y), dtype=bool)), refit(np.zeros(len(y), dtype=bool))]
    for key in keys:
        cuts = np.unique(key)[:-1]
        if len(cuts) > 32:
            cuts = np.unique(np.quantile(cuts, np.linspace(0, 1, 32), method="nearest"))
        for t in cuts:
            seeds += [refit(key > t), refit(key <= t)]
    seeds.sort(key=loss)

    nc = Xc.shape[1]
    A = np.hstack([Xc, Xm]) / y[:, None]
    s = np.sqrt((A * A).sum(axis=0))
    s[s == 0] = 1.0
    Ac, Am = A[:, :nc] / s[:nc], A[:, nc:] / s[nc:]

    def resid(z: np.ndarray) -> np.ndarray:  # scaled variables z = theta * s
        return np.maximum(Ac @ z[:nc], Am @ z[nc:]) - 1.0

    def jac(z: np.ndarray) -> np.ndarray:
        on_c = (Ac @ z[:nc] >= Am @ z[nc:])[:, None]
        return np.hstack([np.where(on_c, Ac, 0.0), np.where(on_c, 0.0, Am)])

    best, best_loss = seeds[0], loss(seeds[0])
    for cur in seeds[:starts]:
        cur_loss = loss(cur)
        for _ in range(max_iter):
            cand = refit(Xc @ cur[0] >= Xm @ cur[1])
            cand_loss = loss(cand)
            if cand_loss >= cur_loss * (1 - 1e-12):
                break
            cur, cur_loss = cand, cand_loss
        try:
            sol = least_squares(resid, np.concatenate(cur) * s, jac=jac, bounds=(0.0, np.inf),
                                method="trf", max_nfev=200)
            theta = np.clip(sol.x, 0.0, None) / s
            cand = (theta[:nc], theta[nc:])
            if loss(cand) < cur_loss:
                cur, cur_loss = cand, loss(cand)
        except (ValueError, np.linalg.LinAlgError):  # keep the alternating solution
            pass
        if cur_loss < best_loss:
            best, best_loss = cur, cur_loss
    return best


def _step_features(samples: Sequence[ProfileSample]) -> dict[str, np.ndarray]:
    """The formula's T, A, R, B, B*C of prefill, decode and mixed samples, as `step_time` counts
    them (a prefill sample of `batch` b is b identical chunks; a mixed sample one chunk)."""
    import numpy as np

    def col(f) -> np.ndarray:
        return np.array([float(f(x)) for x in samples], dtype=float)

    chunks = col(lambda x: max(x.batch, 1) if x.kind == "prefill" else (1 if x.kind == "mixed" else 0))
    L, H = col(lambda x: x.l_incr), col(lambda x: x.l_hist)
    B = col(lambda x: x.batch if x.kind != "prefill" else 0)
    return {"y": col(lambda x: x.seconds), "T": chunks * L, "A": chunks * L * (H + L / 2), "R": chunks * H,
            "B": B, "BC": B * col(lambda x: x.ctx), "has_p": chunks > 0, "has_d": B > 0}


def _joint_polish(prefill: PrefillCoeffs, decode: DecodeCoeffs, samples: Sequence[ProfileSample],
                  free_prefill: bool, free_decode: bool) -> tuple[PrefillCoeffs, DecodeCoeffs]:
    """Refine the twelve step coefficients (those of the kinds marked free) on prefill, decode
    and mixed samples at once: bounded least squares of the relative residuals of the
    formula's max, with the analytic Jacobian of the active line (and of the larger
    intercept in a mixed step). Returns the start when it does not lower the error."""
    import numpy as np
    from scipy.optimize import least_squares

    F = _step_features(samples)
    y, T, A, R, B, BC, hp, hd = (F[k] for k in ("y", "T", "A", "R", "B", "BC", "has_p", "has_d"))
    start = np.array([*(getattr(prefill, f.name) for f in fields(prefill)),
                      *(getattr(decode, f.name) for f in fields(decode))], dtype=float)
    free = np.array([free_prefill] * 6 + [free_decode] * 6)
    if not free.any():
        return prefill, decode

    def lines(th: np.ndarray) -> tuple[np.ndarray, ...]:
        pc0, pct, pca, pm0, pmt, pmh, dc0, dcs, dcc, dm0, dms, dmc = th
        p_c0 = hp & (~hd | (pc0 >= dc0))  # whose intercept the step pays (the larger one)
        p_m0 = hp & (~hd | (pm0 >= dm0))
        c0 = np.where(p_c0, pc0, np.where(hd, dc0, 0.0))
        m0 = np.where(p_m0, pm0, np.where(hd, dm0, 0.0))
        compute = c0 + pct * T + pca * A + dcs * B + dcc * BC
        memory = m0 + pmt * T + pmh * R + dms * B + dmc * BC
        return compute, memory, p_c0, p_m0

    def full(z: np.ndarray) -> np.ndarray:
        th = start.copy()
        th[free] = z
        return th

    def resid(z: np.ndarray) -> np.ndarray:
        compute, memory, _, _ = lines(full(z))
        return np.maximum(compute, memory) / y - 1.0

    def jac(z: np.ndarray) -> np.ndarray:
        compute, memory, p_c0, p_m0 = lines(full(z))
        on_c = compute >= memory
        c, m = on_c.astype(float), (~on_c).astype(float)
        J = np.column_stack([
            c * p_c0, c * T, c * A, m * p_m0, m * T, m * R,
            c * (hd & ~p_c0), c * B, c * BC, m * (hd & ~p_m0), m * B, m * BC,
        ]) / y[:, None]
        return J[:, free]

    def loss(z: np.ndarray) -> float:
        r = resid(z)
        return float(r @ r)

    z0 = start[free]
    try:
        sol = least_squares(resid, z0, jac=jac, bounds=(0.0, np.inf), x_scale="jac", method="trf", max_nfev=300)
    except (ValueError, np.linalg.LinAlgError):
        return prefill, decode
    z = np.clip(sol.x, 0.0, None)
    if not loss(z) < loss(z0):
        return prefill, decode
    th = full(z)
    return PrefillCoeffs(*map(float, th[:6])), DecodeCoeffs(*map(float, th[6:]))


def fit_perf_model(samples: Sequence[ProfileSample], *, base: PerfModel | None = None,
                   kv_bytes_per_token: float | None = None, label: str = "fitted",
                   diffusion: bool | None = None) -> PerfModel:
    """Least-squares fit (non-negative coefficients, relative residuals) of each piece.

    prefill samples fit max(compute, memory) of PrefillCoeffs, decode samples
    DecodeCoeffs, transfer samples TransferCoeffs. A kind with no samples is taken from
    `base` (ValueError without one). The returned model's `fit` holds each kind's
    relative error. Needs >= 3 samples per fitted step kind, >= 2 for transfer.

    Mixed samples (a prefill chunk beside a decode batch in one step, which the formula
    times as the max of the summed lines) are fitted too, in the same form: they settle what
    prefill-only and decode-only steps cannot, namely how the two kinds' lines add up.
    A decode's two lines have the same features, so a decode profile in one regime may call
    it "compute" or "memory", or split it into two near-equal lines (each with the weight
    read as its intercept); a prefill profile in one regime leaves its other line free; the
    sum then depends on that arbitrary choice. So, for each kind fitted here, the fit also
    tries its single-line fits (all on the compute line, all on the memory line) and, for
    the decode, its two lines swapped; keeps the combination with the least relative squared
    error over the prefill, decode and mixed samples together; then refines the twelve
    coefficients on all of them at once (`_joint_polish`). `fit.mixed` reports the error on
    the mixed samples. Without mixed samples the fit is exactly the separate one."""
    import numpy as np

    by_kind: dict[str, list[ProfileSample]] = {k: [] for k in SAMPLE_KINDS}
    for smp in samples:
        by_kind[smp.kind].append(smp)
    for kind, minimum in (("prefill", 3), ("decode", 3), ("transfer", 2), ("mixed", 3)):
        n = len(by_kind[kind])
        if n == 0 and base is None and kind != "mixed":
            raise ValueError(f"no {kind} samples and no base model to take {kind} coefficients from")
        if 0 < n < minimum:
            raise ValueError(f"need at least {minimum} {kind} samples, got {n}")

    report: dict[str, FitError] = {}
    # The fits the mixed samples choose from, per step kind fitted here, the separate fit first.
    options: dict[str, list[Any]] = {}
    prefill = base.prefill if base else None
    if by_kind["prefill"]:
        s = by_kind["prefill"]
        y = np.array([x.seconds for x in s], dtype=float)
        L = np.array([x.l_incr for x in s], dtype=float)
        H = np.array([x.l_hist for x in s], dtype=float)
        b = np.array([max(x.batch, 1) for x in s], dtype=float)
        one = np.ones_like(y)
        Xc = np.column_stack([one, b * L, b * L * (H + L / 2)])
        Xm = np.column_stack([one, b * L, b * H])
        tc, tm = _fit_max_affine(Xc, Xm, y, (L, H))
        prefill = PrefillCoeffs(*map(float, tc), *map(float, tm))
        report["prefill"] = FitError.of(np.maximum(Xc @ tc, Xm @ tm), y)
        if by_kind["mixed"]:
            c1, m1 = _rel_nnls(Xc, y), _rel_nnls(Xm, y)
            options["prefill"] = [prefill, PrefillCoeffs(*map(float, c1)),
                                  PrefillCoeffs(0.0, 0.0, 0.0, *map(float, m1))]
    decode = base.decode if base else None
    if by_kind["decode"]:
        s = by_kind["decode"]
        y = np.array([x.seconds for x in s], dtype=float)
        B = np.array([x.batch for x in s], dtype=float)
        C = np.array([x.ctx for x in s], dtype=float)
        X = np.column_stack([np.ones_like(y), B, B * C])
        tc, tm = _fit_max_affine(X, X, y, (B, C))
        decode = DecodeCoeffs(*map(float, tc), *map(float, tm))
        report["decode"] = FitError.of(np.maximum(X @ tc, X @ tm), y)
        if by_kind["mixed"]:
            one_line = tuple(map(float, _rel_nnls(X, y)))
            options["decode"] = [decode, DecodeCoeffs(*map(float, tm), *map(float, tc)),
                                 DecodeCoeffs(*one_line), DecodeCoeffs(0.0, 0.0, 0.0, *one_line)]
    transfer = base.transfer if base else None
    if by_kind["transfer"]:
        s = by_kind["transfer"]
        y = np.array([x.seconds for x in s], dtype=float)
        X = np.column_stack([np.ones_like(y), [float(x.tokens) for x in s]])
        coef = _rel_nnls(X, y)
        transfer = TransferCoeffs(float(coef[0]), float(coef[1]))
        report["transfer"] = FitError.of(X @ coef, y)

    assert prefill is not None and decode is not None and transfer is not None
    if by_kind["mixed"]:
        steps = by_kind["prefill"] + by_kind["decode"] + by_kind["mixed"]
        y = np.array([x.seconds for x in steps], dtype=float)

        def predict(p: PrefillCoeffs, d: DecodeCoeffs) -> np.ndarray:
            m = PerfModel(prefill=p, decode=d, transfer=transfer)
            return np.array([m.step_time([(x.l_hist, x.l_incr)] * max(x.batch, 1)) if x.kind == "prefill"
                             else m.step_time([(x.l_hist, x.l_incr)] if x.kind == "mixed" else [], x.batch, x.ctx)
                             for x in steps])

        def sse(pred: np.ndarray) -> float:
            r = pred / y - 1.0
            return float(r @ r)

        best = None
        for p_opt in options.get("prefill", [prefill]):
            for d_opt in options.get("decode", [decode]):
                err = sse(predict(p_opt, d_opt))
                if best is None or err < best[0] * (1 - 1e-9):
                    best = (err, p_opt, d_opt)
        assert best is not None
        prefill, decode = _joint_polish(best[1], best[2], steps, bool(by_kind["prefill"]), bool(by_kind["decode"]))
        pred = predict(prefill, decode)
        kinds = np.array([x.kind for x in steps])
        for kind in ("prefill", "decode", "mixed"):
            if by_kind[kind]:
                report[kind] = FitError.of(pred[kinds == kind], y[kinds == kind])
    if kv_bytes_per_token is None:
        kv_bytes_per_token = base.kv_bytes_per_token if base else 0.0
    if diffusion is None:
        diffusion = base.diffusion if base else False
    return PerfModel(prefill=prefill, decode=decode, transfer=transfer,
                     kv_bytes_per_token=kv_bytes_per_token, label=label, diffusion=diffusion,
                     fit=FitReport(**report))
