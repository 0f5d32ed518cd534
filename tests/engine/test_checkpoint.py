"""Reading safetensors checkpoints tensor by tensor (services/engine/checkpoint.py), as tensor-parallel
ranks do: the same model as through ``transformers``, and each rank only its own slices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specd.services.engine.checkpoint import SafetensorsState
from specd.services.engine.llama import LlamaLM, load_llama, open_llama_checkpoint, read_llama
from specd.services.engine.model import BatchLayout
from specd.services.engine.tensor_parallel import local_shape, shard_llama_state, split_dim
from tests.engine.test_tensor_parallel import assert_sharded_forward_matches
from tests.tiny_models import random_hf_model

MODELS = {
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
}


def _saved(tmp_path: Path, case: str, **save_kw) -> tuple[object, Path]:
    model_type, overrides = MODELS[case]
    hf = random_hf_model(model_type, **overrides)
    hf.generation_config.eos_token_id = [2, 7]
    out = tmp_path / case
    hf.save_pretrained(out, **save_kw)
    return hf, out


@pytest.mark.parametrize("case", list(MODELS))
def test_lazy_checkpoint_is_the_model_transformers_loads(tmp_path, case) -> None:
    hf, path = _saved(tmp_path, case)
    want = read_llama(hf)
    got = open_llama_checkpoint(str(path))
    assert got is not None
    assert got.shape == want.shape
    assert torch.equal(got.inv_freq, want.inv_freq)  # RoPE variants included
    assert got.attention_scaling == want.attention_scaling
    assert got.info.eos_token_ids == (2, 7) and got.info.max_context == want.info.max_context
    assert isinstance(got.state, SafetensorsState)
    for name in got.state:
        assert torch.equal(got.state[name], want.state[name]), name
    # The same forward, whichever way the weights came.
    a = load_llama(hf, torch.float32, "cpu", prepack=False)
    b = LlamaLM(got.shape, got.state, got.inv_freq, got.attention_scaling, got.info, torch.float32, prepack=False)
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    layout = BatchLayout([0], [0], 10)
    assert torch.equal(a.forward(ids, a.new_cache(1, 16), layout), b.forward(ids, b.new_cache(1, 16), layout))


def test_each_rank_reads_exactly_its_shard_from_a_sharded_checkpoint(tmp_path) -> None:
    hf, path = _saved(tmp_path, "llama-bias", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()  # several files, through the index
    full = read_llama(hf)
    lazy = open_llama_checkpoint(str(path))
    for rank in range(2):
        want, want_shape = shard_llama_state(full.state, full.shape, rank, 2)
        got = SafetensorsState(lazy.state.files, split_dim, rank, 2)
        assert local_shape(lazy.shape, 2) == want_shape
        for name in got:
            assert torch.equal(got[name], want[name]), name
        q = "model.layers.0.self_attn.q_proj.weight"
        assert got[q].shape[0] == got.shape_of(q)[0] // 2  # half the rows, not a view of all of them


def test_sharded_forward_from_the_files_matches_the_full_model(tmp_path) -> None:
    hf, path = _saved(tmp_path, "qwen2")
    lazy = open_llama_checkpoint(str(path))
    shards = [(SafetensorsState(lazy.state.files, split_dim, r, 2), local_shape(lazy.shape, 2)) for r in range(2)]
    assert_sharded_forward_matches(load_llama(hf, torch.float32, "cpu", prepack=False), lazy, shards)


def test_without_safetensors_files_transformers_loads_it(tmp_path) -> None:
    from safetensors.torch import load_file

    _, path = _saved(tmp_path, "mistral")
    weights = path / "model.safetensors"
    torch.save(load_file(weights), path / "pytorch_model.bin")  # an older checkpoint format
    weights.unlink()
    assert open_llama_checkpoint(str(path)) is None
    assert open_llama_checkpoint(str(tmp_path / "no-such-model")) is None


def test_unsupported_architecture_and_bad_splits_are_refused(tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2))
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="no own forward for model_type 'gpt2'"):
        open_llama_checkpoint(str(tmp_path / "gpt2"))
    _, path = _saved(tmp_path, "llama-bias")
    files = open_llama_checkpoint(str(path)).state.files
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        SafetensorsState(files, split_dim, 0, 3)["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="outside a world"):
        SafetensorsState(files, split_dim, 2, 2)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_plain_config_reads_what_autoconfig_reads(tmp_path, monkeypatch, model_type: str) -> None:
    """config.json read without transformers (a second of cold start) gives the same shape, model
    info and RoPE frequencies as transformers' AutoConfig and GenerationConfig."""
    from specd.services.engine import llama
    from tests.tiny_models import random_hf_model

    extra = {"sliding_window": 64} if model_type == "mistral" else {}
    hf = random_hf_model(model_type, num_key_value_heads=2, **extra)
    hf.generation_config.eos_token_id = [5, 7]
    hf.save_pretrained(tmp_path)
    assert llama.plain_config(tmp_path) is not None
    plain = llama.open_llama_checkpoint(str(tmp_path))
    monkeypatch.setattr(llama, "plain_config", lambda directory: None)
    auto = llama.open_llama_checkpoint(str(tmp_path))
    assert plain.shape == auto.shape and plain.info == auto.info
    assert torch.equal(plain.inv_freq, auto.inv_freq) and plain.attention_scaling == auto.attention_scaling
    assert plain.info.eos_token_ids[:2] == (5, 7)
