"""Benchmark targets: the splitserve gRPC gateway and any OpenAI-compatible HTTP server.

Both answer ``await target.send(request)`` with a :class:`~loadgen.plan.StreamedResult`
whose times are ``time.perf_counter()`` seconds since ``target.origin_s`` (the runner
sets it to the run's start). Serving errors never raise: they come back as
``ok=False`` with the error text, together with whatever arrived before them.

``token_times_s`` holds one entry per token the stream showed (the tokens of one chunk
share its arrival time); ``output_len`` is the server's usage count when it reports one.
gRPC shows every token id, so the two agree; an OpenAI stream without per-chunk usage
shows one token per non-empty text delta, so a text-less token has no time of its own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from loadgen.plan import BenchRequest, StreamedResult

if TYPE_CHECKING:  # splitserve.tls imports grpc, which `splitserve simulate` runs without
    from splitserve.tls import ClientTls

__all__ = ["GrpcTarget", "OpenAITarget", "TargetAddress", "TargetUnreachable", "ACCEPTED_TARGETS", "parse_target",
           "check_reachable", "make_target", "target_tls", "synthetic_text", "vocab_size_of_model"]

DEFAULT_GRPC_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 600.0
# A local or LAN server accepts a TCP connection in milliseconds; 2 s leaves room for a
# slow DNS answer while a mistyped --target still fails at once rather than after a run.
CONNECT_TIMEOUT_S = 2.0
ACCEPTED_TARGETS = ("host:port or grpc://host:port (the splitserve gateway over gRPC), "
                    "http://host[:port][/v1] or https://... (any OpenAI-compatible server)")

# Common English words that are one token in most BPE vocabularies: the text stand-in
# for token ids when a server refuses token-id prompts, so lengths stay roughly right.
_WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be has or had not "
    "but first one their its new after who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made"
).split()


class _StreamRecorder:
    """Collects one request's observations while it streams; builds the result at the end."""

    def __init__(self, target: Any, request: BenchRequest):
        self.target = target
        self.request = request
        self.arrival_s = target.now()
        self.token_times_s: list[float] = []
        self.output_ids: list[int] = []
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error: str | None = None

    def tokens(self, count: int, ids: list[int] | None = None) -> None:
        """``count`` tokens arrived now (all in one chunk, so they share a timestamp)."""
        now = self.target.now()
        self.token_times_s.extend([now] * count)
        if ids:
            self.output_ids.extend(ids)

    def result(self) -> StreamedResult:
        # The server's usage is the truth about lengths. Token times stay those the stream
        # showed: tokens it never showed (empty text deltas are not sent) get no invented
        # time, so ITL is the gaps the client saw, as in vLLM's benchmark.
        end_s = self.target.now()
        if self.completion_tokens and not self.token_times_s:
            self.token_times_s.append(end_s)  # output existed but was invisible until the end
        output_len = self.completion_tokens if self.completion_tokens is not None else len(self.token_times_s)
        ok = self.error is None and output_len > 0
        return StreamedResult(
            request_id=self.request.request_id,
            session_id=self.request.session_id,
            round_index=self.request.round_index,
            arrival_s=self.arrival_s,
            first_token_s=self.token_times_s[0] if self.token_times_s else None,
            token_times_s=self.token_times_s,
            end_s=end_s,
            prompt_len=self.prompt_tokens if self.prompt_tokens is not None else self.request.prompt_len,
            output_len=output_len,
            ok=ok,
            error=self.error if self.error is not None else (None if ok else "no output tokens"),
            output_token_ids=self.output_ids,
        )


