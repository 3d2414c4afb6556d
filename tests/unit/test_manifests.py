"""The deployment files, checked offline: Kubernetes manifests rendered by kustomize and validated
against the Kubernetes schemas, docker-compose.yml parsed (and `config`-checked by Compose when it
is installed), and every environment variable and port in both agreeing with the services' typed
configs (splitserve/config.py: a field `max_num_seqs` of WorkerConfig is SPLITSERVE_WORKER_MAX_NUM_SEQS,
a common one SPLITSERVE_REDIS_URL). The Grafana dashboard queries only metrics the code defines."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from splitserve.config import SERVICE_CONFIGS, env_var

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = ("k8s/base", "k8s/overlays/cpu", "k8s/overlays/gpu")
TLS_OVERLAY = "k8s/overlays/cpu-tls"  # overlays/cpu + components/tls + components/api-keys-file
AUTOSCALED_OVERLAY = "k8s/overlays/gpu-autoscaled"  # overlays/gpu + components/monitoring + components/keda
RENDERED = KUSTOMIZATIONS + (TLS_OVERLAY, AUTOSCALED_OVERLAY)
K8S_VERSION = "1.30.0"
# Kinds defined by CRDs: kubernetes-validate has no schema for them (checked by hand below).
CRD_GROUPS = ("monitoring.coreos.com/", "keda.sh/")
# Compose variables no service reads: they choose images, mounts and counts (docs/deployment.md).
DEPLOY_ONLY = {"SPLITSERVE_IMAGE", "SPLITSERVE_CUDA_IMAGE", "SPLITSERVE_REDIS_IMAGE", "SPLITSERVE_BASE_IMAGE",
               "SPLITSERVE_CUDA_BASE_IMAGE", "SPLITSERVE_CUDA_BUILDER_IMAGE", "SPLITSERVE_MODEL_DIR",
               "SPLITSERVE_WORKERS", "SPLITSERVE_GPU_WORKERS", "SPLITSERVE_EMULATED_WORKERS",
               "SPLITSERVE_HTTP_PUBLISH", "SPLITSERVE_GRPC_PUBLISH", "SPLITSERVE_REDIS_PORT", "SPLITSERVE_STOP_GRACE",
               "SPLITSERVE_CERTS_DIR"}
# Variables of other software the containers read (UCX for NIXL, the downward API, Grafana, images),
# and the Redis password that kubelet puts into SPLITSERVE_REDIS_URL (redis-cli reads REDISCLI_AUTH).
FOREIGN_ENV = re.compile(r"^(UCX_\w+|POD_NAME|POD_IP|GF_\w+|PROMETHEUS_\w+|GRAFANA_\w+|REDIS_PASSWORD|REDISCLI_AUTH)$")


def config_env(service: str) -> dict[str, dataclasses.Field]:
    cls = SERVICE_CONFIGS[service]
    return {env_var(cls, f): f for f in dataclasses.fields(cls)}


ALL_CONFIG_ENV = {name for service in SERVICE_CONFIGS for name in config_env(service)}


def default(service: str, field_name: str):
    return next(f.default for f in dataclasses.fields(SERVICE_CONFIGS[service]) if f.name == field_name)


def served(args: list[str] | None) -> str | None:
    """The service a container runs: `serve SERVICE` in its command."""
    args = [str(a) for a in args or []]
    if "serve" in args and args.index("serve") + 1 < len(args):
        return args[args.index("serve") + 1]
    return None


# ---------------------------------------------------------------- Kubernetes


@lru_cache(maxsize=None)
def rendered(path: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", str(ROOT / path)], capture_output=True, text=True, timeout=60)
    elif shutil.which("kustomize"):
        out = subprocess.run(["kustomize", "build", str(ROOT / path)], capture_output=True, text=True, timeout=60)
    else:
        pytest.skip("neither kubectl nor kustomize is installed: the manifests cannot be rendered")
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def by_kind(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d, c


def redis_password_source(c) -> dict | None:
    """The Secret key REDIS_PASSWORD comes from, when it is declared before SPLITSERVE_REDIS_URL
    (kubelet expands $(VAR) only from variables defined earlier in the list)."""
    names = [item["name"] for item in c.get("env", [])]
    if "REDIS_PASSWORD" not in names or names.index("REDIS_PASSWORD") > names.index("SPLITSERVE_REDIS_URL"):
        return None
    item = c["env"][names.index("REDIS_PASSWORD")]
    return item.get("valueFrom", {}).get("secretKeyRef")


def container_env(docs, c) -> dict[str, str | None]:
    """The container's environment: env entries and the ConfigMaps / Secrets of envFrom."""
    env: dict[str, str | None] = {}
    maps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]]["data"])
        if "secretRef" in source:
            secret = secrets[source["secretRef"]["name"]]
            env.update(secret.get("stringData", {}))
            env.update({k: None for k in secret.get("data", {})})
    for item in c.get("env", []):
        env[item["name"]] = item.get("value")
    return env


