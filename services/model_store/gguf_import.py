"""A ``.gguf`` file given as a model (``--target``, ``--draft``, ``--model``): converted once into a
Hugging Face folder in the cache, then loaded like any other.

The conversion is the one ``specd models fetch`` runs (transformers' GGUF reader, dequantized to
bf16 safetensors, the tokenizer with its chat template): the first start with a new file takes
minutes (the reader and the dequantization are numpy), every later start finds the folder and
loads in seconds. ``--quantize int8|int4`` then quantizes the dequantized weights into our own
layouts at load, so a Q4_K_M file served as int4 is quantized twice (its 4-bit values, regrouped).
The folder is keyed by the file's resolved path, size and modification time, so an edited or
replaced file is converted afresh.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from specd.services.model_store.fetch import cache_root, convert_once

SUFFIX = ".gguf"


def is_gguf(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF file (by its suffix; it need not exist yet)."""
    return name_or_path.lower().endswith(SUFFIX)


def _source_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()


def imported_dir(path: Path) -> Path:
    """Where the conversion of the GGUF at ``path`` lives in the cache."""
    path = path.resolve()
    return cache_root() / "imported" / f"{path.name[: -len(SUFFIX)]}-{_source_key(path)[:12]}"


def resolve_model_path(name_or_path: str) -> str:
    """``name_or_path`` itself, or for a ``.gguf`` file the folder converted from it (converting it
    the first time). A missing file is an error naming it."""
    if not is_gguf(name_or_path):
        return name_or_path
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {name_or_path}")
    path = path.resolve()
    return str(convert_once(path, imported_dir(path), _source_key(path)))
