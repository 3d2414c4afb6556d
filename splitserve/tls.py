"""TLS for gRPC channels and servers and for the gateway's HTTP listener, from PEM files.

One place builds every credential so services, the SDK, the launcher and the tools agree:

- `channel_credentials(ca, cert, key)`: a client that verifies the server against `ca` (the
  system roots when empty) and, with `cert`/`key`, presents its own certificate (mTLS);
- `server_credentials(cert, key, client_ca)`: a server with its certificate that, with
  `client_ca`, requires and verifies a client certificate signed by it;
- `open_aio_channel` / `open_channel`: a grpc.aio / blocking channel, plaintext when no
  credentials are given (the default everywhere: nothing changes for existing users).

Every error names the option it came from (`TlsConfigError(field, message)`), e.g.
"mtls_cert_file: cannot read /etc/x.pem: No such file or directory".
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

ChannelOptions = Sequence[tuple[str, object]]


class TlsConfigError(ValueError):
    """A TLS option that cannot be used; `field` names the option."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def read_pem(path: str, field: str, *, private_key: bool = False) -> bytes:
    """The bytes of a PEM file; TlsConfigError naming `field` when it is missing or not PEM."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as err:
        raise TlsConfigError(field, f"cannot read {path}: {err.strerror or err}") from None
    marker = b"PRIVATE KEY-----" if private_key else b"-----BEGIN CERTIFICATE-----"
    if marker not in data:
        what = "a PEM private key" if private_key else "a PEM certificate"
        raise TlsConfigError(field, f"{path} does not hold {what}")
    return data


def _pair(cert_file: str, key_file: str, cert_field: str, key_field: str) -> tuple[bytes, bytes] | None:
    if bool(cert_file) != bool(key_file):
        missing = key_field if cert_file else cert_field
        raise TlsConfigError(missing, f"is required with --{(cert_field if cert_file else key_field).replace('_', '-')}")
    if not cert_file:
        return None
    return read_pem(cert_file, cert_field), read_pem(key_file, key_field, private_key=True)


def channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "", *,
                        fields: tuple[str, str, str] = ("tls_ca_file", "tls_cert_file", "tls_key_file"),
                        ) -> grpc.ChannelCredentials:
    """Client credentials: trust `ca_file` (the system roots when empty); present `cert_file` +
    `key_file` when given (both or neither). `fields` name the options in errors."""
    roots = read_pem(ca_file, fields[0]) if ca_file else None
    pair = _pair(cert_file, key_file, fields[1], fields[2])
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=pair[1] if pair else None,
                                        certificate_chain=pair[0] if pair else None)


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "", *,
                       fields: tuple[str, str, str] = ("tls_cert_file", "tls_key_file", "tls_client_ca_file"),
                       ) -> grpc.ServerCredentials:
    """Server credentials: `cert_file` + `key_file`; with `client_ca_file`, a client must present a
    certificate signed by it (refused in the handshake otherwise)."""
    pair = _pair(cert_file, key_file, fields[0], fields[1])
    if pair is None:
        raise TlsConfigError(fields[0], "a TLS server needs a certificate and its key")
    roots = read_pem(client_ca_file, fields[2]) if client_ca_file else None
    return grpc.ssl_server_credentials([(pair[1], pair[0])], root_certificates=roots,
                                       require_client_auth=roots is not None)


def with_server_name(options: ChannelOptions, server_name: str) -> list[tuple[str, object]]:
    """`options` plus the name the server's certificate is checked against instead of the dialed
    host (for servers reached by an address their certificate does not name, e.g. a container IP)."""
    options = list(options)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def open_aio_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                     options: ChannelOptions = (), server_name: str = "") -> grpc.aio.Channel:
    """A grpc.aio channel: TLS with `credentials`, plaintext without."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials, options=with_server_name(options, server_name))


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 options: ChannelOptions = (), server_name: str = "") -> grpc.Channel:
    """A blocking gRPC channel: TLS with `credentials`, plaintext without."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=with_server_name(options, server_name))


@dataclass(frozen=True)
class ClientTls:
    """What a client needs to reach a TLS endpoint: the CA that signed the server's
    certificate (empty: the system roots) and, for mutual TLS, its own certificate and key.
    Carried by the launcher (health checks) and the tools that talk to services."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca_file, self.cert_file, self.key_file)

    def channel(self, address: str, options: ChannelOptions = ()) -> grpc.Channel:
        return open_channel(address, self.credentials(), options, self.server_name)

    def sdk_options(self) -> dict[str, object]:
        """The keywords of `splitserve.client.Client` / `AsyncClient` for this TLS."""
        return {"tls": True, "ca_file": self.ca_file or None, "cert_file": self.cert_file or None,
                "key_file": self.key_file or None, "server_name": self.server_name or None}

    def ssl_context(self) -> ssl.SSLContext:
        """An `ssl` client context (httpx `verify=`): trusts `ca_file`, presents the client cert."""
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file or self.key_file:
            _pair(self.cert_file, self.key_file, "cert_file", "key_file")
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def plain_or_tls_channel(address: str, tls: ClientTls | None, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking channel to `address`: plaintext when `tls` is None."""
    return open_channel(address, None, options) if tls is None else tls.channel(address, options)
