"""Quantized weights kept on disk, so a model is quantized once per machine, not at every start.

Quantizing the real pair's 0.5B draft to int8 took 1.1 s of a 4.8 s cold start (reading every bf16
page of the checkpoint included). The results are saved beside the other caches as one safetensors
file per (model folder, weight format) and memory-mapped at the next start, read only when a
forward touches them. The key covers the folder's weight files (name, size, modification time) and
:data:`FORMAT_VERSION`, so a changed checkpoint or layout is quantized afresh; a file that cannot
be read or written only costs the quantization.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Bump when a quantized layout (services/engine/kernels/linear.h) or quantizer changes.
FORMAT_VERSION = 1
# Smaller models quantize in well under a second: not worth a file each (test models would litter).
MIN_CACHED_BYTES = 256 * 2**20


class QuantizedStore:
    """Quantized tensors of one model folder in one format, by weight name: those saved by an earlier
    start (``get``), and those quantized in this one (``put``, written by ``save``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.new: dict[str, torch.Tensor] = {}
        self._mapped = None
        if path.is_file():
            from specd.services.engine.checkpoint import _MappedSafetensors

            try:
                self._mapped = _MappedSafetensors(path)
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable quantized weights %s (%s)", path, exc)

    @classmethod
    def for_folder(
        cls,
        folder: str | Path,
        fmt: str,
        dtype: torch.dtype,
        min_bytes: int = MIN_CACHED_BYTES,
        root: Path | None = None,
    ) -> QuantizedStore | None:
        """The store of ``folder``'s weights in ``fmt`` ("int8", "int4") quantized from ``dtype`` (the
        weights are cast to it first), or None when the folder has fewer than ``min_bytes`` of
        safetensors (or none)."""
        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        stats = [(f.name, f.stat()) for f in files]
        if not files or sum(s.st_size for _, s in stats) < min_bytes:
            return None
        key = hashlib.sha256(
            repr(
                (
                    str(folder.resolve()),
                    fmt,
                    str(dtype),
                    FORMAT_VERSION,
                    [(n, s.st_size, s.st_mtime_ns) for n, s in stats],
                )
            ).encode()
        ).hexdigest()[:16]
        if root is None:
            from specd.services.model_store.fetch import cache_root

            root = cache_root()
        return cls(root / "quantized" / f"{folder.name}-{fmt}-{key}.safetensors")

    def get(self, name: str, count: int) -> tuple[torch.Tensor, ...] | None:
        """The ``count`` tensors saved for ``name`` (a weight and its scales), or None."""
        if self._mapped is None:
            return None
        keys = [f"{name}/{i}" for i in range(count)]
        if not all(k in self._mapped.header for k in keys):
            return None
        tensors = tuple(self._mapped.tensor(k) for k in keys)
        return None if any(t is None for t in tensors) else tensors

    def put(self, name: str, tensors: tuple[torch.Tensor, ...]) -> None:
        for i, t in enumerate(tensors):
            self.new[f"{name}/{i}"] = t

    def save(self) -> None:
        """Write what this start quantized, with what was read, as the folder's file (atomically)."""
        if not self.new:
            return
        from safetensors.torch import save_file

        tensors: Mapping[str, torch.Tensor] = dict(self.new)
        if self._mapped is not None:
            old = {k: self._mapped.tensor(k) for k in self._mapped.header if k != "__metadata__"}
            tensors = {**{k: v for k, v in old.items() if v is not None}, **self.new}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full or read-only disk: quantize again next time
            log.warning("could not save quantized weights to %s (%s)", self.path, exc)
            tmp.unlink(missing_ok=True)
        self.new = {}
