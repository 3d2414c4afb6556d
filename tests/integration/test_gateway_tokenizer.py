"""The gateway's tokenizer: AutoTokenizer's own class, loaded without torch when that class is
the generic tokenizer.json one (a gateway needs no tensors; importing torch cost ~3 s of every
gateway's start and ~230 MB of its memory)."""

from __future__ import annotations

import json
import subprocess
import sys

from real_model_support import FRANCE, PHOTOSYNTHESIS, real_model, real_tokenizer  # noqa: F401 (fixtures)

from gateway.tokenization import Tokenization, _generic_fast_tokenizer

TEXTS = ["The capital of France is", "  spaces\tand\nnewlines  ", "émigré naïve 東京 🙂", ""]


def test_the_real_models_tokenizer_loads_without_torch_and_equals_autotokenizer(real_model, real_tokenizer):
    probe = ("import sys, json; from gateway.tokenization import Tokenization; "
             f"t = Tokenization.from_model_dir({str(real_model)!r}); "
             "print(json.dumps([type(t.tokenizer).__name__, 'torch' in sys.modules]))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    class_name, imported_torch = json.loads(run.stdout.strip().splitlines()[-1])
    assert class_name == type(real_tokenizer).__name__
    assert imported_torch is False
    ours = Tokenization.from_model_dir(real_model)
    for text in TEXTS:
        assert ours.encode_prompt(text) == real_tokenizer.encode(text)
    for messages in (FRANCE, PHOTOSYNTHESIS):
        text, _ = ours.render_chat(messages)
        assert text == real_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_only_a_plain_tokenizer_json_tokenizer_skips_autotokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    for name, expected in (("TokenizersBackend", True), ("PreTrainedTokenizerFast", True),
                           ("Qwen2Tokenizer", False), ("LlamaTokenizer", False), (None, False)):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": name}))
        assert _generic_fast_tokenizer(tmp_path) is expected, name
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert _generic_fast_tokenizer(tmp_path) is False
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert _generic_fast_tokenizer(tmp_path) is False  # a sentencepiece-only directory: AutoTokenizer
