"""Quantized weights saved once per model folder and format, and read back at the next start."""

from __future__ import annotations

import os

import pytest
import torch

from specd.services.engine import llama as llama_mod
from specd.services.engine.llama import LlamaLM, open_llama_checkpoint
from specd.services.engine.quantized_store import QuantizedStore


def _model(folder, quantize: str, store: QuantizedStore | None) -> LlamaLM:
    c = open_llama_checkpoint(str(folder))
    return LlamaLM(
        c.shape, c.state, c.inv_freq, c.attention_scaling, c.info, torch.bfloat16, quantize=quantize,
        quantized_store=store,
    )  # fmt: skip


def _logits(model: LlamaLM) -> torch.Tensor:
    cache = model.new_paged_cache(1, 8, 8, 64)
    cache.reserve(0, 32)
    ids = torch.tensor([[5, 17, 99, 23, 8, 41]])
    return model.forward(ids, cache, cache.layout([0], [0], ids.shape[1]), "all")


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_second_start_reads_what_the_first_quantized(tiny_pair, tmp_path, monkeypatch, quantize: str) -> None:
    from specd.services.engine.kernels import ensure_built

    if not ensure_built():
        pytest.skip("needs the AVX2 kernels")
    target, _ = tiny_pair
    first = QuantizedStore.for_folder(target, quantize, torch.bfloat16, min_bytes=0, root=tmp_path)
    assert first is not None and not first.path.exists()
    want = _logits(_model(target, quantize, first))
    assert first.path.is_file()

    def refuse(weight: torch.Tensor):
        raise AssertionError("quantized again")

    monkeypatch.setattr(llama_mod, "quantize_int8", refuse)
    monkeypatch.setattr(llama_mod, "quantize_int4", refuse)
    second = QuantizedStore.for_folder(target, quantize, torch.bfloat16, min_bytes=0, root=tmp_path)
    assert second is not None and second.path == first.path
    assert torch.equal(_logits(_model(target, quantize, second)), want)


def test_the_key_follows_the_checkpoint_format_and_dtype(tiny_pair, tmp_path) -> None:
    target, _ = tiny_pair
    path = QuantizedStore.for_folder(target, "int8", torch.bfloat16, min_bytes=0, root=tmp_path).path
    assert QuantizedStore.for_folder(target, "int4", torch.bfloat16, min_bytes=0, root=tmp_path).path != path
    assert QuantizedStore.for_folder(target, "int8", torch.float32, min_bytes=0, root=tmp_path).path != path
    weights = next(target.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    try:
        assert QuantizedStore.for_folder(target, "int8", torch.bfloat16, min_bytes=0, root=tmp_path).path != path
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    # Small models are not worth a file each.
    assert QuantizedStore.for_folder(target, "int8", torch.bfloat16, root=tmp_path) is None


def test_an_unreadable_file_is_quantized_again(tiny_pair, tmp_path) -> None:
    target, _ = tiny_pair
    store = QuantizedStore.for_folder(target, "int8", torch.bfloat16, min_bytes=0, root=tmp_path)
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(b"not safetensors")
    again = QuantizedStore.for_folder(target, "int8", torch.bfloat16, min_bytes=0, root=tmp_path)
    assert again.get("lm_head.weight:int8", 2) is None