@pytest.mark.parametrize("path", RENDERED)
def test_kustomize_renders_and_validates(path):
    import kubernetes_validate

    docs = rendered(path)
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "NetworkPolicy", "ConfigMap", "Secret", "ServiceMonitor"} <= kinds
    for doc in docs:
        assert doc["metadata"].get("namespace", "splitserve") == "splitserve" or doc["kind"] == "Namespace"
        if doc["apiVersion"].startswith(CRD_GROUPS):
            check_custom_resource(doc, docs)
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    if path == "k8s/base":  # installable without KEDA and without the PrometheusRule CRD
        assert not kinds & {"ScaledObject", "PrometheusRule"}


def check_custom_resource(doc: dict, docs) -> None:
    """What kubernetes-validate cannot check of a CRD's object: its shape, field by field, as the
    CRD's schema would (ServiceMonitor, PrometheusRule: monitoring.coreos.com/v1; ScaledObject:
    keda.sh/v1alpha1), and that what it names exists."""
    kind, spec = doc["kind"], doc["spec"]
    assert doc["metadata"]["name"] and doc["metadata"]["namespace"] == "splitserve", kind
    if kind == "ServiceMonitor":
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["endpoints"] and spec["selector"]
        ports = {p["name"] for svc in by_kind(docs, "Service").values() for p in svc["spec"]["ports"]}
        assert all(e["port"] in ports and e["path"] == "/metrics" for e in spec["endpoints"])
    elif kind == "PrometheusRule":
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(spec) == {"groups"} and spec["groups"]
        for group in spec["groups"]:
            assert set(group) <= {"name", "interval", "rules"} and group["name"] and group["rules"]
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}, rule
                assert bool(rule.get("alert")) != bool(rule.get("record")) and rule["expr"].strip()
                assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]
                assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
                check_promql(rule["expr"])
    elif kind == "ScaledObject":
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        target = spec["scaleTargetRef"]
        assert target["name"] in by_kind(docs, target.get("kind", "Deployment")), target
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        assert spec["triggers"]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus" and trigger.get("metricType", "AverageValue") in (
                "AverageValue", "Value", "Utilization")
            meta = trigger["metadata"]
            assert all(isinstance(v, str) for v in meta.values()), "KEDA's trigger metadata values are strings"
            assert re.fullmatch(r"https?://[\w.-]+(:\d+)?(/\S*)?", meta["serverAddress"])
            assert float(meta["threshold"]) > 0
            check_promql(meta["query"])
    else:
        raise AssertionError(f"no structural check for the custom resource {kind}")


