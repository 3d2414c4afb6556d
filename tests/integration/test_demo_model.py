import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from splitserve.cli.demo_model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    DemoModelSpec,
    _model_config,
    bench_model_spec,
    build_demo_model,
)

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
TEXT = "héllo wörld ✓"
ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _st_dtypes(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.fixture(scope="module", params=ARCHS)
def built(request, tmp_path_factory):
    arch = request.param
    # Each arch also exercises a different dtype.
    dtype = {"llama": "float32", "qwen2": "bfloat16", "qwen3": "float16", "mistral": "float32"}[arch]
    spec = DemoModelSpec(arch=arch, dtype=dtype)
    return spec, build_demo_model(spec, tmp_path_factory.mktemp(arch))


def test_model_loads_and_generates(built):
    spec, path = built
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.model_type == spec.arch
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert model.config.vocab_size == spec.vocab_size
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (spec.num_kv_heads * spec.resolved_head_dim, spec.hidden_size)
    assert (attn.q_proj.bias is not None) == (spec.arch == "qwen2")
    assert model.generation_config.eos_token_id == EOS_ID
    assert model.generation_config.pad_token_id == PAD_ID

    tok = AutoTokenizer.from_pretrained(path)
    inputs = tok("hello", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 5)
    assert out.max() < spec.vocab_size


def test_weights_have_requested_dtype(built):
    spec, path = built
    assert set(_st_dtypes(path).values()) == {ST_DTYPES[spec.dtype]}
    assert json.loads((path / "config.json").read_text())["dtype"] == spec.dtype


def test_tokenizer_round_trip(built):
    _, path = built
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.encode(TEXT) == [BOS_ID, *ids]
    assert tok.decode([BOS_ID, *ids, EOS_ID], skip_special_tokens=True) == TEXT
    # Ids the model may emit beyond the tokenizer's 259 are dropped, not an error.
    assert tok.decode([104, 300, 105, 511]) == "hi"
    # An incomplete UTF-8 sequence decodes to U+FFFD.
    assert tok.decode([104, 0xE2, 0x9C]) == "h\ufffd"


def test_chat_template(built):
    _, path = built
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXT}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    body = f"<|system|>\nbe brief\n<|user|>\n{TEXT}\n<|assistant|>\n"
    assert text == "<|begin_of_text|>" + body
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == [BOS_ID, *body.encode("utf-8")]
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("<|assistant|>\n")


def test_same_seed_same_weights(tmp_path):
    spec = DemoModelSpec(arch="llama", seed=7)
    a = load_file(build_demo_model(spec, tmp_path / "a") / "model.safetensors")
    b = load_file(build_demo_model(spec, tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = load_file(build_demo_model(DemoModelSpec(arch="llama", seed=8), tmp_path / "c") / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_demo_model(DemoModelSpec(arch="llama"), tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_tied_embeddings(tmp_path):
    path = build_demo_model(DemoModelSpec(arch="qwen3", tie_word_embeddings=True), tmp_path)
    assert "lm_head.weight" not in _st_dtypes(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_llama3_rope_scaling(tmp_path):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 500000.0,
    }
    spec = DemoModelSpec(arch="llama", rope_scaling=rope)
    path = build_demo_model(spec, tmp_path)
    assert spec.rope_scaling == rope  # not mutated by the config
    config = AutoConfig.from_pretrained(path)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == 8.0
    model = AutoModelForCausalLM.from_pretrained(path)
    out = model.generate(torch.tensor([[BOS_ID, 104, 105]]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, 8)


def test_explicit_head_dim(tmp_path):
    path = build_demo_model(DemoModelSpec(arch="qwen2", hidden_size=48, num_heads=4, head_dim=16), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 48)


def test_idempotent_and_overwrite(tmp_path):
    spec = DemoModelSpec(arch="llama")
    path = build_demo_model(spec, tmp_path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert build_demo_model(spec, tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime

    other = DemoModelSpec(arch="llama", seed=1)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_demo_model(other, tmp_path)
    build_demo_model(other, tmp_path, overwrite=True)
    assert json.loads((path / "splitserve_demo.json").read_text())["spec"]["seed"] == 1


def test_existing_foreign_model_dir_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        build_demo_model(DemoModelSpec(arch="llama"), tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"dtype": "int8"}, "dtype"),
        ({"vocab_size": 258}, "vocab_size"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 66}, "hidden_size"),
        ({"head_dim": 15}, "head_dim"),
        ({"num_layers": 0}, "num_layers"),
        ({"initializer_range": 0.0}, "initializer_range"),
        ({"rope_scaling": {"factor": 8.0}}, "rope_scaling"),
    ],
)
def test_bad_spec_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DemoModelSpec(**{"arch": "llama", **kwargs})


def test_bench_spec_is_about_50m_params():
    spec = bench_model_spec()
    assert (spec.arch, spec.hidden_size, spec.num_layers, spec.vocab_size) == ("llama", 512, 8, 32000)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_model_config(spec))
    assert 45e6 < model.num_parameters() < 60e6
