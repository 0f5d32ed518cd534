"""What every model-serving process is configured with; each service's config extends it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceConfig:
    model: str
    port: int
    host: str = "0.0.0.0"
    metrics_port: int | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    backend: str = "auto"
    max_model_len: int = 1024
    served_model_name: str | None = None

    @property
    def model_name(self) -> str:
        """The name clients see: --served-model-name, else the model directory's name."""
        return self.served_model_name or self.model.rstrip("/").split("/")[-1]
