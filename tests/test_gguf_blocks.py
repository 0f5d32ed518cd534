"""A GGUF file's Q4_K blocks become int4 records without loss (``services/model_store/gguf_blocks.py``),
and ``--quantize int4`` on a model fetched from a Q4_K_M file serves those very weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd.services.engine.llama import dequantize_int4
from specd.services.model_store.gguf_blocks import gguf_source, hf_name, q4k_to_int4_records, read_q4k_linears


def test_names_map_to_hugging_face() -> None:
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.attn_q.bias") is None and hf_name("token_embd.weight") is None


def test_q4k_blocks_decode_to_ggml_own_dequantization() -> None:
    """Random Q4_K blocks (every 6-bit scale and min pattern reachable), decoded through our records,
    give exactly what gguf-py's reference dequantizer gives."""
    from gguf import GGMLQuantizationType, quants

    n, k = 6, 768
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(n, k // 256 * 144), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.02, size=(n, k // 256, 2)).astype(np.float16)  # sane d and dmin
    blocks.reshape(n, k // 256, 144)[:, :, :4] = halves.view(np.uint8).reshape(n, k // 256, 4)
    ours = dequantize_int4(q4k_to_int4_records(blocks, n, k), k)
    ref = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q4_K).astype(np.float32)).reshape(n, k)
    assert torch.equal(ours, ref)


def test_the_real_pairs_q4k_weights_are_served_as_they_are(real_pair) -> None:
    """The fetched 0.5B folder leads back to its Q4_K_M file; its Q4_K tensors (ffn_down of half the
    layers) decode to the folder's bf16 weights (which were dequantized from the same blocks)."""
    from safetensors import safe_open

    _, draft = real_pair
    source = gguf_source(draft)
    assert source is not None and source.name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    records = read_q4k_linears(source)
    assert records and all(name.endswith("mlp.down_proj.weight") for name in records)
    name = sorted(records)[0]
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        folder = f.get_tensor(name)
    assert torch.equal(dequantize_int4(records[name], folder.shape[1]).bfloat16(), folder)


def test_a_folder_without_a_source_has_none(tmp_path) -> None:
    assert gguf_source(tmp_path) is None
    (tmp_path / "specd_fetch.json").write_text('{"source_sha256": "0" , "source_path": "/nowhere.gguf"}')
    assert gguf_source(tmp_path) is None


@pytest.mark.parametrize("bad", ["", "not json"])
def test_a_broken_stamp_is_no_source(tmp_path, bad: str) -> None:
    (tmp_path / "specd_fetch.json").write_text(bad)
    assert gguf_source(tmp_path) is None
