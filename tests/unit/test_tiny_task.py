"""The digit-reversal task of the tiny LLaDA (workers/diffusion/tiny_task.py): seeded, well-formed
problems, a held-out split that shares no string with training, a checker that accepts the
right answer and only it, and byte-level tokenization that round-trips."""

from __future__ import annotations

import pytest

from workers.diffusion import tiny_task
from workers.diffusion.tiny_task import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    Problem,
    accuracy,
    answer_of,
    decode,
    encode,
    is_correct,
    problem_stream,
    problems,
    split_of,
)


def test_problems_are_seeded_and_well_formed():
    first = problems(200, seed=5)
    assert first == problems(200, seed=5)
    assert first != problems(200, seed=6)
    assert problems(50, seed=5) == first[:50]  # a prefix of the same stream
    lengths = {len(p.digits) for p in first}
    assert lengths == set(range(tiny_task.MIN_DIGITS, tiny_task.MAX_DIGITS + 1))
    for p in first:
        assert p.digits.isdigit() and p.digits.isascii()
        assert p.prompt_text == p.digits + "="
        assert p.prompt_ids == (BOS_ID, *p.digits.encode(), ord("="))
        assert p.answer_text == p.digits[::-1]
        assert p.answer_ids == tuple(p.digits[::-1].encode())
        target = p.target_ids()
        assert len(target) == tiny_task.GEN_LENGTH
        assert target[: len(p.digits)] == p.answer_ids
        assert set(target[len(p.digits):]) == {EOS_ID}  # at least 4 EOS: 12 digits + 4 <= 16
        assert MASK_ID not in p.prompt_ids
    # Digits are spread (not a constant stream): every digit shows up in every answer position.
    for position in range(tiny_task.MIN_DIGITS):
        assert {p.answer_text[position] for p in first} == set("0123456789")


def test_lengths_and_splits_are_options():
    short = problems(100, seed=1, split="train", min_digits=3, max_digits=4)
    assert {len(p.digits) for p in short} == {3, 4}
    assert all(split_of(p.digits) == "train" for p in short)
    with pytest.raises(ValueError, match="split"):
        problems(1, seed=1, split="test")
    with pytest.raises(ValueError, match="min_digits"):
        problems(1, seed=1, min_digits=5, max_digits=4)
    with pytest.raises(ValueError, match="n must be"):
        problems(-1, seed=1)
    with pytest.raises(ValueError, match="seed"):
        next(problem_stream(seed="1"))


def test_heldout_and_train_never_share_a_string():
    heldout = problems(300, seed=0, split="heldout")
    train = problems(3000, seed=0, split="train")
    assert all(split_of(p.digits) == "heldout" for p in heldout)
    assert all(split_of(p.digits) == "train" for p in train)
    assert not {p.digits for p in heldout} & {p.digits for p in train}
    # The split is a property of the string alone, about 1 in HELDOUT_MODULUS held out.
    pool = problems(4000, seed=9, split="train") + problems(500, seed=9, split="heldout")
    assert all(split_of(p.digits) == split_of(p.digits[:]) for p in pool)
    every = [f"{i:06d}" for i in range(8000)]
    share = sum(split_of(d) == "heldout" for d in every) / len(every)
    assert abs(share - 1 / tiny_task.HELDOUT_MODULUS) < 0.02


def test_target_ids_pad_with_eos_and_refuse_a_short_region():
    p = Problem("123456789012")
    assert p.target_ids(32) == tuple(b"210987654321") + (EOS_ID,) * 20
    assert p.target_ids(12) == tuple(b"210987654321")
    with pytest.raises(ValueError, match="shorter than the answer"):
        p.target_ids(11)


@pytest.mark.parametrize("digits", ["", "12a4", " 123", "١٢٣"])  # the last: Arabic-Indic digits
def test_problem_refuses_anything_but_ascii_digits(digits):
    with pytest.raises(ValueError, match="decimal digits"):
        Problem(digits)


def test_checker_accepts_the_right_answer():
    p = Problem("31415926")
    assert is_correct(p.target_ids(), p)
    assert is_correct(p.target_ids(32), p)
    assert is_correct(list(b"62951413"), p)  # no EOS at all: the region ended with the answer
    assert is_correct(list(b"62951413") + [EOS_ID, ord("7"), MASK_ID], p)  # after the first EOS: ignored
    assert answer_of(list(b"62951413") + [EOS_ID, ord("7")]) == tuple(b"62951413")


@pytest.mark.parametrize("generated", [
    b"31415926",  # not reversed
    b"6295141",  # a digit short
    b"629514130",  # a digit too many
    b"62951412",  # one digit wrong
    b"",  # nothing before EOS
])
def test_checker_rejects_wrong_answers(generated):
    p = Problem("31415926")
    assert not is_correct(list(generated) + [EOS_ID] * 4, p)


def test_checker_rejects_masks_and_specials_inside_the_answer():
    p = Problem("31415926")
    right = list(p.target_ids())
    for index in (0, 3, 7):
        for token in (MASK_ID, BOS_ID, tiny_task.PAD_ID, ord(" ")):
            wrong = right.copy()
            wrong[index] = token
            assert not is_correct(wrong, p)
    # A mask left where EOS belongs (an unfinished generation) is wrong too.
    assert not is_correct(right[:8] + [MASK_ID] + right[9:], p)


def test_accuracy_counts_exact_matches():
    ps = problems(4, seed=3)
    generated = [p.target_ids() for p in ps]
    generated[1] = ps[1].target_ids()[::-1]
    assert accuracy(generated, ps) == 0.75
    with pytest.raises(ValueError, match="2 generations for 4 problems"):
        accuracy(generated[:2], ps)
    with pytest.raises(ValueError, match="no problems"):
        accuracy([], [])


def test_tokenization_round_trips():
    for p in problems(50, seed=2):
        assert decode(p.prompt_ids) == p.prompt_text
        assert decode(p.target_ids()) == p.answer_text
        assert encode(p.prompt_text) == list(p.prompt_ids)
        assert encode(p.answer_text, add_bos=False) == list(p.answer_ids)
    text = "naïve 42 ✓"
    assert decode(encode(text)) == text
    assert decode([BOS_ID, *b"12", EOS_ID, MASK_ID], skip_special_tokens=False) == (
        "<|begin_of_text|>12<|end_of_text|><|mdm_mask|>")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode([tiny_task.VOCAB_SIZE])


def test_token_ids_are_the_llada_demo_tokenizers():
    # tiny_task repeats these (workers may not import splitserve.cli.demo_model); they must agree.
    from splitserve.cli import demo_model

    assert (BOS_ID, EOS_ID, tiny_task.PAD_ID, MASK_ID) == (
        demo_model.BOS_ID, demo_model.EOS_ID, demo_model.PAD_ID, demo_model.MASK_ID)
    assert tiny_task.VOCAB_SIZE == demo_model.LLADA_TOKENIZER_VOCAB_SIZE
    assert tiny_task.SPECIAL_TOKENS == {demo_model.BOS_ID: demo_model.BOS, demo_model.EOS_ID: demo_model.EOS,
                                        demo_model.PAD_ID: demo_model.PAD, demo_model.MASK_ID: demo_model.MASK}
