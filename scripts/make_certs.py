#!/usr/bin/env python3
"""Make a local CA and the certificates splitserve's TLS and mutual TLS use (tests, compose).

    .venv/bin/python scripts/make_certs.py --out .splitserve/certs
    .venv/bin/python scripts/make_certs.py --out certs --san gw.example.internal --days 30
    .venv/bin/python scripts/make_certs.py --out .splitserve/certs --key-owner 10001   # for compose.tls.yml

Writes into --out (keys mode 0600, certificates 0644; ECDSA P-256, SHA-256):

    ca.pem, ca.key            the CA (keep ca.key out of deployments: only signing needs it)
    service.pem, service.key  every internal service (scheduler, coordinator, workers, and the
                              gateway as a client of the coordinator): server *and* client
                              certificate -> --mtls-cert-file / --mtls-key-file, ca.pem -> --mtls-ca-file
    gateway.pem, gateway.key  the gateway's public listeners -> --tls-cert-file / --tls-key-file
    client.pem, client.key    a client certificate (SDK cert_file/key_file, httpx cert=) for a gateway
                              run with --tls-client-ca-file ca.pem

Server certificates name localhost, 127.0.0.1, ::1, the compose service names (gateway,
coordinator, scheduler, worker, redis) and `splitserve-internal` (the name to give
`--mtls-server-name` when workers are dialed by an IP their certificate cannot name, e.g. in
compose); --san adds more (DNS names or IP addresses). An existing CA in --out is reused
(certificates signed again by it) unless --force, so certificates made earlier stay valid.
Needs the `cryptography` package (in the project's dev dependencies).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

INTERNAL_NAME = "splitserve-internal"
DEFAULT_NAMES = ["localhost", "127.0.0.1", "::1", "gateway", "coordinator", "scheduler", "worker", "redis",
                 INTERNAL_NAME]
GATEWAY_NAMES = ["localhost", "127.0.0.1", "::1", "gateway"]
CONTAINER_KEYS = ("service", "gateway")  # the keys the services read (--key-owner)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitserve (local)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # de-duplicated, in order
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _write(path: Path, data: bytes, mode: int) -> None:
    # Created with its final mode: a key is never readable by others, not even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, mode)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("splitserve local CA")).issuer_name(_name("splitserve local CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str, names: list[str],
              server: bool, client: bool, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                            crl_sign=False, content_commitment=False, data_encipherment=False,
                                            key_agreement=True, encipher_only=False, decipher_only=False),
                              critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def parse_owner(text: str) -> tuple[int, int]:
    """`UID` or `UID:GID` (numbers; GID defaults to UID) -> (uid, gid)."""
    uid, sep, gid = text.partition(":")
    try:
        return int(uid), int(gid) if sep else int(uid)
    except ValueError:
        raise ValueError(f"--key-owner: expected UID or UID:GID (numbers), got {text!r}") from None


def make_certs(out: Path, extra_names: list[str] = (), days: int = 825, force: bool = False,
               key_owner: tuple[int, int] | None = None) -> dict[str, Path]:
    """Write the CA (or reuse the one in `out`) and the leaf certificates; their paths by name.
    `key_owner` (uid, gid): the service and gateway keys are given to that user (e.g. 10001,
    the container image's user, which cannot read a key mode 0600 of another owner); the CA's
    and the client's keys stay with the caller. PermissionError before anything is written
    when the caller may not give files away (not root, not that user)."""
    if key_owner is not None and os.geteuid() not in (0, key_owner[0]):
        raise PermissionError(f"only root (or uid {key_owner[0]}) can give files to uid {key_owner[0]}")
    out.mkdir(parents=True, exist_ok=True)
    ca_pem, ca_key_pem = out / "ca.pem", out / "ca.key"
    if ca_pem.exists() and ca_key_pem.exists() and not force:
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_pem.read_bytes(), password=None)
    else:
        ca_key, ca_cert = make_ca(days)
        _write(ca_key_pem, _key_pem(ca_key), 0o600)
        _write(ca_pem, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    paths = {"ca": ca_pem, "ca_key": ca_key_pem}
    leaves = [("service", "splitserve service", DEFAULT_NAMES + list(extra_names), True, True),
              ("gateway", "splitserve gateway", GATEWAY_NAMES + list(extra_names), True, False),
              ("client", "splitserve client", [], False, True)]
    for stem, common_name, names, server, client in leaves:
        key, cert = make_leaf(ca_key, ca_cert, common_name, names, server, client, days)
        _write(out / f"{stem}.key", _key_pem(key), 0o600)
        if key_owner is not None and stem in CONTAINER_KEYS:
            os.chown(out / f"{stem}.key", *key_owner)
        _write(out / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
        paths[stem], paths[f"{stem}_key"] = out / f"{stem}.pem", out / f"{stem}.key"
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".splitserve/certs"), help="output directory")
    parser.add_argument("--san", action="append", default=[], metavar="NAME",
                        help="another DNS name or IP address of the servers (repeatable)")
    parser.add_argument("--days", type=int, default=825, help="validity in days (default 825)")
    parser.add_argument("--force", action="store_true", help="make a new CA even when --out holds one")
    parser.add_argument("--key-owner", metavar="UID[:GID]",
                        help="give the service, gateway and client keys to this user (10001: the container "
                             "image's user, for docker/compose.tls.yml); needs root or that user")
    args = parser.parse_args(argv)
    if args.days < 1:
        parser.error("--days must be at least 1")
    try:
        owner = parse_owner(args.key_owner) if args.key_owner else None
    except ValueError as err:
        parser.error(str(err))
    try:
        paths = make_certs(args.out, args.san, args.days, args.force, owner)
    except PermissionError as err:
        parser.error(f"--key-owner {args.key_owner}: {err}" if args.key_owner and not err.filename else str(err))
    for name, path in paths.items():
        print(f"{name:12s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
