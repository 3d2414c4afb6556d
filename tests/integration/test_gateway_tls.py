"""TLS on the gateway's public listeners and mutual TLS of a service's gRPC server, in process.

A gateway (no coordinator behind it: /v1/models and ListModels need none) with
--tls-cert-file/--tls-key-file, then with --tls-client-ca-file: httpx with the CA and the SDK
with `ca_file` are served; plaintext, an untrusted CA and a missing client certificate are
refused. A ServiceRuntime with --mtls-*: a client presenting a certificate of the CA is served,
one without a certificate or in plaintext is not. Bad TLS options stop the start naming them.
"""

from __future__ import annotations

import asyncio
import os
import ssl

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.server import GatewayServer, running_gateway
from gateway.tokenization import Tokenization
from splitserve.client import AsyncClient, AuthenticationError, SplitserveClientError
from splitserve.config import GatewayConfig, SchedulerConfig
from splitserve.keys import hash_key
from splitserve.service import ServiceRuntime, open_channel
from splitserve.tls import ClientTls, TlsConfigError
from tests.tls_support import make_test_certs
from tests.unit.test_gateway_hint import ByteTokenizer

KEY = "sk-tls-test-key-0001"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certs(tmp_path_factory.mktemp("certs"))


def _config(certs, tmp_path, **extra) -> GatewayConfig:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[tenants]]\nname = "acme"\nkeys = ["{hash_key(KEY, "scrypt", scrypt_params=(1 << 10, 8, 1))}"]\n')
    return GatewayConfig(model="/models/demo", port=0, http_port=0, metrics_port=0, coordinator_address="127.0.0.1:9",
                         tls_cert_file=str(certs["gateway"]), tls_key_file=str(certs["gateway_key"]),
                         api_keys_file=str(keys), log_json=False, drain_timeout_s=1.0, **extra)


def _tokenization() -> Tokenization:
    return Tokenization(ByteTokenizer(), max_model_len=128)


async def _http_models(url: str, verify, cert=None, key: str = KEY) -> httpx.Response:
    async with httpx.AsyncClient(verify=verify, cert=cert, timeout=10) as client:
        return await client.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"})


def test_tls_gateway_serves_http_and_grpc_and_refuses_plaintext(certs, tmp_path):
    async def run():
        async with running_gateway(_config(certs, tmp_path), _tokenization()) as gw:
            url = f"https://127.0.0.1:{gw.http_port}"
            trusted = ssl.create_default_context(cafile=str(certs["ca"]))
            reply = await _http_models(url, trusted)
            assert reply.status_code == 200 and reply.json()["data"][0]["id"] == "demo"
            assert (await _http_models(url, trusted, key="sk-wrong")).status_code == 401
            with pytest.raises(httpx.ConnectError):  # the system roots do not trust the local CA
                await _http_models(url, True)
            with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
                await _http_models(f"http://127.0.0.1:{gw.http_port}", False)

            target = f"127.0.0.1:{gw.grpc_port}"
            async with AsyncClient(target, api_key=KEY, ca_file=str(certs["ca"]), timeout_s=10) as client:
                assert [m.id for m in await client.list_models()] == ["demo"]
            async with AsyncClient(target, api_key="sk-wrong", ca_file=str(certs["ca"]), timeout_s=10) as client:
                with pytest.raises(AuthenticationError):
                    await client.list_models()
            async with AsyncClient(target, api_key=KEY, timeout_s=3, max_retries=0) as plaintext:
                with pytest.raises(SplitserveClientError):
                    await plaintext.list_models()
    asyncio.run(run())


def test_client_certificates_are_required_when_configured(certs, tmp_path):
    config = _config(certs, tmp_path, tls_client_ca_file=str(certs["ca"]))

    async def run():
        async with running_gateway(config, _tokenization()) as gw:
            url = f"https://127.0.0.1:{gw.http_port}"
            with_cert = ClientTls(str(certs["ca"]), str(certs["client"]), str(certs["client_key"])).ssl_context()
            assert (await _http_models(url, with_cert)).status_code == 200
            without = ssl.create_default_context(cafile=str(certs["ca"]))
            with pytest.raises(httpx.HTTPError):
                await _http_models(url, without)

            target = f"127.0.0.1:{gw.grpc_port}"
            async with AsyncClient(target, api_key=KEY, ca_file=str(certs["ca"]), cert_file=str(certs["client"]),
                                   key_file=str(certs["client_key"]), timeout_s=10) as client:
                assert [m.id for m in await client.list_models()] == ["demo"]
            async with AsyncClient(target, api_key=KEY, ca_file=str(certs["ca"]), timeout_s=3,
                                   max_retries=0) as no_cert:
                with pytest.raises(SplitserveClientError):
                    await no_cert.list_models()
    asyncio.run(run())


