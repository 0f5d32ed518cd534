"""What every model-serving process is configured with; each service's config extends it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from specd.services.engine.kv_cache import DEFAULT_KV_CACHE_MEMORY
from specd.services.engine.prefill import DEFAULT_PREFILL_CHUNK

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def parse_bytes(text: str) -> int:
    """A size such as ``2GiB``, ``1.5G``, ``512MiB`` or ``1073741824`` in bytes (``B`` optional)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 4G)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value < 1:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value)


@dataclass(frozen=True)
class ServiceConfig:
    model: str
    port: int
    host: str = "0.0.0.0"
    metrics_port: int | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    backend: str = "auto"
    max_model_len: int | None = None  # None: the model's own context
    served_model_name: str | None = None
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY  # bytes of the model's KV block pool
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per prefill pass

    @property
    def model_name(self) -> str:
        """The name clients see: --served-model-name, else the model directory's name (or the
        .gguf file's, less the suffix)."""
        name = self.model.rstrip("/").split("/")[-1]
        return self.served_model_name or (name[: -len(".gguf")] if name.lower().endswith(".gguf") else name)
