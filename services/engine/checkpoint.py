"""Reading a Hugging Face checkpoint tensor by tensor, optionally only one tensor-parallel rank's slice.

Loading through ``transformers`` materialises the whole model in float32 first: 4 bytes per
parameter in host memory for every process, before anything is cast, sliced or moved. That is fine
for the demo pair and for one mid-sized model, and it is a wall for a sharded target: with
``--tensor-parallel-size 8`` on a 70B model every rank would read 280 GB to keep 1/8 of it.

:class:`SafetensorsState` instead reads ``*.safetensors`` files through memory maps, one tensor at a
time, and for a sharded tensor only the rows or columns of this rank. :class:`~specd.services.engine.llama.LlamaLM`
casts and moves each tensor as it takes it, so the peak is one tensor of the checkpoint, not the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

# dim along which a tensor is split across ranks, or None when every rank keeps all of it
SplitRule = Callable[[str], int | None]

WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_SINGLE = "model.safetensors"


def local_checkpoint_dir(name_or_path: str) -> Path | None:
    """The directory holding ``name_or_path``'s files: the path itself, or the hub snapshot in the
    local cache (downloaded if the hub is reachable). None if neither works."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        )
    except Exception:  # unknown id, no network and no cache: transformers reports it properly
        return None


def safetensors_files(directory: Path) -> dict[str, Path] | None:
    """Tensor name -> file, from the sharded index or the single file; None if there are none."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_SINGLE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    return None


_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


class _MappedSafetensors:
    """One safetensors file memory-mapped once, its header parsed once: a tensor is a view of the map
    (copy-on-write, so the file is never written), read from disk only when its pages are touched.
    Opening the file per tensor and copying each out cost seconds of a cold start for a 1.5B model."""

    def __init__(self, path: Path) -> None:
        import mmap

        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > path.stat().st_size - 8:
                raise ValueError(f"{path} is not a safetensors file (its header length is past its end)")
            self.header = json.loads(f.read(n))
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.base = 8 + n

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor as a view of the map, or None for a dtype this reader does not know."""
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            return None
        begin, end = info["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=self.base + begin).view(info["shape"])


class SafetensorsState(Mapping[str, torch.Tensor]):
    """A read-only state dict over safetensors files; each lookup reads that tensor (or this rank's
    equal share of it along ``split(name)``) from disk, in the checkpoint's own dtype. Whole tensors
    are views of a memory map of the file (see :class:`_MappedSafetensors`)."""

    def __init__(self, files: dict[str, Path], split: SplitRule | None = None, rank: int = 0, world: int = 1) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.files = files
        self.split = split or (lambda name: None)
        self.rank, self.world = rank, world
        self._maps: dict[Path, _MappedSafetensors] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        dim = self.split(name) if self.world > 1 else None
        if dim is None:
            path = self.files[name]
            if path not in self._maps:
                self._maps[path] = _MappedSafetensors(path)
            mapped = self._maps[path].tensor(name)
            if mapped is not None:
                return mapped
        with safe_open(self.files[name], framework="pt") as f:
            if dim is None:
                return f.get_tensor(name)
            sl = f.get_slice(name)
            size = sl.get_shape()[dim]
            if size % self.world:
                raise ValueError(f"{name}: size {size} along dim {dim} does not split over {self.world} ranks")
            n = size // self.world
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(self.rank * n, (self.rank + 1) * n)
            return sl[tuple(index)]  # copies only this rank's rows / columns out of the memory map

    def shape_of(self, name: str) -> list[int]:
        """The full (unsplit) shape of tensor ``name``, from the file's header: nothing is read."""
        with safe_open(self.files[name], framework="pt") as f:
            return list(f.get_slice(name).get_shape())

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)
