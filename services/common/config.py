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
        """The name clients see: --served-model-name, else the model directory's name (or the
        .gguf file's, less the suffix)."""
        name = self.model.rstrip("/").split("/")[-1]
        return self.served_model_name or (name[: -len(".gguf")] if name.lower().endswith(".gguf") else name)