def _error_text(err: BaseException) -> str:
    if isinstance(err, asyncio.CancelledError):
        return "cancelled"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class GrpcTarget:
    """The splitserve gateway over gRPC (``splitserve.client.AsyncClient``)."""

    kind = "grpc"

    def __init__(self, address: str = DEFAULT_GRPC_TARGET, api_key: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, slo_ttft_ms: int | None = None,
                 slo_itl_ms: int | None = None, tls: ClientTls | None = None):
        self.address = address
        self.api_key = api_key
        self.tls = tls  # None: plaintext
        self.timeout_s = timeout_s
        self.slo_ttft_ms = slo_ttft_ms
        self.slo_itl_ms = slo_itl_ms
        self.model: str | None = None
        self.origin_s = time.perf_counter()
        self._client: Any = None

    def now(self) -> float:
        """Seconds since ``origin_s``."""
        return time.perf_counter() - self.origin_s

    def _sdk(self) -> Any:
        # Created on first use: a grpc.aio channel belongs to the running event loop.
        if self._client is None:
            from splitserve.client import AsyncClient

            # No retries: a benchmark reports failures rather than hiding them in TTFT.
            tls = self.tls.sdk_options() if self.tls is not None else {}
            self._client = AsyncClient(self.address, api_key=self.api_key, timeout_s=self.timeout_s, max_retries=0,
                                       **tls)
        return self._client

    async def info(self) -> dict[str, Any]:
        """What the gateway serves (model id, max_model_len); errors are reported, not raised."""
        try:
            models = await self._sdk().list_models(timeout_s=10)
        except Exception as err:  # noqa: BLE001 -- informational only
            return {"kind": self.kind, "address": self.address, "error": _error_text(err)}
        self.model = models[0].id if models else None
        max_len = models[0].max_model_len if models else None
        return {"kind": self.kind, "address": self.address, "model": self.model, "max_model_len": max_len}

    async def send(self, request: BenchRequest) -> StreamedResult:
        """Stream one request; see the module docstring for the timing and error contract."""
        rec = _StreamRecorder(self, request)
        try:
            stream = self._sdk().stream(
                request.prompt_token_ids, max_tokens=request.output_len, ignore_eos=True, temperature=0.0,
                session_id=request.session_id, slo_ttft_ms=self.slo_ttft_ms, slo_itl_ms=self.slo_itl_ms)
            async for chunk in stream:
                if chunk.token_ids:
                    rec.tokens(len(chunk.token_ids), list(chunk.token_ids))
                if chunk.usage is not None:
                    rec.prompt_tokens = chunk.usage.prompt_tokens
                    rec.completion_tokens = chunk.usage.completion_tokens
        except (Exception, asyncio.CancelledError) as err:  # noqa: BLE001 -- recorded, never raised
            # A cancelled send (duration limit) still returns what it saw, so the task
            # completes with a result instead of being cancelled.
            rec.error = _error_text(err)
        return rec.result()

    async def open_session(self, session_id: str) -> None:
        """Open the session its rounds will name (splitserve keeps its history between rounds)."""
        await self._sdk().open_session(session_id, timeout_s=10)

    async def close_session(self, session_id: str) -> None:
        """Close it; never raises (a run is not failed by its clean-up)."""
        try:
            await self._sdk().close_session(session_id, timeout_s=10)
        except Exception:  # noqa: BLE001 -- the session expires on its own
            pass

    async def aclose(self) -> None:
        """Close the gRPC channel."""
        if self._client is not None:
            await self._client.close()
            self._client = None


OPENAI_APIS = ("completions", "chat")