def _mtls(certs, **extra) -> SchedulerConfig:
    return SchedulerConfig(port=0, metrics_port=0, log_json=False, mtls_ca_file=str(certs["ca"]),
                           mtls_cert_file=str(certs["service"]), mtls_key_file=str(certs["service_key"]), **extra)


async def _health(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"),
                                                            timeout=3)
    return reply.status


def test_a_service_with_mtls_serves_only_clients_with_a_certificate(certs):
    async def run():
        config = _mtls(certs)
        runtime = ServiceRuntime("scheduler", config, 0)
        await runtime.start()
        address = f"127.0.0.1:{runtime.bound_port}"
        try:
            async with open_channel(address, config) as channel:  # how the services dial each other
                assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            refused = [
                grpc.aio.insecure_channel(address),
                grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(certs["ca"].read_bytes())),
                # A certificate from another CA.
                grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(
                    certs["ca"].read_bytes(), certs["other_key"].read_bytes(), certs["other"].read_bytes())),
            ]
            for channel in refused:
                async with channel:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await _health(channel)
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await runtime.server.stop(grace=None)
    certs = {**certs, **_other_ca(certs)}
    asyncio.run(run())


def _other_ca(certs) -> dict:
    other = make_test_certs(certs["ca"].parent.parent / "other-ca")
    return {"other": other["client"], "other_key": other["client_key"]}


@pytest.mark.parametrize("options, field", [
    ({"mtls_ca_file": "ca"}, "mtls_cert_file"),
    ({"mtls_cert_file": "c", "mtls_key_file": "k"}, "mtls_ca_file"),
    ({"mtls_ca_file": "/nonexistent/ca.pem", "mtls_cert_file": "c", "mtls_key_file": "k"}, "mtls_cert_file"),
])
def test_half_configured_mtls_is_refused_naming_the_option(options, field):
    with pytest.raises(TlsConfigError, match=f"^{field}: ") as info:
        ServiceRuntime("scheduler", SchedulerConfig(log_json=False, **options), 0)
    assert info.value.field == field


@pytest.mark.parametrize("options, field", [
    ({"tls_cert_file": "/nonexistent.pem", "tls_key_file": "/nonexistent.key"}, "tls_cert_file"),
    ({"tls_key_file": "x"}, "tls_cert_file"),
    ({"tls_client_ca_file": "x"}, "tls_cert_file"),
    ({"swap": True}, "tls_key_file"),
    ({"mismatch": True}, "tls_key_file"),
])
def test_bad_gateway_tls_options_are_refused_naming_the_option(certs, options, field):
    if options.get("swap"):  # a certificate where the key belongs
        options = {"tls_cert_file": str(certs["gateway"]), "tls_key_file": str(certs["gateway"])}
    elif options.get("mismatch"):  # another certificate's key
        options = {"tls_cert_file": str(certs["gateway"]), "tls_key_file": str(certs["client_key"])}
    config = GatewayConfig(model="/models/demo", log_json=False, **options)
    with pytest.raises(TlsConfigError, match=f"^{field}: "):
        GatewayServer(config, _tokenization())


def test_the_container_healthcheck_speaks_mtls(certs):
    """docker/healthcheck.py reads the same SPLITSERVE_MTLS_* variables as the service it checks:
    with them it finds an mTLS scheduler SERVING, without them it reports it not serving."""
    import sys

    from tests.tls_support import REPO_ROOT

    async def run():
        config = _mtls(certs)
        runtime = ServiceRuntime("scheduler", config, 0)
        await runtime.start()
        await runtime.set_serving(True)  # readiness, what the healthcheck asks
        try:
            base = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_MTLS_")}
            mtls = {"SPLITSERVE_MTLS_CA_FILE": str(certs["ca"]), "SPLITSERVE_MTLS_CERT_FILE": str(certs["service"]),
                    "SPLITSERVE_MTLS_KEY_FILE": str(certs["service_key"]), "SPLITSERVE_SCHEDULER_HOST": "127.0.0.1"}
            codes = []
            for env in ({**base, **mtls}, {**base, "SPLITSERVE_SCHEDULER_HOST": "127.0.0.1"}):
                check = await asyncio.create_subprocess_exec(
                    sys.executable, str(REPO_ROOT / "docker" / "healthcheck.py"), "scheduler",
                    str(runtime.bound_port), env=env, stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL)
                codes.append(await asyncio.wait_for(check.wait(), 30))
            assert codes == [0, 1]
        finally:
            await runtime.server.stop(grace=None)
    asyncio.run(run())
