"""A cluster with mutual TLS between its services, TLS (client certificates required) on the
gateway, and hashed API keys of tenants: token-exact answers over both APIs, every client
without a certificate refused, per-tenant limits, and no key text in any log.

The request is split across the two workers (policy split, KV over gRPC), so every internal
hop runs over mTLS: gateway -> coordinator -> scheduler, coordinator -> each worker, and the
first worker's KV push to the second.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import uuid

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import AuthenticationError, Client, SplitserveClientError
from splitserve.keys import hash_key
from splitserve.cli.launcher import ClusterSpec, start_cluster
from splitserve.proto import worker_pb2, worker_pb2_grpc
from splitserve.redis_server import free_port
from splitserve.tls import ClientTls
from redis_support import final_request_record
from tests.tls_support import make_test_certs
from workers.engine import LLM, SamplingParams

# Random per run: a fixed string could appear in a log by chance of the test, not of the code.
KEY_ACME = "sk-acme-" + secrets.token_urlsafe(18)
KEY_TINY = "sk-tiny-" + secrets.token_urlsafe(18)
KEY_PLAIN = "sk-plain-" + secrets.token_urlsafe(18)
WRONG_KEY = "sk-wrong-" + secrets.token_urlsafe(18)
PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(21)]
MAX_TOKENS = 12
TINY_RPM = 2


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory, certs):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(f'[[tenants]]\nname = "acme"\nkeys = ["{hash_key(KEY_ACME)}"]\n\n'
                    f'[[tenants]]\nname = "tiny"\nrequests_per_minute = {TINY_RPM}\n'
                    f'keys = ["{hash_key(KEY_TINY, "pbkdf2_sha256")}"]\n')
    spec = ClusterSpec(
        model=str(tiny_model_dirs["llama"]), workers=2, policy="split", http_port=free_port(), grpc_port=free_port(),
        redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"], redis_prefix=f"ss:tls-{uuid.uuid4().hex[:8]}:",
        log_dir=tmp_path_factory.mktemp("tls-logs"),
        scheduler_args={"split_ratio": 0.5},
        worker_args={"kv_transport": "grpc", "kv_cache_memory_bytes": 8 << 20, "max_num_seqs": 16, "block_size": 4},
        coordinator_args={"kv_chunk_tokens": 8, "log_level": "DEBUG"},
        # DEBUG: whatever the gateway logs about a request, the key must not be in it.
        gateway_args={"api_keys_file": str(keys), "api_keys": KEY_PLAIN, "log_level": "DEBUG"},
        mtls_ca_file=str(certs["ca"]), mtls_cert_file=str(certs["service"]), mtls_key_file=str(certs["service_key"]),
        tls_cert_file=str(certs["gateway"]), tls_key_file=str(certs["gateway_key"]),
        tls_client_ca_file=str(certs["ca"]), tls_ca_file=str(certs["ca"]),
        tls_client_cert_file=str(certs["client"]), tls_client_key_file=str(certs["client_key"]),
    )
    cluster = start_cluster(spec)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]))
    cases = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_k=50, seed=4242)}
    return cases, {name: llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **case))[0]
                   for name, case in cases.items()}


def _sdk(cluster, certs, key=KEY_ACME, **tls) -> Client:
    tls = tls or dict(ca_file=str(certs["ca"]), cert_file=str(certs["client"]), key_file=str(certs["client_key"]))
    return Client(cluster.gateway_grpc, api_key=key, timeout_s=60, **tls)


def _http(certs, cert: bool = True) -> httpx.Client:
    tls = ClientTls(str(certs["ca"]), str(certs["client"]), str(certs["client_key"])) if cert else ClientTls(
        str(certs["ca"]))
    return httpx.Client(verify=tls.ssl_context(), timeout=60)


def _stages(cluster, request_id: str) -> list[dict]:
    record = final_request_record(cluster, request_id)
    return record.stages if record else []


def test_sdk_over_tls_and_mtls_is_token_exact_across_two_workers(cluster, certs, reference):
    cases, expected = reference
    assert cluster.gateway_http.startswith("https://")
    with _sdk(cluster, certs) as client:
        for name, case in cases.items():
            request_id = f"tls-{name}-{uuid.uuid4().hex[:6]}"
            result = client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=request_id, **case)
            assert result.token_ids == expected[name].token_ids
            stages = _stages(cluster, request_id)
            assert len(stages) == 2 and stages[0]["worker_id"] != stages[1]["worker_id"], stages
            streamed = list(client.stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, **case))
            assert [t for c in streamed for t in c.token_ids] == expected[name].token_ids


def test_http_over_tls_is_token_exact(cluster, certs, reference):
    cases, expected = reference
    with _http(certs) as http:
        models = http.get(cluster.gateway_http + "/v1/models", headers={"authorization": f"Bearer {KEY_PLAIN}"})
        assert models.status_code == 200, models.text
        body = {"model": models.json()["data"][0]["id"], "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "ignore_eos": True, **cases["sampled"]}
        reply = http.post(cluster.gateway_http + "/v1/completions", json=body,
                          headers={"authorization": f"Bearer {KEY_ACME}"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected["sampled"].text
        assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_clients_without_a_certificate_are_refused(cluster, certs):
    # The gateway asks for a client certificate on both APIs.
    with _sdk(cluster, certs, ca_file=str(certs["ca"])) as no_cert:
        with pytest.raises(SplitserveClientError):
            no_cert.generate(PROMPT, max_tokens=2, timeout_s=5)
    with _http(certs, cert=False) as http, pytest.raises(httpx.HTTPError):
        http.get(cluster.gateway_http + "/v1/models", headers={"authorization": f"Bearer {KEY_ACME}"})
    with httpx.Client(timeout=5) as plain, pytest.raises(httpx.HTTPError):
        plain.get(cluster.gateway_http.replace("https://", "http://") + "/v1/models")
    # Every internal service: plaintext or TLS without a certificate is refused in the handshake.
    ca = certs["ca"].read_bytes()
    internal = [cluster.scheduler_address, cluster.coordinator_address, *cluster.worker_addresses]
    for address in internal:
        for channel in (grpc.insecure_channel(address), grpc.secure_channel(address, grpc.ssl_channel_credentials(ca))):
            with channel, pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, address
    # ... and served with the services' certificate.
    with cluster.spec.internal_tls().channel(cluster.worker_addresses[0]) as channel:
        load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert load.worker_id == "worker-0"


def test_wrong_keys_are_refused_and_tenant_limits_apply(cluster, certs):
    with _sdk(cluster, certs, key=WRONG_KEY) as wrong, pytest.raises(AuthenticationError):
        wrong.generate(PROMPT, max_tokens=2)
    with _http(certs) as http:
        url = cluster.gateway_http + "/v1/completions"
        body = {"prompt": "hi", "max_tokens": 2}
        assert http.post(url, json=body, headers={"authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
        statuses = [http.post(url, json=body, headers={"authorization": f"Bearer {KEY_TINY}"}).status_code
                    for _ in range(TINY_RPM + 1)]
        assert statuses == [200] * TINY_RPM + [429]
        # Another tenant is not limited by tiny's budget.
        assert http.post(url, json=body, headers={"authorization": f"Bearer {KEY_ACME}"}).status_code == 200
        metrics = http.get(cluster.gateway_http + "/metrics").text
    assert 'splitserve_gateway_tenant_requests_total{status="ok",tenant="tiny"} 2.0' in metrics
    assert 'splitserve_gateway_tenant_requests_total{status="resource_exhausted",tenant="tiny"} 1.0' in metrics


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_the_load_generator_runs_over_tls_with_a_client_certificate(cluster, certs, api):
    """`splitserve bench --tls-ca-file ... --tls-cert-file ... --tls-key-file ...` against a gateway
    that requires client certificates, on both APIs; without the certificate every request fails."""
    from loadgen.bench_config import BenchOptions
    from loadgen.cli import run_bench

    target = cluster.gateway_grpc if api == "grpc" else cluster.gateway_http + "/v1"
    base = BenchOptions(target=target, api_key=KEY_ACME, shapes=["P12/D4"], num_requests=4, concurrency=2,
                        send_slo=False, progress=False, vocab_size=250, tls_ca_file=str(certs["ca"]))
    with_cert = dataclasses.replace(base, tls_cert_file=str(certs["client"]), tls_key_file=str(certs["client_key"]))
    summary = run_bench(with_cert)["summary"]
    assert summary["n_ok"] == 4 and summary["n_failed"] == 0
    assert run_bench(base)["summary"]["n_ok"] == 0  # the gateway refuses the handshake without a certificate


def test_chaos_health_checks_reach_mtls_services_only_with_the_certificate(cluster):
    from splitserve.cli.chaos.processes import grpc_serving

    port = int(cluster.scheduler_address.rsplit(":", 1)[1])
    assert grpc_serving(port, cluster.spec.internal_tls())
    assert not grpc_serving(port)  # plaintext to an mTLS server: never SERVING


# Last: every request above (the load generator's included) has been logged by now.
def test_no_key_text_in_any_log(cluster, certs):
    """After right and wrong keys on both APIs (above and here), no log file holds a key."""
    with _sdk(cluster, certs) as client:
        assert client.generate(PROMPT, max_tokens=2).usage.completion_tokens == 2
    with _sdk(cluster, certs, key=WRONG_KEY) as wrong, pytest.raises(AuthenticationError):
        wrong.list_models()
    with _http(certs) as http:
        for key in (KEY_PLAIN, WRONG_KEY):
            http.post(cluster.gateway_http + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    logs = sorted(cluster.spec.log_dir.glob("*.log"))
    assert {p.stem for p in logs} >= {"gateway", "coordinator", "scheduler", "worker-0", "worker-1"}
    gateway_log = (cluster.spec.log_dir / "gateway.log").read_text(errors="replace")
    assert '"level": "DEBUG"' in gateway_log  # the most verbose level did run
    for path in logs:
        text = path.read_bytes()
        for key in (KEY_ACME, KEY_TINY, KEY_PLAIN, WRONG_KEY):
            assert key.encode() not in text, f"{path.name} holds an API key"
