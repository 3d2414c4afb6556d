"""The incremental detokenizer: `tokenizers`' DecodeStream path equals the Python path and the
whole-output decode, split characters and stop strings included (issue 35)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.cli.demo_model import BOS_ID, EOS_ID, _byte_tokenizer
from splitserve.detokenizer import IncrementalDetokenizer

TOKENIZER = _byte_tokenizer(512)  # a fast (Rust) byte-level tokenizer: every UTF-8 split is possible

texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


def stream(prompt: list[int], output: list[int], stop: list[str], chunks: list[int], python_path: bool):
    det = IncrementalDetokenizer(TOKENIZER, prompt, stop)
    if python_path:
        det._stream = None  # the path a slow tokenizer takes
    pieces, i = [], 0
    for n in chunks:
        if i >= len(output):
            break
        pieces.append(det.push(output[i:i + n]))
        i += n
    pieces.append(det.push(output[i:], final=True))
    return "".join(pieces), det.text, det.stopped


def test_a_fast_tokenizer_takes_the_decode_stream():
    assert IncrementalDetokenizer(TOKENIZER, [BOS_ID], [])._stream is not None


@settings(max_examples=150, deadline=None)
@given(prompt=texts, output=texts, chunks=st.lists(st.integers(1, 4), max_size=60),
       stop=st.lists(st.text(min_size=1, max_size=3), max_size=2))
def test_the_decode_stream_equals_the_python_path_and_the_whole_decode(prompt, output, chunks, stop):
    prompt_ids = TOKENIZER.encode(prompt)  # BOS first, then bytes
    output_ids = TOKENIZER.encode(output, add_special_tokens=False) + [EOS_ID]  # a special token dropped
    fast = stream(prompt_ids, output_ids, stop, chunks, python_path=False)
    slow = stream(prompt_ids, output_ids, stop, chunks, python_path=True)
    assert fast == slow
    text, kept, stopped = fast
    assert text == kept  # every character kept was streamed, none taken back
    if not stop:
        assert text == output and not stopped
    else:  # cut at the first stop string, which is not shown
        first = min((output.find(s) for s in stop if s in output), default=-1)
        assert (text, stopped) == ((output[:first], True) if first >= 0 else (output, False))


@pytest.mark.parametrize("prompt", ["€", "ab€"])
def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(prompt):
    prompt_ids = TOKENIZER.encode(prompt)[:-1]  # the last byte of "€" cut off
    for python_path in (False, True):
        assert stream(prompt_ids, TOKENIZER.encode("ok", add_special_tokens=False), [], [1], python_path)[0] == "ok"


def test_stop_strings_count_only_after_min_tokens():
    """vLLM's detokenizer skips the stop check up to min_tokens output tokens (its sampler holds EOS)."""
    output = TOKENIZER.encode("ab.cd.ef", add_special_tokens=False)  # one token per byte
    for python_path in (False, True):
        det = IncrementalDetokenizer(TOKENIZER, [BOS_ID], ["."], min_tokens=4)
        if python_path:
            det._stream = None
        text = "".join(det.push([t]) for t in output) + det.push([], final=True)
        assert (text, det.stopped) == ("ab.cd", True)  # the "." at token 3 does not count, the one at 6 does