class OpenAITarget:
    """Any OpenAI-compatible server, through streaming ``POST {base_url}/completions`` or, with
    ``api="chat"``, ``POST {base_url}/chat/completions`` (one user message holding the prompt as
    text: the server applies its chat template, as a chat client's requests make it do)."""

    kind = "openai"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, transport: httpx.AsyncBaseTransport | None = None,
                 tls: ClientTls | None = None, api: str = "completions"):
        if api not in OPENAI_APIS:
            raise ValueError(f"api: one of {', '.join(OPENAI_APIS)}, got {api!r}")
        self.api = api
        self.base_url = normalise_base_url(base_url)
        self.transport = transport  # tests inject httpx.MockTransport
        # https:// verifies the server against tls.ca_file (None: the system roots) and presents
        # tls's client certificate; built here so that a bad file fails before the run.
        self.verify: ssl.SSLContext | bool = tls.ssl_context() if tls is not None else True
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.origin_s = time.perf_counter()
        self.token_id_prompts = api == "completions"  # switched off for good once the server refuses them
        self._http: httpx.AsyncClient | None = None
        self._model_lock: asyncio.Lock | None = None

    def now(self) -> float:
        """Seconds since ``origin_s``."""
        return time.perf_counter() - self.origin_s

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # No connection cap: an open-loop run must not queue requests inside the client.
            self._http = httpx.AsyncClient(
                base_url=self.base_url, headers=headers, transport=self.transport, verify=self.verify,
                timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        return self._http

    async def _resolve_model(self) -> str:
        if self.model is None:
            if self._model_lock is None:
                self._model_lock = asyncio.Lock()
            async with self._model_lock:
                if self.model is None:
                    response = await self._client().get("/models")
                    response.raise_for_status()
                    self.model = response.json()["data"][0]["id"]
        return self.model

    async def info(self) -> dict[str, Any]:
        """The served model (first of ``/v1/models`` unless given) and its max_model_len if listed."""
        try:
            response = await self._client().get("/models")
            response.raise_for_status()
            listed = response.json().get("data", [])
        except Exception as err:  # noqa: BLE001 -- informational only
            return {"kind": self.kind, "address": self.base_url, "error": _error_text(err)}
        if self.model is None and listed:
            self.model = listed[0]["id"]
        model = self.model
        entry = next((m for m in listed if m.get("id") == model), {})
        return {"kind": self.kind, "address": self.base_url, "model": model,
                "max_model_len": entry.get("max_model_len")}

    async def open_session(self, session_id: str) -> None:
        """On a splitserve server, open the session (`POST /v1/sessions`); another server has
        no session API (404/405): its rounds then simply carry the ignored `session_id` field."""
        response = await self._client().post("/sessions", json={"session_id": session_id})
        if response.status_code in (404, 405):
            return
        response.raise_for_status()

    async def close_session(self, session_id: str) -> None:
        try:
            await self._client().delete(f"/sessions/{session_id}")
        except Exception:  # noqa: BLE001 -- the session expires on its own
            pass

    def _body(self, request: BenchRequest, model: str) -> dict[str, Any]:
        if self.api == "chat":
            prompt: dict[str, Any] = {"messages": [{"role": "user", "content": synthetic_text(request.prompt_token_ids)}]}
        else:
            prompt = {"prompt": request.prompt_token_ids if self.token_id_prompts
                      else synthetic_text(request.prompt_token_ids)}
        body: dict[str, Any] = {
            "model": model,
            **prompt,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "stream": True,
            # continuous_usage_stats (vLLM, SGLang) puts usage on every chunk: exact tokens per chunk.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True,
        }
        if request.session_id:
            body["session_id"] = request.session_id  # splitserve extension; others ignore it
        return body

    async def send(self, request: BenchRequest) -> StreamedResult:
        """Stream one completion; see the module docstring for the timing and error contract."""
        try:
            model = await self._resolve_model()
        except (Exception, asyncio.CancelledError) as err:  # noqa: BLE001 -- recorded, never raised
            rec = _StreamRecorder(self, request)
            rec.error = f"model lookup: {_error_text(err)}"
            return rec.result()
        rec = _StreamRecorder(self, request)  # the clock starts once the request itself goes out
        try:
            refused = await self._stream(request, model, rec)
            if refused and self.token_id_prompts:
                # The server takes no token-id prompts: fall back to text for this and later requests.
                self.token_id_prompts = False
                rec = _StreamRecorder(self, request)
                await self._stream(request, model, rec)
        except (Exception, asyncio.CancelledError) as err:  # noqa: BLE001 -- recorded, never raised
            rec.error = _error_text(err)
        return rec.result()

    async def _stream(self, request: BenchRequest, model: str, rec: _StreamRecorder) -> bool:
        """Run one streamed completion into ``rec``; True when the server refused a token-id prompt."""
        path = "/chat/completions" if self.api == "chat" else "/completions"
        async with self._client().stream("POST", path, json=self._body(request, model)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                message = _error_message(text)
                if self.token_id_prompts and response.status_code in (400, 422) and _refuses_token_ids(message):
                    return True
                rec.error = f"HTTP {response.status_code}: {message}"
                return False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    rec.error = f"stream error: {_error_message(json.dumps(chunk))}"
                    break
                self._count_chunk(chunk, rec)
        return False

    @staticmethod
    def _count_chunk(chunk: dict[str, Any], rec: _StreamRecorder) -> None:
        usage = chunk.get("usage") or {}
        completion = usage.get("completion_tokens")
        choices = chunk.get("choices") or []
        if completion is not None:
            # Cumulative usage (per chunk or final) tells exactly how many tokens are new.
            new = completion - len(rec.token_times_s)
            if choices and new > 0:
                rec.tokens(new)
            rec.completion_tokens = completion
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        elif choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
            rec.tokens(1)  # without usage, one non-empty delta counts as one token

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:500]
    return str(error)[:500]


def _refuses_token_ids(message: str) -> bool:
    # A complaint about the prompt that is not about its length: its token-id form was refused.
    text = message.lower()
    return "prompt" in text and not any(word in text for word in ("length", "long", "context", "max_model_len"))


def normalise_base_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1``; a URL with a path is kept as given."""
    url = url.rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


def synthetic_text(token_ids: list[int]) -> str:
    """Roughly ``len(token_ids)`` tokens of text, chosen deterministically from the ids."""
    return " ".join(_WORDS[t % len(_WORDS)] for t in token_ids)


@dataclass(frozen=True)
class TargetAddress:
    """A parsed ``--target``: which kind of server, what its client dials, and the TCP endpoint."""

    kind: str  # "grpc" | "http"
    address: str  # gRPC: host:port (grpc.aio has no grpc:// scheme); HTTP: the URL as given
    host: str
    port: int


class TargetUnreachable(ConnectionError):
    """Nothing accepted a connection at the target."""


def parse_target(text: str) -> TargetAddress:
    """``host:port``, ``grpc://host:port`` (an alias: gRPC itself knows no such scheme and would fail
    every request with "address lookup failed"), or an ``http(s)://`` URL; anything else is a
    ValueError naming the accepted forms."""
    given = text.strip()
    scheme, sep, rest = given.partition("://")
    scheme = scheme.lower() if sep else ""
    if scheme not in ("", "grpc", "http", "https"):
        raise ValueError(f"--target {text!r}: unknown scheme {scheme + '://'!r}; accepted: {ACCEPTED_TARGETS}")
    if scheme in ("http", "https"):
        parts = urlsplit(given)
        default_port = 80 if scheme == "http" else 443
    else:
        parts = urlsplit("//" + (rest if sep else given))
        default_port = None
        if parts.path.strip("/") or parts.query or parts.fragment:
            raise ValueError(f"--target {text!r}: a gRPC target is host:port, without a path; "
                             f"accepted: {ACCEPTED_TARGETS}")
    try:
        port = parts.port if parts.port is not None else default_port
    except ValueError:
        port = -1
    if not parts.hostname or port is None or not 0 < port < 65536:
        raise ValueError(f"--target {text!r}: expected a host and a port 1..65535; accepted: {ACCEPTED_TARGETS}")
    if scheme in ("http", "https"):
        return TargetAddress("http", given, parts.hostname, port)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return TargetAddress("grpc", f"{host}:{port}", parts.hostname, port)


def check_reachable(target: TargetAddress, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`TargetUnreachable` unless something accepts a TCP connection at the target
    within `timeout_s`: a run against nothing would otherwise send every request to fail."""
    try:
        with socket.create_connection((target.host, target.port), timeout=timeout_s):
            pass
    except OSError as err:
        reason = "no answer within {:g} s".format(timeout_s) if isinstance(err, TimeoutError) else str(err)
        raise TargetUnreachable(f"--target {target.address}: nothing answers at {target.host}:{target.port} "
                                f"({reason}); is the server running there?") from None


