"""API-key checks of the shared gateway core (HTTP Authorization header and gRPC metadata use the same)."""

from __future__ import annotations

import pytest

from gateway.core import GatewayCore, served_model_name
from gateway.tokenization import Tokenization
from splitserve.config import GatewayConfig
from splitserve.errors import Unauthenticated


class TinyTokenizer:
    chat_template = None

    def __len__(self) -> int:
        return 10


def core(**config) -> GatewayCore:
    cfg = GatewayConfig(model="/models/demo-llama", **config)
    return GatewayCore(cfg, Tokenization(TinyTokenizer(), max_model_len=128), coordinator=None)


def test_no_keys_configured_means_no_auth():
    open_core = core()  # the config's default api_keys
    open_core.authenticate(None)
    open_core.authenticate("Bearer anything")


@pytest.mark.parametrize("header,fragment", [
    (None, "missing API key"),
    ("", "missing API key"),
    ("Basic k1", "missing API key"),
    ("Bearer", "missing API key"),
    ("Bearer k3", "invalid API key"),
    ("Bearer k1x", "invalid API key"),
])
def test_wrong_or_missing_key_is_unauthenticated(header, fragment):
    with pytest.raises(Unauthenticated, match=fragment) as info:
        core(api_keys=["k1", "k2"]).authenticate(header)
    assert info.value.http_status == 401


@pytest.mark.parametrize("header", ["Bearer k1", "bearer k2", "  Bearer   k2 "])
def test_any_configured_key_is_accepted(header):
    core(api_keys=["k1", "k2"]).authenticate(header)


def test_served_model_name_defaults_to_the_directory_name():
    assert served_model_name(GatewayConfig(model="/models/demo-llama/")) == "demo-llama"
    assert served_model_name(GatewayConfig(model="/m/x", served_model_name="llama-3")) == "llama-3"
    c = core(default_max_tokens=8, max_tokens_limit=64)
    assert (c.limits.served_model, c.limits.max_model_len, c.limits.default_max_tokens, c.limits.max_tokens_limit) == (
        "demo-llama", 128, 8, 64)


def test_max_model_len_option_overrides_the_tokenizer_directory():
    """An emulated cluster's gateway takes the preset's context (its workers accept 8,192 tokens of
    Llama-3-8B although the tokenizer directory says 2,048)."""
    from splitserve.cli.launcher import emulated_gateway_args

    assert core().limits.max_model_len == 128
    args = emulated_gateway_args("emulated", "llama-3-8b")
    assert args == {"max_model_len": 8192}
    assert core(**args).limits.max_model_len == 8192
    assert emulated_gateway_args("real", "llama-3-8b") == {}
