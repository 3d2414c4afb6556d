"""A synthetic task with a checkable answer, for a tiny LLaDA that can be judged on quality.

**Digit-string reversal.** The prompt is `<BOS>` then 6 to 12 decimal digits then `=`; the
answer is the digits in reverse order, then `<EOS>` tokens filling the rest of the generated
region (LLaDA's SFT pads every answer with EOS up to the generated length, so the model
learns to end its answer by filling the rest with EOS):

    prompt   <BOS>31415926=          answer   62951413<EOS><EOS>...<EOS>

Each answer digit is a copy of one particular prompt token (answer digit `i` is prompt digit
`n - 1 - i`, `n` read from where `=` stands), so a correct answer needs the model to attend
to specific context positions: dropping the right (or wrong) keys from a sparse KV cache
changes the answer, which is what a quality-versus-KV-retention evaluation measures
(dLLM-Serve §6.4).

Token ids are those of the byte-level tokenizer of `splitserve demo-model --arch llada`
(splitserve/cli/demo_model.py): a byte's id is its value, then `<|begin_of_text|>` 256,
`<|end_of_text|>` 257, `<|pad|>` 258 and the mask token `<|mdm_mask|>` 259; the trained model
directory (scripts/train_tiny_dllm.py) carries that tokenizer, so the text prompt `31415926=`
tokenizes, BOS prepended, to `prompt_ids`. The constants are repeated here rather than imported,
because `workers` sits below `splitserve.cli.demo_model` in the import layers; a test checks they agree.

Problems are split, by a hash of the digit string, into a training and a held-out set that
share no digit string, so held-out accuracy is measured on strings the model never saw.

Pure Python (no torch): generation, checking and tokenization only.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

# The byte-level tokenizer's special ids (splitserve/cli/demo_model.py: BOS_ID, EOS_ID, PAD_ID, MASK_ID).
BOS_ID, EOS_ID, PAD_ID, MASK_ID = 256, 257, 258, 259
VOCAB_SIZE = 260  # 256 bytes + BOS, EOS, PAD + the mask token
SPECIAL_TOKENS = {BOS_ID: "<|begin_of_text|>", EOS_ID: "<|end_of_text|>", PAD_ID: "<|pad|>",
                  MASK_ID: "<|mdm_mask|>"}

SEPARATOR = "="
MIN_DIGITS, MAX_DIGITS = 6, 12
# The default generated region (answer + EOS padding): the longest answer plus 4 EOS, and a
# multiple of the block lengths 4 and 8. The trained model (tiny_model/) was trained at the
# generated lengths TRAINED_GEN_LENGTHS and is meant to be run at one of them.
GEN_LENGTH = 16
TRAINED_GEN_LENGTHS = (16, 24, 32)

# The chat template of the trained model's tokenizer: a conversation renders as `<BOS>` and the
# last user message, so `[{"role": "user", "content": "31415926="}]` is exactly the task prompt
# (the model knows no other format; the template writes BOS itself, as real templates do).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(prompt='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.prompt = message['content'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{ bos_token }}{{ ns.prompt }}"
)

# The trained model directory kept in the repository (scripts/train_tiny_dllm.py writes it;
# load it with workers.engine.models.llada.load_llada).
TINY_MODEL_DIR = Path(__file__).resolve().with_name("tiny_model")
DIGIT_IDS = tuple(range(ord("0"), ord("9") + 1))
SEPARATOR_ID = ord(SEPARATOR)

SPLITS = ("train", "heldout")
# One digit string in HELDOUT_MODULUS (by CRC-32) is held out of training.
HELDOUT_MODULUS = 8


def split_of(digits: str) -> str:
    """`"heldout"` or `"train"`: a fixed function of the digit string alone."""
    return "heldout" if zlib.crc32(digits.encode("ascii")) % HELDOUT_MODULUS == 0 else "train"


@dataclass(frozen=True)
class Problem:
    """One reversal problem: `digits` is the string to reverse."""

    digits: str

    def __post_init__(self) -> None:
        if not isinstance(self.digits, str) or not self.digits.isascii() or not self.digits.isdigit():
            raise ValueError(f"digits must be a non-empty string of decimal digits, got {self.digits!r}")

    @property
    def prompt_text(self) -> str:
        return self.digits + SEPARATOR

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """`<BOS>` and the prompt's bytes, as the model directory's tokenizer encodes `prompt_text`."""
        return tuple(encode(self.prompt_text))

    @property
    def answer_text(self) -> str:
        return self.digits[::-1]

    @property
    def answer_ids(self) -> tuple[int, ...]:
        return tuple(encode(self.answer_text, add_bos=False))

    def target_ids(self, gen_length: int = GEN_LENGTH) -> tuple[int, ...]:
        """The generated region a perfect model produces: the answer, then EOS up to `gen_length`."""
        answer = self.answer_ids
        if gen_length < len(answer):
            raise ValueError(f"gen_length ({gen_length}) is shorter than the answer ({len(answer)} tokens)")
        return answer + (EOS_ID,) * (gen_length - len(answer))


def problem_stream(seed: int, split: str = "heldout", min_digits: int = MIN_DIGITS,
                   max_digits: int = MAX_DIGITS) -> Iterator[Problem]:
    """An endless, seeded stream of problems of `split`: a length uniform in
    [min_digits, max_digits], then uniform digits; strings of the other split are skipped."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if not (isinstance(min_digits, int) and isinstance(max_digits, int) and 1 <= min_digits <= max_digits):
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    # random.Random with an int seed gives the same draws on every platform and Python 3 version.
    rng = random.Random(seed)
    while True:
        length = rng.randint(min_digits, max_digits)
        digits = "".join(str(rng.randrange(10)) for _ in range(length))
        if split_of(digits) == split:
            yield Problem(digits)


