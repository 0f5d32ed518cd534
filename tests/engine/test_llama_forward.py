"""The own Llama-family forward against transformers' logits (fp32, max abs error < 1e-4)."""

from __future__ import annotations

import pytest
import torch

from specd.services.engine.llama import load_llama, onednn_bf16_prepack_supported
from specd.services.engine.model import BatchLayout, HFCausalLM, VocabMismatchError, check_same_vocab, load_model
from tests.tiny_models import random_hf_model

CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {"sliding_window": None}),
]


@pytest.mark.parametrize(("model_type", "overrides"), CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(CASES)])
def test_forward_matches_transformers(model_type: str, overrides: dict) -> None:
    hf = random_hf_model(model_type, **overrides)
    ours = load_llama(hf, torch.float32, "cpu", prepack=False)
    cache = ours.new_cache(3, 128)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 300, (1, 40), generator=g)
    b = torch.randint(0, 300, (1, 26), generator=g)
    with torch.no_grad():
        ref_a, ref_b = hf(a).logits, hf(b).logits
    sa, sb = cache.allocate(), cache.allocate()
    # Prefill in pieces, then a batched multi-token step with rows at different offsets.
    pa = ours.forward(a[:, :30], cache, BatchLayout([sa], [0], 30))
    ours.forward(b[:, :20], cache, BatchLayout([sb], [0], 20), "none")
    both = ours.forward(torch.cat([a[:, 30:35], b[:, 20:25]]), cache, BatchLayout([sa, sb], [30, 20], 5))
    # Rows in non-contiguous, reversed slot order.
    last = ours.forward(torch.cat([b[:, 25:26], a[:, 35:36]]), cache, BatchLayout([sb, sa], [25, 35], 1))
    assert (pa - ref_a[:, :30]).abs().max() < 1e-4
    assert (both[0] - ref_a[0, 30:35]).abs().max() < 1e-4
    assert (both[1] - ref_b[0, 20:25]).abs().max() < 1e-4
    assert (last[1, 0] - ref_a[0, 35]).abs().max() < 1e-4
    assert (last[0, 0] - ref_b[0, 25]).abs().max() < 1e-4


def test_rollback_overwrites_rejected_positions() -> None:
    """Writing new tokens over stale cache positions gives the same logits as a clean run."""
    hf = random_hf_model("llama")
    ours = load_llama(hf, torch.float32, "cpu", prepack=False)
    cache = ours.new_cache(1, 64)
    s = cache.allocate()
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(2))
    junk = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    ours.forward(ids[:, :10], cache, BatchLayout([s], [0], 10), "none")
    ours.forward(junk, cache, BatchLayout([s], [10], 6), "none")  # a block that gets rejected
    out = ours.forward(ids[:, 10:20], cache, BatchLayout([s], [10], 10))  # resume at position 10
    with torch.no_grad():
        ref = hf(ids).logits[:, 10:20]
    assert (out - ref).abs().max() < 1e-4


@pytest.mark.parametrize("prepack", [None, True])
def test_bf16_forward_is_close(prepack: bool | None) -> None:
    """The default bf16 path (our kernels, or oneDNN's packing where they do not build) and the explicit
    oneDNN one, where the CPU can pack bf16."""
    if prepack and not onednn_bf16_prepack_supported():
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU (AVX2 only)")
    hf = random_hf_model("llama")
    ours = load_llama(hf, torch.bfloat16, "cpu", prepack=prepack)
    assert ours.prepacked == bool(prepack) or ours.kernel_name == "onednn-prepacked"
    cache = ours.new_cache(1, 64)
    s = cache.allocate()
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(4))
    out = ours.forward(ids, cache, BatchLayout([s], [0], 16))
    with torch.no_grad():
        ref = hf(ids).logits
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 5e-2  # bf16 moves logits by up to ~4e-2 (calibration notes)


def test_load_by_path_and_fallback_backend(tiny_pair) -> None:
    target_dir, _ = tiny_pair
    own = load_model(str(target_dir), torch.float32)
    fallback = load_model(str(target_dir), torch.float32, backend="transformers")
    assert own.info.backend == "specd-llama" and isinstance(fallback, HFCausalLM)
    assert own.info.eos_token_ids == (2, 0)
    ids = torch.randint(3, own.info.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    c1, c2 = own.new_cache(1, 64), fallback.new_cache(1, 64)
    s1, s2 = c1.allocate(), c2.allocate()
    a = own.forward(ids, c1, BatchLayout([s1], [0], 12))
    fallback.forward(ids[:, :8], c2, BatchLayout([s2], [0], 8), "none")
    fallback.forward(ids[:, :3], c2, BatchLayout([s2], [8], 3), "none")  # rejected block
    b = fallback.forward(ids[:, 8:], c2, BatchLayout([s2], [8], 4))  # rollback crops the DynamicCache
    assert (a[:, 8:] - b).abs().max() < 1e-4


def test_vocab_mismatch_is_refused() -> None:
    hf_a, hf_b = random_hf_model("llama"), random_hf_model("llama", vocab_size=301)
    a = load_llama(hf_a, torch.float32, "cpu", prepack=False)
    b = load_llama(hf_b, torch.float32, "cpu", prepack=False)
    with pytest.raises(VocabMismatchError, match="differs from the target"):
        check_same_vocab(a.info, b.info)


def test_reading_out_of_order_slots_copies_only_the_attended_prefix() -> None:
    """Slots out of order (requests that joined a running batch) are gathered; the gather must see
    only the S positions attended, not each slot's whole cache (it did, and halved throughput at 16
    streams). Checked structurally, through the ops the read runs, not with a timer."""
    from torch.overrides import TorchFunctionMode

    class Gathers(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.inputs: list[tuple[int, ...]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.index_select, torch.Tensor.index_select):
                self.inputs.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    cache = torch.randn(4, 512, 2, 8)  # [slots, L, Hkv, D]
    layout = BatchLayout([3, 1], [20, 9], 4)
    with Gathers() as g:
        out = layout.read(cache)
    assert layout.S == 24 and out.shape == (2, 24, 2, 8)
    assert torch.equal(out[0], cache[3, :24]) and torch.equal(out[1], cache[1, :24])
    assert g.inputs and all(shape[1] == layout.S for shape in g.inputs)