def check_promql(expr: str) -> None:
    """A PromQL expression's brackets balance and every metric it names is one the code exports
    (splitserve_* and vllm:*) or Prometheus' own `up`."""
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in re.sub(r'"[^"]*"', '""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            assert stack and stack.pop() == pairs[ch], expr
    assert not stack, expr
    names = set(re.findall(r"\b(?:splitserve_\w+|vllm:\w+)", expr))
    assert names or re.search(r"\bup\{", expr), expr
    assert names <= defined_metrics() | exported_vllm_metrics(), sorted(names - defined_metrics()
                                                                        - exported_vllm_metrics())


@pytest.mark.parametrize("path", RENDERED)
def test_k8s_env_and_ports_match_typed_configs(path):
    docs = rendered(path)
    services = by_kind(docs, "Service")
    seen = set()
    for workload, c in containers(docs):
        service = served(c.get("args") or c.get("command"))
        if service is None:
            continue
        seen.add(service)
        env = container_env(docs, c)
        valid = config_env(service)
        for name in env:
            assert name in valid or FOREIGN_ENV.match(name), f"{workload['metadata']['name']}: {name} is not an option " \
                                                             f"of the {service} config"

        def value(field_name):
            name = env_var(SERVICE_CONFIGS[service], next(f for f in dataclasses.fields(SERVICE_CONFIGS[service])
                                                         if f.name == field_name))
            return int(env[name]) if env.get(name) is not None else default(service, field_name)

        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == value("port"), f"{service}: grpc containerPort vs its port option"
        if service == "gateway":
            assert ports["http"] == value("http_port")
        else:
            assert ports["metrics"] == value("metrics_port") != 0
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc_probe = c.get(probe, {}).get("grpc")
            if grpc_probe:
                assert grpc_probe["port"] == ports["grpc"], f"{service} {probe}"
                assert grpc_probe.get("service", "") in ("", "liveness", f"splitserve.v1.{service.capitalize()}")
        assert c["resources"]["requests"] and c["resources"]["limits"], f"{service}: requests and limits"
        # Every Service in front of the workload targets a port the container names.
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for svc in services.values():
            if all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()):
                for p in svc["spec"]["ports"]:
                    assert p["targetPort"] in ports, f"Service {svc['metadata']['name']}: {p['targetPort']}"
        # host:port addresses point at a Service exposing that port.
        for name, raw in env.items():
            if name.endswith("_ADDRESS") and raw and ":" in raw and not raw.startswith("$("):
                host, port = raw.rsplit(":", 1)
                assert host in services and int(port) in [p["port"] for p in services[host]["spec"]["ports"]], raw
            if name == "SPLITSERVE_REDIS_URL":
                url = urlsplit(raw)
                assert int(url.port) in [p["port"] for p in services[url.hostname]["spec"]["ports"]]
                # Redis requires a password: the URL carries the Secret's, put there by kubelet.
                assert url.password == "$(REDIS_PASSWORD)", f"{workload['metadata']['name']}: {raw}"
        assert "SPLITSERVE_REDIS_URL" in env, f"{workload['metadata']['name']}: no Redis URL"
        assert redis_password_source(c) == {"name": "splitserve-redis", "key": "password"}
    assert seen == set(SERVICE_CONFIGS)


