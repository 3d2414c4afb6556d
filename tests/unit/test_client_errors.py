"""SDK: status → typed error mapping, retry policy and backoff, request building, retry loop over fake stubs."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve import client as sdk
from splitserve.client import (
    AuthenticationError,
    DeadlineExceededError,
    GenerateOptions,
    InvalidRequestError,
    NotFoundError,
    RateLimitedError,
    RequestCancelledError,
    ServiceUnavailableError,
    SplitserveClientError,
    StreamChunk,
    Usage,
    backoff_delay,
    build_generate_request,
    error_from_status,
    should_retry,
)
from splitserve.proto import gateway_pb2, types_pb2

S = grpc.StatusCode


@pytest.mark.parametrize("code,cls", [
    (S.INVALID_ARGUMENT, InvalidRequestError),
    (S.OUT_OF_RANGE, InvalidRequestError),
    (S.NOT_FOUND, NotFoundError),
    (S.UNAUTHENTICATED, AuthenticationError),
    (S.PERMISSION_DENIED, AuthenticationError),
    (S.RESOURCE_EXHAUSTED, RateLimitedError),
    (S.UNAVAILABLE, ServiceUnavailableError),
    (S.DEADLINE_EXCEEDED, DeadlineExceededError),
    (S.CANCELLED, RequestCancelledError),
    (S.INTERNAL, SplitserveClientError),
    (S.UNKNOWN, SplitserveClientError),
])
def test_status_codes_map_to_typed_errors(code, cls):
    err = error_from_status(code, "details here")
    assert type(err) is cls and isinstance(err, SplitserveClientError)
    assert err.code == code and err.message == "details here" and str(err) == "details here"


def test_not_found_is_an_invalid_request_and_empty_details_fall_back_to_the_code():
    assert isinstance(error_from_status(S.NOT_FOUND, ""), InvalidRequestError)
    assert error_from_status(S.UNAVAILABLE, None).message == "UNAVAILABLE"


@pytest.mark.parametrize("trailing,expected", [
    ([("retry-after-ms", "1500")], 1.5),
    ((("other", "x"), ("retry-after-ms", b"250")), 0.25),
    ([("retry-after-ms", "soon")], None),
    ([], None),
    (None, None),
])
def test_rate_limited_reads_the_retry_hint(trailing, expected):
    err = error_from_status(S.RESOURCE_EXHAUSTED, "busy", trailing)
    assert isinstance(err, RateLimitedError) and err.retry_after_s == expected


def test_retry_only_unavailable_only_before_the_first_response():
    assert should_retry(S.UNAVAILABLE, received_first_response=False, attempt=0, max_retries=3)
    assert should_retry(S.UNAVAILABLE, received_first_response=False, attempt=2, max_retries=3)
    assert not should_retry(S.UNAVAILABLE, received_first_response=False, attempt=3, max_retries=3)
    assert not should_retry(S.UNAVAILABLE, received_first_response=True, attempt=0, max_retries=3)
    for code in (S.RESOURCE_EXHAUSTED, S.DEADLINE_EXCEEDED, S.INTERNAL, S.CANCELLED, S.INVALID_ARGUMENT):
        assert not should_retry(code, received_first_response=False, attempt=0, max_retries=3)


def test_backoff_is_exponential_capped_and_jittered():
    assert [backoff_delay(a, 0.1, rand=1.0) for a in range(4)] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert backoff_delay(2, 0.1, rand=0.0) == pytest.approx(0.2)  # jitter keeps at least half
    assert backoff_delay(20, 0.1, max_backoff_s=5.0, rand=1.0) == 5.0
    assert 0.05 <= backoff_delay(0, 0.1) <= 0.1


def test_request_always_echoes_token_ids_and_leaves_unset_options_unset():
    req = build_generate_request("hi")
    assert req.text == "hi" and req.echo_token_ids and len(req.request_id) == 32
    assert req.sampling.max_tokens == 16
    for name in ("temperature", "top_p", "seed"):
        assert not req.sampling.HasField(name)
    greedy = build_generate_request([1, 2], max_tokens=None, temperature=0.0, top_k=5, seed=9, stop="END",
                                    stop_token_ids=[7], ignore_eos=True, session_id="s", slo_ttft_ms=100,
                                    slo_itl_ms=20, priority=1, request_id="rid")
    assert list(greedy.token_ids.ids) == [1, 2] and not greedy.sampling.HasField("max_tokens")
    assert greedy.sampling.HasField("temperature") and greedy.sampling.temperature == 0.0  # greedy is explicit
    assert (greedy.sampling.top_k, greedy.sampling.seed, list(greedy.sampling.stop)) == (5, 9, ["END"])
    assert list(greedy.sampling.stop_token_ids) == [7] and greedy.sampling.ignore_eos
    assert (greedy.session_id, greedy.slo.ttft_ms, greedy.slo.itl_ms, greedy.priority, greedy.request_id) == (
        "s", 100, 20, 1, "rid")


def test_options_are_reused_and_keywords_override_them():
    greedy = GenerateOptions(temperature=0.0, stop=["END"], slo_ttft_ms=100)
    req = build_generate_request("hi", greedy, max_tokens=4, seed=2)
    assert (req.sampling.max_tokens, req.sampling.temperature, req.sampling.seed) == (4, 0.0, 2)
    assert (list(req.sampling.stop), req.slo.ttft_ms) == (["END"], 100)
    assert (greedy.max_tokens, greedy.seed, greedy.stop) == (16, None, ("END",))  # the shared options are unchanged
    with pytest.raises(TypeError, match="'max_token'"):
        build_generate_request("hi", max_token=4)
    with pytest.raises(TypeError, match="GenerateOptions"):
        build_generate_request("hi", 4)  # the old positional max_tokens


@pytest.mark.parametrize("prompt", [3, None, [1, "a"], [True]])
def test_request_rejects_bad_prompt_types(prompt):
    with pytest.raises(TypeError, match="prompt"):
        build_generate_request(prompt)


def test_result_accumulates_chunks():
    chunks = [StreamChunk("He", [1, 2], "", None, "r"), StreamChunk("y", [3], "stop", Usage(4, 3, 7), "r")]
    result = sdk._result(chunks, "fallback")
    assert (result.text, result.token_ids, result.finish_reason, result.usage, result.request_id) == (
        "Hey", [1, 2, 3], "stop", Usage(4, 3, 7), "r")


def test_expired_deadline_raises_deadline_exceeded():
    with pytest.raises(DeadlineExceededError):
        sdk._Deadline(0.0).remaining()
    assert sdk._Deadline(None).remaining() is None


# --- the retry loop, over fake stubs (no server)

def response(text: str, finish: str = "") -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(request_id="r", text=text, finish_reason=finish)
    if finish:
        msg.usage.CopyFrom(types_pb2.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2))
    return msg


def aio_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom")


class FakeAsyncCall:
    def __init__(self, script):
        self.script = script
        self.cancelled = False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item

    def cancel(self):
        self.cancelled = True


class FakeStub:
    """Generate returns the next scripted call: a list of responses and/or a final error."""

    def __init__(self, make_call, scripts):
        self.make_call = make_call
        self.scripts = list(scripts)
        self.calls = []

    def Generate(self, request, timeout=None, metadata=()):
        call = self.make_call(self.scripts.pop(0))
        self.calls.append(call)
        return call


def run_async(scripts, **client_kw):
    async def go():
        client = sdk.AsyncClient("127.0.0.1:1", backoff_s=0.001, **client_kw)
        client._stub = FakeStub(FakeAsyncCall, scripts)
        try:
            return await client.generate("hi"), client._stub
        except SplitserveClientError as err:
            return err, client._stub
        finally:
            await client.close()

    return asyncio.run(go())


def test_async_retries_unavailable_before_the_first_token():
    result, stub = run_async([[aio_error(S.UNAVAILABLE)], [aio_error(S.UNAVAILABLE)], [response("ok", "stop")]])
    assert result.text == "ok" and len(stub.calls) == 3


def test_async_generate_retries_whole_after_partial_output():
    # Nothing partial reached the caller: the answer is the retry's alone, not "par" + "again".
    result, stub = run_async([[response("par"), aio_error(S.UNAVAILABLE)], [response("again", "stop")]])
    assert result.text == "again" and len(stub.calls) == 2


def test_async_stream_never_retries_after_the_first_token():
    async def go():
        client = sdk.AsyncClient("127.0.0.1:1", backoff_s=0.001)
        client._stub = FakeStub(FakeAsyncCall, [[response("par"), aio_error(S.UNAVAILABLE)],
                                                [response("again", "stop")]])
        got = []
        try:
            async for chunk in client.stream("hi"):
                got.append(chunk.text)
        except SplitserveClientError as err:
            return got, err, len(client._stub.calls)
        finally:
            await client.close()
        return got, None, len(client._stub.calls)

    got, err, calls = asyncio.run(go())
    assert got == ["par"] and isinstance(err, ServiceUnavailableError) and calls == 1


def test_async_gives_up_after_max_retries_and_does_not_retry_other_codes():
    result, stub = run_async([[aio_error(S.UNAVAILABLE)]] * 3, max_retries=2)
    assert isinstance(result, ServiceUnavailableError) and len(stub.calls) == 3
    result, stub = run_async([[aio_error(S.RESOURCE_EXHAUSTED)], [response("ok", "stop")]])
    assert isinstance(result, RateLimitedError) and len(stub.calls) == 1


def test_async_stream_closed_early_cancels_the_call():
    async def go():
        client = sdk.AsyncClient("127.0.0.1:1")
        client._stub = FakeStub(FakeAsyncCall, [[response("a"), response("b"), response("c", "stop")]])
        stream = client.stream("hi")
        async for _ in stream:
            break
        await stream.aclose()
        await client.close()
        return client._stub.calls[0].cancelled

    assert asyncio.run(go())


class FakeRpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "boom"

    def trailing_metadata(self):
        return ()


class FakeSyncCall(FakeAsyncCall):
    def __iter__(self):
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item


def test_sync_client_retries_the_same_way():
    client = sdk.Client("127.0.0.1:1", backoff_s=0.001)
    client._stub = FakeStub(FakeSyncCall, [[FakeRpcError(S.UNAVAILABLE)], [response("o"), response("k", "stop")]])
    result = client.generate("hi")
    assert (result.text, result.finish_reason, result.usage.total_tokens) == ("ok", "stop", 2)
    # generate: retried whole after partial output; the answer is the retry's alone.
    client._stub = FakeStub(FakeSyncCall, [[response("x"), FakeRpcError(S.UNAVAILABLE)], [response("y", "stop")]])
    assert client.generate("hi").text == "y" and len(client._stub.calls) == 2
    # stream: never after its first message.
    client._stub = FakeStub(FakeSyncCall, [[response("x"), FakeRpcError(S.UNAVAILABLE)], [response("y", "stop")]])
    with pytest.raises(ServiceUnavailableError):
        list(client.stream("hi"))
    assert len(client._stub.calls) == 1
    client._stub = FakeStub(FakeSyncCall, [[response("a"), response("b", "stop")]])
    stream = client.stream("hi")
    next(stream)
    stream.close()
    assert client._stub.calls[0].cancelled
    client.close()


class RecordingStub(FakeStub):
    """A FakeStub that also keeps each Generate's request and timeout."""

    def __init__(self, make_call, scripts):
        super().__init__(make_call, scripts)
        self.sent = []

    def Generate(self, request, timeout=None, metadata=()):
        self.sent.append((request, timeout))
        return super().Generate(request, timeout, metadata)


def test_both_clients_send_the_options_and_keywords_they_are_given():
    opts = GenerateOptions(max_tokens=3, temperature=0.0, timeout_s=5.0)

    async def go_async():
        client = sdk.AsyncClient("127.0.0.1:1")
        client._stub = RecordingStub(FakeAsyncCall, [[response("ok", "stop")]])
        await client.generate("hi", opts, seed=7)
        await client.close()
        return client._stub.sent

    client = sdk.Client("127.0.0.1:1")
    client._stub = RecordingStub(FakeSyncCall, [[response("ok", "stop")]])
    client.generate("hi", opts, seed=7)
    with pytest.raises(TypeError, match="'tempreature'"):
        client.stream("hi", tempreature=1.0)
    client.close()
    for sent in (asyncio.run(go_async()), client._stub.sent):
        [(request, timeout)] = sent
        assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.seed) == (3, 0.0, 7)
        assert 0 < timeout <= 5.0
