"""Trace readers against the real files in <repo>/../shared/traces, and length scaling."""

import json
import math
import shutil
import time

import numpy as np
import pytest
from conftest import TRACES_DIR, needs_traces
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    detect_format,
    limit,
    read_trace,
    scale_lengths,
)

TRACES = TRACES_DIR
pytestmark = needs_traces  # every test here reads the real files
AZURE_CODE = TRACES / "AzureLLMInferenceTrace_code.csv"
AZURE_CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_CONV = TRACES / "mooncake_conversation_trace.jsonl"
MOONCAKE_SYNTH = TRACES / "mooncake_synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def traces() -> dict[str, list[TraceRequest]]:
    return {p.name: read_trace(p) for p in (AZURE_CODE, AZURE_CONV, MOONCAKE_CONV, MOONCAKE_SYNTH)}


@pytest.mark.parametrize(
    "path, rows", [(AZURE_CODE, 8_819), (AZURE_CONV, 19_366), (MOONCAKE_CONV, 12_031), (MOONCAKE_SYNTH, 3_993)]
)
def test_row_counts_and_arrivals(traces, path, rows):
    requests = traces[path.name]
    assert len(requests) == rows
    arrivals = np.array([r.arrival_s for r in requests])
    assert arrivals[0] == 0.0
    assert np.all(np.diff(arrivals) >= 0)


@pytest.mark.parametrize(
    "path, prompt_mean, prompt_median, output_mean",
    [
        (AZURE_CODE, 2048, 1469, 28),
        (AZURE_CONV, 1155, 1020, 211),
        (MOONCAKE_CONV, 12035, 6909, 343),
    ],
)
def test_published_length_statistics(traces, path, prompt_mean, prompt_median, output_mean):
    requests = traces[path.name]
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert prompts.mean() == pytest.approx(prompt_mean, rel=0.01)
    assert np.median(prompts) == prompt_median
    assert outputs.mean() == pytest.approx(output_mean, rel=0.01)


def test_azure_code_extra_statistics(traces):
    requests = traces[AZURE_CODE.name]
    assert np.percentile([r.prompt_len for r in requests], 99) == pytest.approx(7436, rel=0.01)
    assert np.median([r.output_len for r in requests]) == 13


def test_azure_keeps_all_seven_fractional_digits(traces):
    code = traces[AZURE_CODE.name]
    # 18:17:03.9799600 -> 18:17:04.0319600
    assert code[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    # Last row 19:14:19.9280160, about an hour after 18:17:03.9799600.
    assert code[-1].arrival_s == pytest.approx(3435.948056, abs=1e-6)
    assert all(r.prefix_block_ids == () and r.block_tokens == 0 for r in code[:10])


def test_mooncake_fields(traces):
    conv = traces[MOONCAKE_CONV.name]
    assert conv[0] == TraceRequest(0.0, 6758, 500, tuple(range(14)), MOONCAKE_BLOCK_TOKENS)
    for r in conv + traces[MOONCAKE_SYNTH.name]:
        assert len(r.prefix_block_ids) == math.ceil(r.prompt_len / 512)
    assert conv[-1].arrival_s == pytest.approx(3536.999)
    # Multi-turn reuse: some requests share leading blocks.
    assert conv[1].prefix_block_ids[0] == conv[0].prefix_block_ids[0]


def test_reading_the_largest_csv_is_fast():
    start = time.perf_counter()
    read_trace(AZURE_CONV)
    assert time.perf_counter() - start < 1.0


def test_format_detection_by_extension_and_content(tmp_path):
    assert detect_format(AZURE_CODE) == "azure"
    assert detect_format(MOONCAKE_CONV) == "mooncake"
    no_ext_csv = tmp_path / "azure_trace"
    no_ext_jsonl = tmp_path / "mooncake_trace"
    shutil.copy(AZURE_CODE, no_ext_csv)
    no_ext_jsonl.write_text("\n" + MOONCAKE_SYNTH.read_text().split("\n", 1)[0] + "\n")
    assert detect_format(no_ext_csv) == "azure"
    assert detect_format(no_ext_jsonl) == "mooncake"
    assert len(read_trace(no_ext_csv)) == 8_819
    assert read_trace(no_ext_jsonl)[0].output_len == 6
    garbage = tmp_path / "x.txt"
    garbage.write_text("hello\n")
    with pytest.raises(ValueError, match="format"):
        detect_format(garbage)


def test_unsorted_rows_are_sorted_with_their_lengths(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 2000, "input_length": 2, "output_length": 20, "hash_ids": [1]},
        {"timestamp": 1000, "input_length": 1, "output_length": 10, "hash_ids": [0]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = read_trace(path)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in out] == [(0.0, 1, 10), (1.0, 2, 20)]


@pytest.mark.parametrize(
    "text, field",
    [
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,abc,3\n", "ContextTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,1,-3\n", "GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,3\n", "TIMESTAMP"),
        ("TIMESTAMP,Tokens\n", "GeneratedTokens"),
    ],
)
def test_bad_azure_rows_name_the_field(tmp_path, text, field):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=field):
        read_trace(path)


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"input_length": 1, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": "x", "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": "a"}', "hash_ids"),
        ("{not json", "JSON"),
    ],
)
def test_bad_mooncake_rows_name_the_field(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=field):
        read_trace(path)


def test_scale_lengths_rounds_clamps_and_records_the_factor(traces):
    r = TraceRequest(1.5, 6758, 500, (0, 1), 512)
    (s,) = scale_lengths([r], 0.0625)
    assert (s.arrival_s, s.prompt_len, s.output_len) == (1.5, 422, 31)  # 422.375, 31.25
    assert (s.prefix_block_ids, s.block_tokens, s.length_scale) == ((0, 1), 32, 0.0625)
    (tiny,) = scale_lengths([TraceRequest(0.0, 3, 2)], 0.01, min_prompt=4, min_output=1)
    assert (tiny.prompt_len, tiny.output_len, tiny.block_tokens) == (4, 1, 0)
    scaled = scale_lengths(traces[AZURE_CONV.name], 0.5)
    assert np.mean([x.prompt_len for x in scaled]) == pytest.approx(1155 / 2, rel=0.01)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="length_scale"):
            scale_lengths([r], bad)


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.integers(0, 200_000),
    output=st.integers(0, 10_000),
    factor=st.floats(1e-4, 4.0),
)
def test_scale_lengths_properties(prompt, output, factor):
    (s,) = scale_lengths([TraceRequest(0.0, prompt, output, (7,), 512)], factor)
    assert s.prompt_len >= 1 and s.output_len >= 1 and s.block_tokens >= 1
    assert abs(s.prompt_len - max(1, prompt * factor)) <= 1
    assert abs(s.output_len - max(1, output * factor)) <= 1


def test_limit(traces):
    code = traces[AZURE_CODE.name]
    assert limit(code, n=10) == code[:10]
    within = limit(code, duration_s=60.0)
    assert within and all(r.arrival_s < 60.0 for r in within)
    assert len(within) == sum(r.arrival_s < 60.0 for r in code)
    assert limit(code, n=5, duration_s=1e9) == code[:5]
    assert limit(code) == code
    with pytest.raises(ValueError, match="n"):
        limit(code, n=-1)
