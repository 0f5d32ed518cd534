"""Gateway configuration: parsed once by the CLI, passed to :func:`gateway.app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    target_addresses: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the target's model name
    first_message_timeout: float = 10.0  # seconds for a target to accept a request (then 503)
    health_interval: float = 2.0  # seconds between target health probes
