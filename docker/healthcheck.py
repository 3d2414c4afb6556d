#!/usr/bin/env python3
"""Container health check: readiness of the splitserve service this container runs.

Finds the service and its gRPC port from PID 1's command line (`splitserve serve SERVICE
[--port N]`), else SPLITSERVE_<SERVICE>_PORT, else the config default, and asks
grpc.health.v1 (service "", readiness). Port 0 (a free port, as host-networked replicas use):
the TCP ports PID 1 listens on are read from /proc and each is asked. Exit 0 when SERVING.

    splitserve-healthcheck [SERVICE [PORT]] [--liveness]
"""

from __future__ import annotations

import os
import sys

DEFAULT_PORTS = {"gateway": 50051, "worker": 50061, "scheduler": 50071, "coordinator": 50081}


def pid1_args() -> list[str]:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def service_and_port(argv: list[str]) -> tuple[str, int]:
    args = pid1_args()
    service = argv[0] if argv else ""
    if not service and "serve" in args:
        i = args.index("serve")
        service = args[i + 1] if i + 1 < len(args) else ""
    if service not in DEFAULT_PORTS:
        raise SystemExit(f"healthcheck: no splitserve service found (PID 1: {' '.join(args)!r})")
    if len(argv) > 1:
        return service, int(argv[1])
    for i, a in enumerate(args):
        if a == "--port" and i + 1 < len(args):
            return service, int(args[i + 1])
        if a.startswith("--port="):
            return service, int(a.split("=", 1)[1])
    return service, int(os.environ.get(f"SPLITSERVE_{service.upper()}_PORT", DEFAULT_PORTS[service]))


def listening_ports(pid: int = 1) -> list[int]:
    """TCP ports in LISTEN state whose socket PID `pid` holds (the network namespace's tables)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return []
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def channel(service: str, address: str):
    """The channel the service's own clients would use: mTLS (SPLITSERVE_MTLS_*) between the
    services; TLS on a gateway with a certificate (trusting SPLITSERVE_TLS_CA_FILE, else the
    services' CA, and presenting the services' certificate when it asks for one)."""
    import grpc

    env = os.environ
    ca, cert, key = (env.get(f"SPLITSERVE_MTLS_{name}", "") for name in ("CA_FILE", "CERT_FILE", "KEY_FILE"))
    server_name = env.get("SPLITSERVE_MTLS_SERVER_NAME", "")
    if service == "gateway":
        if not env.get("SPLITSERVE_GATEWAY_TLS_CERT_FILE"):
            return grpc.insecure_channel(address)
        ca, server_name = env.get("SPLITSERVE_TLS_CA_FILE") or ca, ""
    elif not ca:
        return grpc.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                               certificate_chain=_read(cert))
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def serving(service: str, port: int, health_service: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host = os.environ.get(f"SPLITSERVE_{service.upper()}_HOST", "0.0.0.0")
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    try:
        with channel(service, f"{host}:{port}") as channel_:
            reply = health_pb2_grpc.HealthStub(channel_).Check(
                health_pb2.HealthCheckRequest(service=health_service), timeout=2.0)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except (grpc.RpcError, OSError):  # OSError: a certificate file it cannot read
        return False


def main(argv: list[str]) -> int:
    health_service = "liveness" if "--liveness" in argv else ""
    argv = [a for a in argv if a != "--liveness"]
    service, port = service_and_port(argv)
    ports = [port] if port else listening_ports()
    for p in ports:
        if serving(service, p, health_service):
            return 0
    print(f"healthcheck: {service} not serving on port(s) {ports}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
