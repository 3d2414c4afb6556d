"""The LLaDA model family on random demo directories (`splitserve demo-model --arch llada`):
loading and its errors, bidirectional attention, GQA, the Refresh/Reuse K/V forms, and the
reference generate on the real model."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from splitserve.cli.app import app
from splitserve.cli.demo_model import MASK_ID, DemoModelSpec, build_demo_model
from workers.diffusion.reference import DiffusionParams, generate
from workers.engine.models.llada import LladaConfig, expected_weight_shapes, load_llada, positions_from_mask

TINY = dict(arch="llada", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
            vocab_size=300, max_position_embeddings=64, seed=3, initializer_range=0.2)


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    return build_demo_model(DemoModelSpec(**TINY), tmp_path_factory.mktemp("llada"))


@pytest.fixture(scope="module")
def model(llada_dir):
    return load_llada(llada_dir)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            del config[key]
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


_DROP = object()


def test_demo_directory_loads_with_its_tokenizer(llada_dir, model):
    # As the engine and the gateway load it: AutoTokenizer would look `llada` up among transformers'
    # model configs (it has none) and build a generic one, with warnings.
    from transformers import PreTrainedTokenizerFast

    config = model.config
    assert (config.d_model, config.n_heads, config.n_kv_heads, config.n_layers) == (32, 4, 2, 2)
    assert (config.mlp_hidden_size, config.vocab_size, config.embedding_size) == (48, 300, 300)
    assert config.mask_token_id == MASK_ID and not config.weight_tying
    block = model.transformer.blocks[0]
    assert block.k_proj.weight.shape == (2 * 8, 32)  # GQA: 2 kv heads of head_dim 8
    assert block.ff_proj.weight.shape == block.up_proj.weight.shape == (48, 32)
    assert block.ff_out.weight.shape == (32, 48)
    raw = json.loads((llada_dir / "config.json").read_text())
    assert raw["model_type"] == "llada" and raw["architectures"] == ["LLaDAModelLM"]
    assert set(load_file(llada_dir / "model.safetensors")) == set(expected_weight_shapes(config))

    tok = PreTrainedTokenizerFast.from_pretrained(llada_dir)
    assert tok.mask_token_id == config.mask_token_id
    assert tok.encode("hi", add_special_tokens=False) == [104, 105]
    assert tok.decode([104, MASK_ID, 105]) == "h<|mdm_mask|>i"


def test_equals_transformers_llama_with_bidirectional_attention(llada_dir, model):
    """An independent implementation: LLaDA is a Llama whose attention sees every position."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.mlp_hidden_size,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=c.max_sequence_length,
        attn_implementation="eager")).eval()
    renames = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
               "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj", "ff_norm": "post_attention_layernorm",
               "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj"}
    state = {}
    for name, tensor in load_file(llada_dir / "model.safetensors").items():
        name = name.removeprefix("model.transformer.")
        top = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
               "ff_out.weight": "lm_head.weight"}
        if name in top:
            state[top[name]] = tensor
        else:
            _, layer, module, _ = name.split(".")
            state[f"model.layers.{layer}.{renames[module]}.weight"] = tensor
    llama.load_state_dict(state, strict=True)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full_attention = torch.zeros(2, 1, 11, 11)  # a 4-D additive mask: nothing hidden
        expected = llama(input_ids=ids, attention_mask=full_attention).logits
        causal = llama(input_ids=ids).logits
    got = model(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 11, 300)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got - causal).abs().max() > 1e-2


def test_attention_is_bidirectional(model):
    ids = torch.tensor([[256, 104, 105, 106, 107, 108, 109, 110]])
    changed = ids.clone()
    changed[0, 6] = 200
    a, b = model(ids), model(changed)
    assert (a[0, :6] - b[0, :6]).abs().max() > 1e-3  # earlier positions see the later token


