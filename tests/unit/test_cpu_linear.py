"""oneDNN linears (workers/engine/cpu_linear.py) compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.engine.config import EngineConfig
from workers.engine.cpu_linear import OneDnnLinear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_equals_nn_linear_for_any_row_count(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(OneDnnLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_keeps_leading_dimensions_and_takes_strided_input():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(3, 5, 128)[..., ::2]  # not contiguous
    with torch.inference_mode():
        got = OneDnnLinear(linear)(x)
        assert got.shape == (3, 5, 48)
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


def test_bfloat16_weights():
    if not onednn_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no bfloat16 oneDNN here")
    torch.manual_seed(1)
    linear = nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(OneDnnLinear(linear)(x).float(), linear(x).float(), rtol=2e-2, atol=2e-2)


def test_pack_linears_replaces_every_linear_and_keeps_shared_weights():
    embed = nn.Embedding(50, 32)
    model = nn.ModuleDict({"embed": embed, "block": nn.Sequential(nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 32)),
                           "head": nn.Linear(32, 50, bias=False)})
    model["head"].weight = embed.weight  # tied, as SmolLM2's LM head
    before = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert pack_linears(model) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model["embed"].weight is embed.weight  # the embedding keeps its (shared) weight
    x = torch.randn(4, 32)
    with torch.inference_mode():
        torch.testing.assert_close(model["head"](x), x @ embed.weight.T, rtol=1e-5, atol=1e-5)
        expected = before["block.2"](torch.nn.functional.silu(before["block.0"](x)))
        torch.testing.assert_close(model["block"](x), expected, rtol=1e-5, atol=1e-5)


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="cpu_linear must be auto, onednn or torch"):
        EngineConfig(model="m", cpu_linear="mkl").validate()
