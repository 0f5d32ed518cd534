"""A ``.gguf`` file works wherever a model folder does (``--target``, ``--draft``, ``--model``):
converted once into the cache, keyed by the file, then loaded like any folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specd.services.model_store import fetch, gguf_import


def _fake_convert(calls: list[Path]):
    def convert(gguf_file: Path, out_dir: Path) -> None:
        calls.append(gguf_file)
        (out_dir / "config.json").write_text(json.dumps({"from": gguf_file.name}))

    return convert


def test_a_gguf_is_converted_once_and_again_when_the_file_changes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    fake = _fake_convert(calls)  # the real conversion runs on the real pair's file below
    monkeypatch.setattr(gguf_import, "convert_once", lambda f, d, k: fetch.convert_once(f, d, k, fake))
    model = tmp_path / "My-Model.Q4_K_M.gguf"
    model.write_bytes(b"GGUF v1")
    first = Path(gguf_import.resolve_model_path(str(model)))
    assert first.parent == tmp_path / "cache" / "imported" and first.name.startswith("My-Model.Q4_K_M-")
    assert (first / "config.json").is_file() and len(calls) == 1
    assert gguf_import.resolve_model_path(str(model)) == str(first) and len(calls) == 1  # cached
    model.write_bytes(b"GGUF v2, another file")
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))
    second = Path(gguf_import.resolve_model_path(str(model)))
    assert second != first and len(calls) == 2
    assert not [p for p in second.parent.iterdir() if p.name.startswith(".")], "no temporary folder left behind"


def test_folders_and_hub_ids_pass_through_and_a_missing_gguf_is_a_clear_error(tmp_path) -> None:
    assert gguf_import.resolve_model_path("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert gguf_import.resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        gguf_import.resolve_model_path(str(tmp_path / "missing.gguf"))


def test_the_served_name_of_a_gguf_drops_the_suffix() -> None:
    from specd.services.common.config import ServiceConfig

    assert ServiceConfig(model="/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", port=1).model_name == (
        "qwen2.5-coder-0.5b-instruct-q4_k_m"
    )


def test_the_real_draft_gguf_loads_as_the_fetched_folder_does(real_pair) -> None:
    """The pair's own Q4_K_M file, given directly: the same weights, tokenizer and EOS as the folder
    `specd models fetch` made from it (the first run converts it, about two minutes; then cached)."""
    from safetensors import safe_open

    from specd.services.engine.builder import load_tokenizer
    from specd.services.engine.model import load_model
    from specd.services.model_store.pairs import PAIRS

    _, draft_dir = real_pair
    gguf = fetch.gguf_path(PAIRS["qwen2.5-coder"].draft.source)
    if not gguf.is_file():
        pytest.skip("the pair's GGUF is no longer in the cache (only the converted folder is)")
    imported = Path(gguf_import.resolve_model_path(str(gguf)))
    with safe_open(imported / "model.safetensors", "pt") as a, safe_open(draft_dir / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    assert load_tokenizer(str(gguf)).get_vocab() == load_tokenizer(str(draft_dir)).get_vocab()
    model = load_model(str(gguf), torch.bfloat16, quantize="int8")
    assert model.info.eos_token_ids == load_model(str(draft_dir), torch.bfloat16, quantize="int8").info.eos_token_ids