@pytest.mark.parametrize("changes, message", [
    ({"d_model": _DROP}, "field 'd_model' is missing"),
    ({"mask_token_id": None}, "field 'mask_token_id' is missing"),
    ({"n_kv_heads": 3}, "n_heads \\(4\\) must be a multiple of n_kv_heads \\(3\\)"),
    ({"mask_token_id": 300}, "mask_token_id must be an int in \\[0, vocab_size=300\\)"),
    ({"n_layers": 0}, "n_layers must be a positive int"),
    ({"rope_theta": "big"}, "rope_theta must be a positive number"),
    ({"weight_tying": "no"}, "weight_tying must be a bool"),
    ({"embedding_size": 200}, "embedding_size \\(200\\) must be >= vocab_size \\(300\\)"),
    ({"model_type": "llama"}, "model_type must be 'llada'"),
    ({"activation_type": "gelu"}, "activation_type = 'gelu' is not supported"),
    ({"block_type": "sequential"}, "block_type"),
])
def test_config_errors_name_the_field(llada_dir, tmp_path, changes, message):
    bad = _copy_with_config(llada_dir, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message) as err:
        LladaConfig.from_dir(bad)
    assert "config.json" in str(err.value)


def test_config_defaults_follow_modeling_llada(llada_dir, tmp_path):
    relaxed = _copy_with_config(llada_dir, tmp_path / "ok", n_kv_heads=None, embedding_size=None,
                                mlp_hidden_size=None, mlp_ratio=4)
    config = LladaConfig.from_dir(relaxed)
    assert (config.n_kv_heads, config.embedding_size, config.mlp_hidden_size) == (4, 300, 4 * 32)


def test_missing_or_misshapen_weight_is_named(llada_dir, tmp_path):
    weights = load_file(llada_dir / "model.safetensors")
    missing = tmp_path / "missing"
    shutil.copytree(llada_dir, missing)
    save_file({k: v for k, v in weights.items() if k != "model.transformer.blocks.1.up_proj.weight"},
              str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape("lacks weights: ['model.transformer.blocks.1.up_proj.weight']")):
        load_llada(missing)

    misshapen = tmp_path / "misshapen"
    shutil.copytree(llada_dir, misshapen)
    weights["model.transformer.blocks.0.ff_out.weight"] = torch.zeros(32, 24)
    save_file(weights, str(misshapen / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape("blocks.0.ff_out.weight has shape (32, 24), expected (32, 48)")):
        load_llada(misshapen)


def test_tied_embeddings_and_plain_multi_head_attention(tmp_path):
    path = build_demo_model(DemoModelSpec(**{**TINY, "num_kv_heads": 4, "tie_word_embeddings": True}), tmp_path)
    assert "model.transformer.ff_out.weight" not in load_file(path / "model.safetensors")
    model = load_llada(path)
    assert model.config.weight_tying and model.config.n_kv_heads == 4
    assert "ff_out" not in model.transformer  # the LM head is the input embedding
    ids = torch.tensor([[256, 104, MASK_ID]])
    before = model(ids)
    with torch.no_grad():
        model.transformer.wte.weight[7] += 1.0  # a row no input uses: only its logit moves
    after = model(ids)
    assert (after[..., 7] - before[..., 7]).abs().max() > 1e-3
    torch.testing.assert_close(after[..., 8:], before[..., 8:], atol=0, rtol=0)


def test_reuse_forward_against_refresh_kv_reproduces_the_full_forward(model):
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    refresh = model.forward_with_kv(ids)
    torch.testing.assert_close(refresh.logits, model(ids), atol=0, rtol=0)
    assert len(refresh.kv) == 2 and refresh.kv[0].keys.shape == (2, 2, 12, 8)
    cache_before = [(kv.keys.clone(), kv.values.clone()) for kv in refresh.kv]

    # Row 0 recomputes block 4..7, row 1 block 6..9 (rows may be at different blocks).
    query_index = torch.tensor([[4, 5, 6, 7], [6, 7, 8, 9]])
    reuse = model.forward_queries(ids.gather(1, query_index), query_index, refresh.kv)
    torch.testing.assert_close(reuse.logits, refresh.logits.gather(1, query_index[..., None].expand(-1, -1, 300)),
                               atol=1e-5, rtol=1e-5)
    for layer_fresh, layer_cached in zip(reuse.kv, refresh.kv):
        for row in range(2):
            torch.testing.assert_close(layer_fresh.keys[row], layer_cached.keys[row][:, query_index[row]],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer_fresh.values[row], layer_cached.values[row][:, query_index[row]],
                                       atol=1e-5, rtol=1e-5)
    for (keys, values), kv in zip(cache_before, refresh.kv):  # Reuse leaves the cache alone
        assert torch.equal(keys, kv.keys) and torch.equal(values, kv.values)



def test_reuse_after_the_block_changed_uses_fresh_block_kv(tmp_path, model):
    """With one layer the context's keys/values depend on its own tokens only, so a Reuse step
    after the block's tokens changed equals a full recompute; with two the context is stale."""
    one_layer = load_llada(build_demo_model(DemoModelSpec(**{**TINY, "num_layers": 1}), tmp_path))
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(4))
    ids[0, 4:8] = MASK_ID
    query_index = torch.tensor([[4, 5, 6, 7]])
    changed = ids.clone()
    changed[0, 4:6] = torch.tensor([200, 201])
    for layers, m in ((1, one_layer), (2, model)):
        cache = m.forward_with_kv(ids).kv
        reuse = m.forward_queries(changed[:, 4:8], query_index, cache).logits
        recompute = m(changed)[:, 4:8]
        if layers == 1:
            torch.testing.assert_close(reuse, recompute, atol=1e-5, rtol=1e-5)
        else:
            assert (reuse - recompute).abs().max() > 1e-4