def test_k8s_shape_of_the_deployment():
    base, cpu, gpu = (rendered(p) for p in KUSTOMIZATIONS)
    sts, dep = by_kind(base, "StatefulSet"), by_kind(base, "Deployment")
    assert sts["redis"]["spec"]["volumeClaimTemplates"]
    assert dep["scheduler"]["spec"]["replicas"] == 2
    worker = sts["worker"]["spec"]["template"]["spec"]
    wc = worker["containers"][0]
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "IPC_LOCK" in wc["securityContext"]["capabilities"]["add"]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in worker["volumes"])
    assert any(e["name"].startswith("UCX_") for e in wc["env"])
    assert worker["terminationGracePeriodSeconds"] > float(container_env(base, wc)["SPLITSERVE_DRAIN_TIMEOUT_S"])
    cpu_worker = by_kind(cpu, "StatefulSet")["worker"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(cpu_worker["resources"])
    assert container_env(cpu, cpu_worker)["SPLITSERVE_WORKER_DEVICE"] == "cpu"
    assert by_kind(gpu, "StatefulSet")["worker"]["spec"]["replicas"] == 4
    hpa = by_kind(base, "HorizontalPodAutoscaler")["gateway"]["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "splitserve_gateway_in_flight_requests"
    assert hpa["metrics"][0]["pods"]["metric"]["name"] in defined_metrics()
    assert set(by_kind(base, "PodDisruptionBudget")) >= {"redis", "gateway"}
    for docs in (base, cpu, gpu):
        assert_no_budget_blocks_a_drain(docs)
    redis = sts["redis"]["spec"]["template"]["spec"]["containers"][0]
    assert "requirepass $REDISCLI_AUTH" in "".join(redis["args"]) and "redis-server -" in "".join(redis["args"])
    assert not any("requirepass" in a and "$REDISCLI_AUTH" not in a for a in redis["args"])  # no password in argv
    auth = {e["name"]: e for e in redis["env"]}["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]
    assert auth == {"name": "splitserve-redis", "key": "password"}
    assert "splitserve-redis" not in by_kind(base, "Secret"), "the password is made per cluster, never shipped"
    assert "SPLITSERVE_REDIS_URL" not in by_kind(base, "ConfigMap")["splitserve-common"]["data"]
    # Only the gateway takes traffic from anywhere: the one rule with no `from`.
    open_rules = [p for p in by_kind(base, "NetworkPolicy").values()
                  for rule in p["spec"].get("ingress", []) if "from" not in rule]
    assert [p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in open_rules] == ["gateway"]


def assert_no_budget_blocks_a_drain(docs) -> None:
    """Every PodDisruptionBudget lets at least one selected pod be evicted at full strength: one
    that never does (minAvailable equal to the replicas) blocks every node drain."""
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for name, pdb in by_kind(docs, "PodDisruptionBudget").items():
        selector = pdb["spec"]["selector"]["matchLabels"]
        selected = [w for w in workloads
                    if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())]
        assert selected, f"PodDisruptionBudget {name} selects nothing"
        replicas = sum(w["spec"].get("replicas", 1) for w in selected)
        if "maxUnavailable" in pdb["spec"]:
            assert int(pdb["spec"]["maxUnavailable"]) >= 1, name
        else:
            assert int(pdb["spec"]["minAvailable"]) < replicas, f"{name}: minAvailable {pdb['spec']['minAvailable']} " \
                                                                f"of {replicas} replicas blocks node drains"


def test_k8s_autoscaled_overlay_ships_dashboard_alerts_and_keda():
    docs = rendered(AUTOSCALED_OVERLAY)
    rules = by_kind(docs, "PrometheusRule")["splitserve"]["spec"]["groups"]
    alerts = {r["alert"]: r["expr"] for group in rules for r in group["rules"] if "alert" in r}
    for needed, metric in (("HighTimeToFirstToken", "vllm:time_to_first_token_seconds_bucket"),
                           ("WorkerQueueGrowing", "vllm:num_requests_waiting"),
                           ("KvCacheNearlyFull", "vllm:kv_cache_usage_perc"),
                           ("WorkerDown", 'up{namespace="splitserve", job="worker"}'),
                           ("HighErrorRate", "splitserve_gateway_requests_total")):
        assert metric in alerts[f"Splitserve{needed}"], needed
    assert re.search(r"vllm:kv_cache_usage_perc\{[^}]*\}\) > 0\.9\b", alerts["SplitserveKvCacheNearlyFull"])
    scaled = by_kind(docs, "ScaledObject")["worker"]["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "worker"}
    assert "vllm:num_requests_waiting" in scaled["triggers"][0]["metadata"]["query"]
    dashboard_map = by_kind(docs, "ConfigMap")["splitserve-grafana-dashboard"]
    assert dashboard_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboard_map["data"]["grafana-dashboard.json"])
    assert dashboard == json.loads((ROOT / "k8s/components/monitoring/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for expr in exprs:
        check_promql(expr)
    used = {name for expr in exprs for name in re.findall(r"\b(?:splitserve_\w+|vllm:\w+)", expr)}
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total"} <= used
    assert len({n for n in used if n.startswith("splitserve_")}) >= 10
    model_var = {v["name"]: v for v in dashboard["templating"]["list"]}["model_name"]
    assert "vllm:" in model_var["definition"] and "model_name" in model_var["definition"]


def test_k8s_tls_overlay_wires_certificates_probes_and_the_keys_file():
    docs = rendered(TLS_OVERLAY)
    for workload, c in containers(docs):
        service = served(c.get("args") or c.get("command"))
        if service is None:
            continue
        name = workload["metadata"]["name"]
        env = container_env(docs, c)
        assert env["SPLITSERVE_MTLS_CA_FILE"] == "/certs/ca.pem", name
        assert env["SPLITSERVE_MTLS_SERVER_NAME"] == "splitserve-internal", name  # workers are dialed by pod IP
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mounts["/certs"]]["secret"]["secretName"] == "splitserve-tls", name
        for path in (env["SPLITSERVE_MTLS_CERT_FILE"], env["SPLITSERVE_MTLS_KEY_FILE"]):
            assert path.startswith("/certs/"), name
        # The image's user reads the secret files through its group.
        assert workload["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # kubelet's gRPC probes speak no TLS, its HTTPS probes present no client certificate.
            handlers = set(c[probe]) & {"grpc", "exec", "httpGet", "tcpSocket"}
            assert handlers == {"exec"}, f"{name} {probe}: {handlers}"
            command = c[probe]["exec"]["command"]
            assert command[1].endswith("splitserve-healthcheck"), f"{name} {probe}"
            assert ("--liveness" in command) == (probe != "readinessProbe"), f"{name} {probe}"
        if service == "gateway":
            assert env["SPLITSERVE_GATEWAY_TLS_CERT_FILE"] == "/certs/gateway.pem"
            keys_dir = env["SPLITSERVE_GATEWAY_API_KEYS_FILE"].rsplit("/", 1)[0]
            assert volumes[mounts[keys_dir]]["secret"]["secretName"] == "splitserve-api-keys-file"
    monitor = by_kind(docs, "ServiceMonitor")["splitserve-gateway"]["spec"]["endpoints"][0]
    assert monitor["scheme"] == "https" and monitor["tlsConfig"]["ca"]["secret"]["key"] == "ca.pem"


# ---------------------------------------------------------------- Compose


def compose_doc(*files: str) -> dict:
    doc: dict = {"services": {}}
    for name in files:
        part = yaml.safe_load((ROOT / name).read_text())
        for svc, body in part["services"].items():
            merged = doc["services"].setdefault(svc, {})
            for key, val in body.items():
                if isinstance(val, dict) and isinstance(merged.get(key), dict):
                    merged[key] = {**merged[key], **val}
                else:
                    merged[key] = val
    return doc


def interpolated(text: str) -> set[str]:
    return set(re.findall(r"\$\{([A-Z0-9_]+)", text))


def resolve(raw) -> str:
    """A compose value with ${VAR:-default} replaced by its default."""
    return re.sub(r"\$\{[A-Z0-9_]+:?-([^}]*)\}", r"\1", str(raw))


COMPOSE_FILE_SETS = [("docker-compose.yml",), ("docker-compose.yml", "docker/compose.hostnet.yml"),
                     ("docker-compose.yml", "docker/compose.tls.yml"),
                     ("docker-compose.yml", "docker/compose.hostnet.yml", "docker/compose.tls.yml")]


@pytest.mark.parametrize("files", COMPOSE_FILE_SETS)
def test_compose_env_and_ports_match_typed_configs(files):
    doc = compose_doc(*files)
    services = doc["services"]
    assert {"redis", "scheduler", "coordinator", "worker", "worker-emulated", "worker-gpu", "gateway"} <= set(services)
    seen = set()
    for name, svc in services.items():
        service = served(svc.get("command"))
        env = svc.get("environment", {})
        if service is None:
            continue
        seen.add(service)
        for key in env:
            assert key in config_env(service) or FOREIGN_ENV.match(key), f"{name}: {key} is not a {service} option"
        assert svc["healthcheck"]["test"] and "stop_grace_period" in svc
        grace = int(resolve(svc["stop_grace_period"]).rstrip("s"))
        assert grace > float(resolve(env["SPLITSERVE_DRAIN_TIMEOUT_S"])), f"{name}: stop_grace_period <= drain"
        port_var = f"SPLITSERVE_{service.upper()}_PORT"
        port = int(resolve(env.get(port_var, default(service, "port"))))
        if "docker/compose.hostnet.yml" not in files:
            assert port == default(service, "port") or service == "worker", f"{name}: {port_var}"
        if service == "gateway" and "docker/compose.hostnet.yml" not in files:
            published = [resolve(p).split(":")[1] for p in svc["ports"]]
            assert published == [resolve(env["SPLITSERVE_GATEWAY_HTTP_PORT"]), resolve(env["SPLITSERVE_GATEWAY_PORT"])]
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond["condition"] == "service_healthy" and dep in services
    assert seen == set(SERVICE_CONFIGS)
    # Addresses in the base file name a compose service and its gRPC port.
    if len(files) == 1:
        coord = services["coordinator"]["environment"]
        gw = services["gateway"]["environment"]
        assert resolve(coord["SPLITSERVE_COORDINATOR_SCHEDULER_ADDRESS"]) == f"scheduler:{default('scheduler', 'port')}"
        assert resolve(gw["SPLITSERVE_GATEWAY_COORDINATOR_ADDRESS"]) == f"coordinator:{default('coordinator', 'port')}"
        assert resolve(services["scheduler"]["environment"]["SPLITSERVE_REDIS_URL"]).startswith("redis://redis:6379/")
    # Profiles: emulated workers, GPU workers reserving nvidia GPUs, monitoring.
    assert services["worker-emulated"]["profiles"] == ["emulated"]
    assert resolve(services["worker-emulated"]["environment"]["SPLITSERVE_WORKER_BACKEND"]) == "emulated"
    assert resolve(services["worker-emulated"]["scale"]) == "16"
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]


def test_compose_variables_are_config_options_or_documented():
    text = "".join((ROOT / name).read_text() for name in COMPOSE_FILE_SETS[-1])
    for var in interpolated(text):
        if var.startswith("SPLITSERVE_"):
            assert var in ALL_CONFIG_ENV or var in DEPLOY_ONLY, f"${{{var}}}: neither a config option nor documented"
    docs = (ROOT / "docs/deployment.md").read_text()
    for var in DEPLOY_ONLY:
        assert var in docs, f"{var} is not described in docs/deployment.md"


@pytest.mark.parametrize("tool", [["docker-compose"], ["docker", "compose"]])
def test_compose_config_accepted_by_compose(tool):
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{' '.join(tool)} is not installed")
    if tool == ["docker", "compose"] and subprocess.run(tool + ["version"], capture_output=True).returncode != 0:
        pytest.skip("Compose v2 (docker compose) is not installed")
    profiles = ["--profile", "emulated", "--profile", "gpu", "--profile", "monitoring"]
    for files in COMPOSE_FILE_SETS:
        out = subprocess.run([*tool, *sum((["-f", f] for f in files), []), *profiles, "config", "-q"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr


def test_compose_tls_override_mounts_the_certificates_everywhere():
    services = compose_doc(*COMPOSE_FILE_SETS[2])["services"]
    for name, svc in services.items():
        if served(svc.get("command")) is None:
            continue
        env = svc["environment"]
        assert env["SPLITSERVE_MTLS_CA_FILE"] == "/certs/ca.pem", name
        assert env["SPLITSERVE_MTLS_SERVER_NAME"] == "splitserve-internal", name
        assert any(resolve(v).endswith(":/certs:ro") for v in svc["volumes"]), name
    gateway = services["gateway"]["environment"]
    assert gateway["SPLITSERVE_GATEWAY_TLS_CERT_FILE"] == "/certs/gateway.pem"
    assert resolve(gateway["SPLITSERVE_GATEWAY_TLS_CLIENT_CA_FILE"]) == ""  # client certificates: opt-in
    # Prometheus scrapes the gateway over HTTPS, trusting the mounted CA; the rest as without TLS.
    assert "./docker/prometheus/prometheus.tls.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    plain, tls = (yaml.safe_load((ROOT / f"docker/prometheus/{name}").read_text())["scrape_configs"]
                  for name in ("prometheus.yml", "prometheus.tls.yml"))
    gateway_job = next(job for job in tls if job["job_name"] == "gateway")
    assert gateway_job["scheme"] == "https" and gateway_job["tls_config"]["ca_file"] == "/certs/ca.pem"
    assert [job for job in tls if job["job_name"] != "gateway"] == [job for job in plain if job["job_name"] != "gateway"]


# ---------------------------------------------------------------- images, health check, dashboard


def test_dockerfile_and_healthcheck_agree_with_configs():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001", text, re.M) and "HEALTHCHECK" in text
    for service in SERVICE_CONFIGS:  # every service listens on all addresses in a container
        assert f"SPLITSERVE_{service.upper()}_HOST=0.0.0.0" in text
        assert f"SPLITSERVE_{service.upper()}_HOST" in config_env(service)
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm", text, re.M)
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    assert {default(s, "port") for s in SERVICE_CONFIGS} | {default("gateway", "http_port")} <= exposed
    import importlib.util

    spec = importlib.util.spec_from_file_location("hc", ROOT / "docker/healthcheck.py")
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    assert hc.DEFAULT_PORTS == {s: default(s, "port") for s in SERVICE_CONFIGS}
    ignored = (ROOT / ".dockerignore").read_text()
    assert "docker/wheelhouse" in ignored and "!splitserve/**" in ignored


@lru_cache(maxsize=1)
def defined_metrics() -> frozenset[str]:
    """Metric names the code defines (Counter/Histogram/Gauge), with the series Prometheus derives."""
    names = set()
    for path in [*ROOT.glob("gateway/*.py"), *ROOT.glob("services/**/*.py"), *ROOT.glob("workers/**/*.py"),
                 *ROOT.glob("splitserve/*.py")]:
        text = path.read_text()
        for kind, name in re.findall(r"\b(Counter|Histogram|Gauge)\(\s*\"(splitserve_\w+)\"", text):
            names.add(name)
            if kind == "Histogram":
                names.update(f"{name}{s}" for s in ("_bucket", "_sum", "_count"))
    return frozenset(names)


@lru_cache(maxsize=1)
def exported_vllm_metrics() -> frozenset[str]:
    """The vLLM-named series the code exports (workers' collector and the coordinator's
    families), with the suffixes Prometheus' exposition gives counters and histograms."""
    from prometheus_client import CollectorRegistry

    from services.coordinator import vllm_metrics as coordinator_metrics
    from splitserve.core.records import WorkerLoad
    from workers.vllm_metrics import VllmWorkerCollector

    collector = VllmWorkerCollector()
    collector.attach("m", lambda: WorkerLoad())
    families = list(collector.collect())
    for metric in vars(coordinator_metrics).values():
        if hasattr(metric, "collect") and hasattr(metric, "_name") and not isinstance(metric, CollectorRegistry):
            families.extend(metric.collect())
    names = set()
    for family in families:
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}[family.type]
        names.update(family.name + s for s in suffixes)
    assert names, "no vLLM-named metric found"
    return frozenset(n for n in names if n.startswith("vllm:"))


def test_grafana_dashboard_queries_defined_metrics():
    dash = json.loads((ROOT / "docker/grafana/dashboards/splitserve.json").read_text())
    used = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            used.update(re.findall(r"\bsplitserve_\w+", target["expr"]))
    assert len(used) >= 20
    assert used <= defined_metrics(), sorted(used - defined_metrics())
    prom = yaml.safe_load((ROOT / "docker/prometheus/prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} == {"gateway", "scheduler", "coordinator", "worker"}
    provisioning = yaml.safe_load((ROOT / "docker/grafana/provisioning/dashboards/splitserve.yml").read_text())
    assert provisioning["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