def target_tls(tls: bool = False, ca_file: str = "", cert_file: str = "", key_file: str = "",
               server_name: str = "") -> ClientTls | None:
    """The TLS a target is dialed with, from the ``--tls*`` options: None (plaintext gRPC; an
    ``https://`` URL still verifies against the system roots) unless one of them is given. A
    missing or non-PEM file, or a certificate without its key, raises ValueError naming the option."""
    if not (tls or ca_file or cert_file or key_file or server_name):
        return None
    from splitserve.tls import ClientTls, channel_credentials  # gRPC: only where TLS is asked for

    fields = ("tls_ca_file", "tls_cert_file", "tls_key_file")
    channel_credentials(ca_file, cert_file, key_file, fields=fields)  # checks the files now, not mid-run
    return ClientTls(ca_file, cert_file, key_file, server_name)


def make_target(address: str, api_key: str | None = None, model: str | None = None,
                slo_ttft_ms: int | None = None, slo_itl_ms: int | None = None,
                tls: ClientTls | None = None, api: str = "completions") -> GrpcTarget | OpenAITarget:
    """An OpenAI target for an ``http(s)://`` URL, else a gRPC target (see :func:`parse_target`)."""
    parsed = parse_target(address)
    if parsed.kind == "http":
        if tls is not None and not parsed.address.lower().startswith("https://"):
            raise ValueError(f"--target {address!r}: TLS options need an https:// URL")
        if tls is not None and tls.server_name:
            raise ValueError("tls_server_name: applies to gRPC targets only (an https:// URL names its host)")
        return OpenAITarget(parsed.address, model=model, api_key=api_key, tls=tls, api=api)
    if api != "completions":
        raise ValueError(f"--api {api}: applies to http(s) targets only (a gRPC target takes token ids)")
    return GrpcTarget(parsed.address, api_key=api_key, slo_ttft_ms=slo_ttft_ms, slo_itl_ms=slo_itl_ms, tls=tls)


def vocab_size_of_model(model: str | None) -> int | None:
    """``vocab_size`` from ``config.json`` when ``model`` names a local model directory."""
    if not model:
        return None
    config = Path(model).expanduser() / "config.json"
    try:
        value = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None
