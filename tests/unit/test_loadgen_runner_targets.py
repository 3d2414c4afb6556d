"""The OpenAI HTTP target's SSE parsing, token counting and fallbacks, against httpx.MockTransport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loadgen.plan import BenchRequest
from loadgen.targets import OpenAITarget, make_target, normalise_base_url, synthetic_text, target_tls

MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 512}]}


def _sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _chunk(text: str, usage: dict | None = None, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": usage}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Server:
    """A scripted OpenAI server: ``completions(body) -> httpx.Response``; records request bodies."""

    def __init__(self, completions, path: str = "/v1/completions"):
        self.completions = completions
        self.path = path
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        assert request.url.path == self.path
        body = json.loads(request.content)
        self.bodies.append(body)
        return self.completions(body)


def _send(server, *requests: BenchRequest, **kwargs):
    async def go():
        target = OpenAITarget("http://test/v1", transport=httpx.MockTransport(server), **kwargs)
        try:
            return target, [await target.send(r) for r in requests]
        finally:
            await target.aclose()

    return asyncio.run(go())


REQUEST = BenchRequest("r0", [5, 6, 7], 5)


def test_final_usage_is_the_truth_and_token_times_are_what_the_stream_showed():
    events = [_chunk("a"), _chunk("bc"), _chunk("d", finish="length"),
              {"object": "text_completion", "choices": [], "usage": _usage(3, 5)}]
    server = Server(lambda body: httpx.Response(200, content=_sse(*events)))
    target, (result,) = _send(server, REQUEST)
    assert result.ok and result.error is None
    assert result.output_len == 5 and len(result.token_times_s) == 3
    assert result.prompt_len == 3
    assert result.token_times_s[-1] <= result.end_s
    assert result.first_token_s == result.token_times_s[0] >= result.arrival_s
    body = server.bodies[0]
    assert body["model"] == "tiny" and body["prompt"] == [5, 6, 7] and body["max_tokens"] == 5
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"]["include_usage"] is True
    assert "session_id" not in body


def test_continuous_usage_counts_tokens_per_chunk():
    events = [_chunk("a", _usage(3, 1)), _chunk("bcd", _usage(3, 4)), _chunk("e", _usage(3, 5), "length"),
              {"object": "text_completion", "choices": [], "usage": _usage(3, 5)}]
    server = Server(lambda body: httpx.Response(200, content=_sse(*events)))
    _, (result,) = _send(server, BenchRequest("r0", [1, 2, 3], 5, session_id="s", round_index=1))
    times = result.token_times_s
    assert len(times) == 5 and times[1] == times[2] == times[3]
    assert result.session_id == "s" and result.round_index == 1
    assert server.bodies[0]["session_id"] == "s"


def test_the_chat_api_sends_one_user_message_and_counts_content_deltas():
    def delta(content: str, usage=None) -> dict:
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}],
                "usage": usage}

    events = [delta("a", _usage(9, 1)), delta("bc", _usage(9, 3)), delta("d", _usage(9, 4)),
              {"object": "chat.completion.chunk", "choices": [], "usage": _usage(9, 4)}]
    server = Server(lambda body: httpx.Response(200, content=_sse(*events)), path="/v1/chat/completions")
    target, (result,) = _send(server, REQUEST, api="chat")
    assert result.ok and result.output_len == 4 and len(result.token_times_s) == 4
    body = server.bodies[0]
    assert body["messages"] == [{"role": "user", "content": synthetic_text([5, 6, 7])}] and "prompt" not in body
    assert body["max_tokens"] == 5 and body["stream"] is True
    assert not target.token_id_prompts


def test_the_chat_api_needs_an_http_target():
    with pytest.raises(ValueError, match="--api chat"):
        make_target("127.0.0.1:50051", api="chat")
    with pytest.raises(ValueError, match="api"):
        OpenAITarget("http://test/v1", api="embeddings")


def test_output_shown_only_at_the_end_gets_one_time():
    events = [_chunk("", finish="length"), {"object": "text_completion", "choices": [], "usage": _usage(3, 4)}]
    _, (result,) = _send(Server(lambda body: httpx.Response(200, content=_sse(*events))), REQUEST)
    assert result.ok and result.output_len == 4 and result.token_times_s == [result.first_token_s]


def test_refused_token_ids_fall_back_to_text_for_good():
    def completions(body):
        if isinstance(body["prompt"], list):
            return httpx.Response(400, json={"error": {"message": "prompt must be a string"}})
        return httpx.Response(200, content=_sse(_chunk("x", _usage(3, 1), "length")))

    server = Server(completions)
    target, results = _send(server, BenchRequest("r0", [5, 6, 7], 1), BenchRequest("r1", [8, 9], 1))
    assert all(r.ok for r in results)
    assert not target.token_id_prompts
    assert [type(b["prompt"]).__name__ for b in server.bodies] == ["list", "str", "str"]
    assert server.bodies[1]["prompt"] == synthetic_text([5, 6, 7])


@pytest.mark.parametrize("response, expected", [
    (httpx.Response(429, json={"error": {"message": "overloaded"}}), "HTTP 429: overloaded"),
    (httpx.Response(400, json={"error": {"message": "prompt is too long for max_model_len"}}),
     "HTTP 400: prompt is too long for max_model_len"),
    (httpx.Response(200, content=_sse(_chunk("a"), {"error": {"message": "worker died"}})),
     "stream error: worker died"),
])
def test_errors_become_failed_results(response, expected):
    _, (result,) = _send(Server(lambda body: response), REQUEST)
    assert not result.ok and result.error == expected


def test_connection_errors_never_raise():
    def refuse(request):
        raise httpx.ConnectError("connection refused")

    _, (result,) = _send(refuse, REQUEST, model="m")
    assert not result.ok and "ConnectError" in result.error and result.output_len == 0


def test_target_selection_and_urls():
    assert make_target("http://h:8000/v1").kind == "openai"
    assert make_target("127.0.0.1:50051").kind == "grpc"
    assert normalise_base_url("http://h:8000") == "http://h:8000/v1"
    assert normalise_base_url("https://h/api/v1/") == "https://h/api/v1"


# ---- --target: accepted forms, and nothing answering ------------------------------------------

@pytest.mark.parametrize("text, kind, address, host, port", [
    ("127.0.0.1:50051", "grpc", "127.0.0.1:50051", "127.0.0.1", 50051),
    ("grpc://127.0.0.1:7000", "grpc", "127.0.0.1:7000", "127.0.0.1", 7000),  # the alias gRPC itself lacks
    ("GRPC://gw.local:7000/", "grpc", "gw.local:7000", "gw.local", 7000),
    ("[::1]:7000", "grpc", "[::1]:7000", "::1", 7000),
    ("http://127.0.0.1:8000/v1", "http", "http://127.0.0.1:8000/v1", "127.0.0.1", 8000),
    ("https://api.example.com/v1", "http", "https://api.example.com/v1", "api.example.com", 443),
    ("http://localhost", "http", "http://localhost", "localhost", 80),
])
def test_accepted_target_forms(text, kind, address, host, port):
    from loadgen.targets import TargetAddress, parse_target

    assert parse_target(text) == TargetAddress(kind, address, host, port)


@pytest.mark.parametrize("text, message", [
    ("grpcs://127.0.0.1:7000", "unknown scheme 'grpcs://'"),
    ("dns:///127.0.0.1:7000", "unknown scheme 'dns://'"),
    ("127.0.0.1", "expected a host and a port"),
    ("127.0.0.1:0", "expected a host and a port"),
    ("127.0.0.1:99999", "expected a host and a port"),
    ("grpc://127.0.0.1:7000/v1", "without a path"),
    (":7000", "expected a host"),
])
def test_refused_target_forms_name_the_accepted_ones(text, message):
    from loadgen.targets import ACCEPTED_TARGETS, parse_target

    with pytest.raises(ValueError, match="--target") as err:
        parse_target(text)
    assert message in str(err.value) and ACCEPTED_TARGETS in str(err.value)


def test_make_target_dials_the_alias_without_its_scheme():
    target = make_target("grpc://127.0.0.1:7000")
    assert target.kind == "grpc" and target.address == "127.0.0.1:7000"


def test_check_reachable_on_a_closed_and_an_open_port():
    import socket

    from loadgen.targets import TargetUnreachable, check_reachable, parse_target

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        check_reachable(parse_target(f"grpc://127.0.0.1:{port}"))  # something answers: no error
    with pytest.raises(TargetUnreachable, match=rf"--target 127.0.0.1:{port}: nothing answers"):
        check_reachable(parse_target(f"127.0.0.1:{port}"))  # the listener is closed


# ---- TLS options -----------------------------------------------------------------------------


def test_no_tls_option_means_plaintext_grpc_and_system_roots_for_https():
    assert target_tls() is None
    assert make_target("127.0.0.1:50051").tls is None
    assert make_target("https://127.0.0.1:8000/v1").verify is True


def test_tls_options_reach_both_kinds_of_target(tmp_path):
    from tests.tls_support import make_test_certs

    certs = make_test_certs(tmp_path)
    tls = target_tls(ca_file=str(certs["ca"]), cert_file=str(certs["client"]), key_file=str(certs["client_key"]),
                     server_name="gateway")
    grpc_target = make_target("127.0.0.1:50051", tls=tls)
    assert grpc_target.tls == tls and tls.sdk_options()["server_name"] == "gateway"
    https_target = make_target("https://127.0.0.1:8000/v1", tls=target_tls(ca_file=str(certs["ca"]),
                                                                            cert_file=str(certs["client"]),
                                                                            key_file=str(certs["client_key"])))
    trusted = https_target.verify.get_ca_certs()
    assert len(trusted) == 1 and "splitserve local CA" in str(trusted[0]["subject"])  # the test CA, not the system's
    assert target_tls(tls=True) is not None  # --tls alone: the system roots


@pytest.mark.parametrize("options, field", [
    (dict(ca_file="/no/such/ca.pem"), "tls_ca_file"),
    (dict(cert_file=__file__, key_file=__file__), "tls_cert_file"),  # not a PEM certificate
    (dict(key_file="/no/such/client.key"), "tls_cert_file"),  # a key without its certificate
])
def test_bad_tls_options_are_refused_naming_the_option(options, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        target_tls(**options)


def test_tls_options_with_a_plain_http_url_are_refused():
    with pytest.raises(ValueError, match="https://"):
        make_target("http://127.0.0.1:8000/v1", tls=target_tls(tls=True))
    with pytest.raises(ValueError, match="^tls_server_name: "):
        make_target("https://127.0.0.1:8000/v1", tls=target_tls(server_name="gateway"))