def test_reuse_forward_refuses_bad_arguments(model):
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(2))
    kv = model.forward_with_kv(ids).kv
    with pytest.raises(ValueError, match="query_index must lie in \\[0, 6\\)"):
        model.forward_queries(ids[:, :2], torch.tensor([[5, 6]]), kv)
    with pytest.raises(ValueError, match="must not repeat"):
        model.forward_queries(ids[:, :2], torch.tensor([[3, 3]]), kv)
    with pytest.raises(ValueError, match="cached_kv has 1 layers"):
        model.forward_queries(ids[:, :2], torch.tensor([[0, 1]]), kv[:1])
    with pytest.raises(ValueError, match="max_sequence_length=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_left_padding_with_counted_positions_equals_each_row_alone(model):
    short, long = [256, 104, 105, MASK_ID, MASK_ID], [256, 70, 71, 72, 73, 74, MASK_ID, MASK_ID]
    pad = 258
    ids = torch.tensor([[pad] * 3 + short, long])
    mask = torch.tensor([[False] * 3 + [True] * 5, [True] * 8])
    batched = model(ids, attention_mask=mask, positions=positions_from_mask(mask))
    torch.testing.assert_close(batched[0, 3:], model(torch.tensor([short]))[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[1], model(torch.tensor([long]))[0], atol=1e-5, rtol=1e-5)


def test_reference_generate_unmasks_every_position_one_per_step(model):
    params = DiffusionParams(gen_length=8, block_length=4, steps=8)
    (out,) = generate(model, [[256, 104, 105]], params, mask_token_id=MASK_ID)
    assert len(out.tokens) == 8 and MASK_ID not in out.tokens
    assert sorted(out.commit_step) == list(range(8))
    assert max(out.commit_step[:4]) < min(out.commit_step[4:])  # block 0 before block 1


def test_reference_batch_of_different_lengths_equals_each_alone(model):
    prompts = [[256, 104, 105], [256, 70, 71, 72, 73, 74, 75], [256, 33, 34, 35, 36]]
    params = DiffusionParams(gen_length=6, block_length=3, steps=4, temperature=0.8, cfg_scale=0.5)
    seeds = [21, 22, 23]
    batch = generate(model, prompts, params, mask_token_id=MASK_ID,
                     generators=[torch.Generator().manual_seed(s) for s in seeds])
    for prompt, seed, out in zip(prompts, seeds, batch):
        (alone,) = generate(model, [prompt], params, mask_token_id=MASK_ID,
                            generators=[torch.Generator().manual_seed(seed)])
        assert out == alone
        assert MASK_ID not in out.tokens


def test_demo_model_cli_writes_llada(tmp_path):
    result = CliRunner().invoke(app, [
        "demo-model", "--arch", "llada", "--out", str(tmp_path / "m"), "--hidden", "32", "--layers", "1",
        "--heads", "4", "--kv-heads", "2", "--intermediate", "48", "--vocab", "300", "--max-positions", "64"])
    assert result.exit_code == 0, result.output
    config = LladaConfig.from_dir(tmp_path / "m")
    assert (config.d_model, config.n_layers, config.mask_token_id) == (32, 1, MASK_ID)
    assert load_llada(tmp_path / "m")(torch.tensor([[256, MASK_ID]])).shape == (1, 2, 300)


@pytest.mark.parametrize("kwargs, field", [
    ({"vocab_size": 259}, "vocab_size must be >= 260 for llada"),
    ({"head_dim": 16}, "head_dim must be None for llada"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling must be None for llada"),
])
def test_bad_llada_demo_spec_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DemoModelSpec(**{**TINY, **kwargs})
