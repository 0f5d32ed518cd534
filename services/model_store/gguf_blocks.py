"""Quantized weights read straight out of a GGUF file, into the int4 kernel's layout, without loss.

llama.cpp's Q4_K block is ``d * sc * q - dmin * m`` over 8 groups of 32 weights with 6-bit ``sc``
and ``m`` and fp16 ``d`` and ``dmin``: the int4 kernel's own super-block (``kernels/linear.h``,
8-bit ``sc`` and ``m``), with the nibbles in the same order. So ``--quantize int4`` on a model that
came from a Q4_K_M file serves that file's very weights, where quantizing its dequantized bf16
copy again would move every weight by up to half a step. Tensors the file keeps in another format
(Q4_K_M keeps some ``attn_v`` and ``ffn_down`` in Q6_K, and the output head) are not Q4_K: the
loader gives those linear layers int8 instead, more bits, as the file intended.

Only Qwen2-family files map one to one (llama.cpp permutes the query and key rows of Llama files for
its RoPE layout); others fall back to quantizing the bf16 weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

Q4_K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of packed 6-bit scales and mins, 128 of nibbles
Q4_K_WEIGHTS = 256
EXACT_ARCHITECTURES = ("qwen2",)

# GGUF tensor names -> Hugging Face names, per layer and global.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF linear weight (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for anything else."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def q4k_to_int4_records(blocks: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Q4_K blocks of an [n, k] weight (``n * k / 256`` blocks of 144 bytes, row-major) -> the int4
    kernel's row records [n, int4_row_bytes(k)]: nibbles as they are, ``sc`` and ``m`` unpacked from
    6 bits to bytes, ``d`` and ``dmin`` as they are."""
    if k % Q4_K_WEIGHTS:
        raise ValueError(f"Q4_K rows are whole blocks of {Q4_K_WEIGHTS} weights, got {k}")
    s = k // Q4_K_WEIGHTS
    b = torch.from_numpy(
        np.array(blocks, dtype=np.uint8).reshape(n, s, Q4_K_BLOCK_BYTES)
    )  # a copy: the map is read-only
    dd, packed, qs = b[..., 0:4], b[..., 4:16].to(torch.int32), b[..., 16:]
    # ggml's get_scale_min_k4: groups 0-3 in the low 6 bits of bytes 0-3 (sc) and 4-7 (m); groups 4-7
    # from the low and high nibbles of bytes 8-11 with their top 2 bits in the top of bytes 0-3 / 4-7.
    sc = torch.cat([packed[..., 0:4] & 63, (packed[..., 8:12] & 15) | ((packed[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], dim=-1)
    d, dmin = dd[..., 0:2].reshape(n, 2 * s), dd[..., 2:4].reshape(n, 2 * s)
    return torch.cat(
        [qs.reshape(n, k // 2), sc.to(torch.uint8).reshape(n, -1), m.to(torch.uint8).reshape(n, -1), d, dmin], dim=1
    )


def read_q4k_linears(path: str | Path) -> dict[str, torch.Tensor]:
    """Every Q4_K linear weight of a GGUF file as int4 records, by Hugging Face name; empty for a file
    whose architecture is not mapped one to one (see the module docstring)."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
    if arch not in EXACT_ARCHITECTURES:
        return {}
    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or t.tensor_type != GGMLQuantizationType.Q4_K:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF shapes are innermost first
        out[name] = q4k_to_int4_records(t.data, n, k)
    return out


def gguf_source(folder: str | Path) -> Path | None:
    """The GGUF file a model folder was converted from (by ``specd models fetch``, or from a ``.gguf``
    given as a model), if it is still there unchanged; else None. An import is checked by the key its
    stamp holds (path, size, modification time), a fetched file by its verification marker."""
    from specd.services.model_store.fetch import STAMP, _stamp_of, cache_root
    from specd.services.model_store.gguf_import import _source_key

    try:
        stamp = json.loads((Path(folder) / STAMP).read_text())
    except (OSError, ValueError):
        return None
    key = stamp.get("source_sha256")
    recorded = Path(stamp.get("source_path") or "/nonexistent")
    if recorded.is_file() and _source_key(recorded) == key:
        return recorded
    for marker in (cache_root() / "gguf").glob("*.gguf.verified"):
        gguf = marker.with_name(marker.name.removesuffix(".verified"))
        try:
            seen = json.loads(marker.read_text())
            if seen.get("sha256") == key and gguf.is_file() and {**_stamp_of(gguf), "sha256": key} == seen:
                return gguf
        except (OSError, ValueError):
            continue
    return None
