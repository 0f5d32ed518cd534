"""Mutual TLS between specd services: one certificate, key and CA per process, parsed once at the edge.

A server given them accepts only clients that present a certificate signed by that CA; a client
presents its own certificate and verifies the server's against the same CA. Without them everything
stays plaintext (the local default). ``scripts/dev-certs.sh`` makes a CA and certificates to try it.

Replicas found by DNS are dialled by IP (services/common/discovery.py), so a client can be told the
name the servers' certificates carry (``server_name``, gRPC's ``ssl_target_name_override``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSConfig:
    """PEM contents (not paths: read once, at start-up, so a bad file fails there)."""

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str | None = None  # the name servers' certificates must carry; default: the dialled host

    @classmethod
    def from_files(
        cls, cert: str | None, key: str | None, ca: str | None, server_name: str | None = None
    ) -> TLSConfig | None:
        """None when no file is given; ValueError when only some are, or one cannot be read."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            if server_name:
                raise ValueError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca")
            return None
        missing = [flag for flag, v in given.items() if not v]
        if missing:
            raise ValueError(f"mutual TLS needs --tls-cert, --tls-key and --tls-ca; missing {', '.join(missing)}")
        data = {}
        for flag, path in given.items():
            try:
                data[flag] = Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
            if b"-----BEGIN" not in data[flag]:
                raise ValueError(f"{flag} {path}: not a PEM file")
        return cls(data["--tls-cert"], data["--tls-key"], data["--tls-ca"], server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel(address: str, tls: TLSConfig | None, options: list | None = None) -> grpc.Channel:
    """A blocking channel: mutual TLS with ``tls``, plaintext without."""
    options = list(options or [])
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())


def aio_channel(address: str, tls: TLSConfig | None, options: list | None = None) -> grpc.aio.Channel:
    """An asyncio channel: mutual TLS with ``tls``, plaintext without."""
    options = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())