def problems(n: int, seed: int, split: str = "heldout", min_digits: int = MIN_DIGITS,
             max_digits: int = MAX_DIGITS) -> list[Problem]:
    """The first `n` problems of `problem_stream(seed, split, ...)`."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    stream = problem_stream(seed, split, min_digits, max_digits)
    return [next(stream) for _ in range(n)]


def encode(text: str, add_bos: bool = True) -> list[int]:
    """Token ids of `text` under the byte-level tokenizer: `<BOS>` (unless `add_bos=False`),
    then one id per UTF-8 byte (what `AutoTokenizer(model_dir)(text)["input_ids"]` gives)."""
    return ([BOS_ID] if add_bos else []) + list(text.encode("utf-8"))


def decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`: bytes decoded as UTF-8 (invalid sequences replaced), special tokens
    dropped or, with `skip_special_tokens=False`, written as their names."""
    out, pending = [], bytearray()
    for token in ids:
        if 0 <= token < 256:
            pending.append(token)
            continue
        if token not in SPECIAL_TOKENS:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{VOCAB_SIZE - 1})")
        out.append(pending.decode("utf-8", errors="replace"))
        pending = bytearray()
        if not skip_special_tokens:
            out.append(SPECIAL_TOKENS[token])
    out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)


def answer_of(generated_ids: Sequence[int]) -> tuple[int, ...]:
    """The answer a generation gives: its tokens before the first EOS (all of them if none),
    as a serving API that stops at EOS returns it."""
    ids = tuple(int(t) for t in generated_ids)
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids


def is_correct(generated_ids: Sequence[int], problem: Problem) -> bool:
    """Exact match: the tokens before the first EOS are the reversed digits (nothing more,
    nothing less; a mask or any other token in them is wrong)."""
    return answer_of(generated_ids) == problem.answer_ids


def accuracy(generated: Sequence[Sequence[int]], problems_: Sequence[Problem]) -> float:
    """Fraction of `generated[i]` that answer `problems_[i]` correctly."""
    if len(generated) != len(problems_):
        raise ValueError(f"{len(generated)} generations for {len(problems_)} problems")
    if not problems_:
        raise ValueError("no problems")
    return sum(is_correct(g, p) for g, p in zip(generated, problems_)) / len(problems_)
