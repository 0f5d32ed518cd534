"""Gateway configuration: parsed once by the CLI, passed to :func:`specd.gateway.app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass

from specd.gateway.guard import DEFAULT_MAX_BODY_BYTES
from specd.services.common.drain import DEFAULT_DRAIN_TIMEOUT
from specd.services.common.tls import TLSConfig


@dataclass(frozen=True)
class GatewaySettings:
    target_addresses: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the target's model name
    first_message_timeout: float = 10.0  # seconds for a target to accept a request (then 503)
    health_interval: float = 2.0  # seconds between target health probes
    # gRPC deadline of a whole generation on the target: past it the target frees the request and
    # the client gets a 504 (or, mid-stream, an error event).
    request_timeout: float = 600.0
    retry_after: int = 1  # seconds, in the Retry-After header of a 429 (every target full)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    tls: TLSConfig | None = None  # mutual TLS to the targets (None: plaintext)
    ssl_certfile: str | None = None  # HTTPS for clients (uvicorn's own TLS)
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # with it, HTTPS clients must present a certificate of this CA
