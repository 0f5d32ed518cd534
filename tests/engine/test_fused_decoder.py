"""The fused CPU decoder (``services/engine/kernels/decoder.cpp``): the whole forward in one call.

It must compute the same model as the per-op forward (closer to the float32 model than the per-op
bf16 path, since its activations stay in float32), and it must be batch invariant end to end: a
row's logits depend only on its own tokens, never on what else shares the pass. The engine-level
consequence is tested last: bf16 greedy speculation is token-identical to the same bf16 target
decoding alone, which the per-op path (bf16 attention over k + 1 rows) does not guarantee.
"""

from __future__ import annotations

import pytest
import torch

from specd.services.engine.kernels import fused_decoder_class
from specd.services.engine.llama import load_llama
from specd.services.engine.model import BatchLayout
from tests.tiny_models import random_hf_model

pytestmark = pytest.mark.skipif(fused_decoder_class() is None, reason="the AVX2 kernels are unavailable here")

CASES = [
    ("llama", {"num_key_value_heads": 2}),  # grouped-query attention, two query heads per KV head
    ("qwen2", {"num_key_value_heads": 1}),  # q/k/v biases, all query heads on one KV head
    ("llama", {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
]
IDS = [f"{t}-{i}" for i, (t, _) in enumerate(CASES)]


def _model(model_type: str, overrides: dict, dtype: torch.dtype, quantize: str | None = None, fused: bool = True):
    # head_dim 16 (the fused path needs a multiple of 16); bf16-representable weights, so the float32
    # model is the exact reference the bf16 ones approximate.
    hf = random_hf_model(model_type, hidden_size=64, num_attention_heads=4, intermediate_size=96, **overrides)
    hf = hf.to(torch.bfloat16).to(torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECD_FUSED", "1" if fused else "0")
        return load_llama(hf, dtype, "cpu", prepack=False, quantize=quantize)


def _run(model, prompts: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Prefill two rows at different lengths in a paged cache, then one multi-token pass over both."""
    cache = model.new_paged_cache(4, 64, 8, 128)
    cache.reserve(1, 96), cache.reserve(3, 96)  # non-adjacent slots, blocks interleaved between them
    model.forward(prompts[:1, :30], cache, cache.layout([1], [0], 30), "none")
    model.forward(prompts[1:, :21], cache, cache.layout([3], [0], 21), "none")
    return model.forward(steps, cache, cache.layout([1, 3], [30, 21], steps.shape[1]), "all")


@pytest.mark.parametrize(("model_type", "overrides"), CASES, ids=IDS)
def test_fused_is_the_same_model_closer_to_float32(model_type: str, overrides: dict) -> None:
    fused = _model(model_type, overrides, torch.bfloat16)
    per_op = _model(model_type, overrides, torch.bfloat16, fused=False)
    exact = _model(model_type, overrides, torch.float32)
    assert fused.forward_path == "fused" and per_op.forward_path == "per-op" and exact.forward_path == "per-op"
    g = torch.Generator().manual_seed(0)
    prompts, steps = torch.randint(0, 300, (2, 30), generator=g), torch.randint(0, 300, (2, 5), generator=g)
    ref = _run(exact, prompts, steps)
    err_fused = (_run(fused, prompts, steps) - ref).abs().max().item()
    err_per_op = (_run(per_op, prompts, steps) - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err_fused < 0.02 * scale  # bf16 weights, float32 activations: small against the logits
    assert err_fused <= err_per_op  # and no further from the float32 model than the per-op bf16 path


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_fused_forward_is_batch_invariant(quantize: str | None) -> None:
    """Verifying tokens in a pass with other rows gives, bit for bit, the logits of decoding each alone."""
    model = _model("qwen2", {"num_key_value_heads": 2}, torch.bfloat16, quantize=quantize)
    assert model.forward_path == "fused"
    g = torch.Generator().manual_seed(1)
    prompts, steps = torch.randint(0, 300, (2, 30), generator=g), torch.randint(0, 300, (2, 5), generator=g)
    batched = _run(model, prompts, steps)
    for row, (slot, length) in enumerate(((1, 30), (3, 21))):
        cache = model.new_paged_cache(4, 64, 8, 128)
        cache.reserve(slot, 96)
        model.forward(prompts[row : row + 1, :length], cache, cache.layout([slot], [0], length), "none")
        for t in range(steps.shape[1]):
            one = model.forward(steps[row : row + 1, t : t + 1], cache, cache.layout([slot], [length + t], 1), "all")
            assert torch.equal(one[0, 0], batched[row, t])


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_rows_of_different_lengths_are_packed_bit_for_bit(quantize: str | None) -> None:
    """A pass whose rows hold different numbers of tokens (``BatchLayout.lengths``: a prefill of
    prompts of several lengths, a round whose rows verify different numbers of guesses) computes
    only those tokens, and each row's logits are bit for bit the padded pass's at its own tokens,
    zeros past them; ``"last"`` takes each row's last real token."""
    model = _model("qwen2", {"num_key_value_heads": 2}, torch.bfloat16, quantize=quantize)
    assert model.skips_padding
    g = torch.Generator().manual_seed(5)
    prompts, steps = torch.randint(0, 300, (3, 40), generator=g), torch.randint(0, 300, (3, 5), generator=g)
    slots, prompt_lengths, step_lengths = [0, 2, 3], [40, 7, 33], [5, 1, 3]  # across 32-row attention chunks

    def run(packed: bool, logits_for: str) -> tuple[torch.Tensor, torch.Tensor]:
        cache = model.new_paged_cache(4, 64, 8, 128)
        for slot in slots:
            cache.reserve(slot, 96)
        lengths = prompt_lengths if packed else None
        prefill = model.forward(prompts, cache, cache.layout(slots, [0, 0, 0], 40, lengths=lengths), "all")
        lengths = step_lengths if packed else None
        out = model.forward(steps, cache, cache.layout(slots, prompt_lengths, 5, lengths=lengths), logits_for)
        return prefill, out

    padded_prefill, padded = run(False, "all")
    packed_prefill, packed = run(True, "all")
    for row, (n_prompt, n_step) in enumerate(zip(prompt_lengths, step_lengths)):
        assert torch.equal(packed_prefill[row, :n_prompt], padded_prefill[row, :n_prompt])
        assert torch.equal(packed[row, :n_step], padded[row, :n_step])
        assert not packed_prefill[row, n_prompt:].any() and not packed[row, n_step:].any()
    _, last = run(True, "last")
    assert last.shape == (3, 1, 300)
    for row, n_step in enumerate(step_lengths):
        assert torch.equal(last[row, 0], padded[row, n_step - 1])
    cache = model.new_paged_cache(4, 64, 8, 128)
    cache.reserve(0, 96)
    with pytest.raises(RuntimeError, match="holds 0 tokens"):
        model.forward(steps[:1], cache, cache.layout([0], [0], 5, lengths=[0]), "all")


# (query heads, KV heads, head size): every way attention's output accumulators are laid out
# (decoder.cpp, FusedDecoder::weigh: heads per KV head 1-8 and past 8, 1-8 vectors of a head per
# pass), the demo models' (G 1, D 64 and 32) and the real pair's G (6 and 7) among them.
ATTENTION_SHAPES = [(2, 2, 64), (4, 4, 32), (4, 4, 48), (6, 2, 16), (6, 1, 32), (7, 1, 16), (10, 2, 16), (9, 1, 16)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ATTENTION_SHAPES)
def test_attention_of_every_head_layout_is_the_model_s_and_batch_invariant(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """The fused attention against the float32 per-op model (a bf16 model's distance), and a row
    verified in a batch against the same row decoded alone (bit for bit), for each layout of its
    register accumulators."""
    overrides = dict(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    hf = random_hf_model("qwen2", intermediate_size=96, **overrides).to(torch.bfloat16).to(torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECD_FUSED", "1")
        fused = load_llama(hf, torch.bfloat16, "cpu", prepack=False)
    exact = load_llama(hf, torch.float32, "cpu", prepack=False)
    assert fused.forward_path == "fused"
    g = torch.Generator().manual_seed(4)
    prompts, steps = torch.randint(0, 300, (2, 30), generator=g), torch.randint(0, 300, (2, 5), generator=g)
    ref, got = _run(exact, prompts, steps), _run(fused, prompts, steps)
    assert (got - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    cache = fused.new_paged_cache(4, 64, 8, 128)
    cache.reserve(3, 96)
    fused.forward(prompts[1:, :21], cache, cache.layout([3], [0], 21), "none")
    for t in range(steps.shape[1]):
        one = fused.forward(steps[1:, t : t + 1], cache, cache.layout([3], [21 + t], 1), "all")
        assert torch.equal(one[0, 0], got[1, t])


def test_static_slot_cache_and_last_logits() -> None:
    """The static cache (one block per slot) and ``logits_for="last"`` agree with the paged pool."""
    model = _model("llama", {"num_key_value_heads": 2}, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    prompts, steps = torch.randint(0, 300, (2, 30), generator=g), torch.randint(0, 300, (2, 5), generator=g)
    paged = _run(model, prompts, steps)
    cache = model.new_cache(3, 128)
    model.forward(prompts[:1, :30], cache, BatchLayout([2], [0], 30), "none")
    model.forward(prompts[1:, :21], cache, BatchLayout([0], [0], 21), "none")
    last = model.forward(steps, cache, BatchLayout([2, 0], [30, 21], 5), "last")
    assert last.shape == (2, 1, 300) and torch.equal(last[:, 0], paged[:, -1])


def test_out_of_vocabulary_ids_are_refused_not_read() -> None:
    model = _model("llama", {}, torch.bfloat16)
    cache = model.new_paged_cache(2, 8, 8, 64)
    cache.reserve(0, 8)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        model.forward(torch.tensor([[5, 300]]), cache, cache.layout([0], [0], 2), "all")


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_bf16_greedy_speculation_is_token_identical_to_the_target_alone(tiny_pair, quantize: str | None) -> None:
    from specd.services.engine.builder import ModelSpec, build_engine
    from specd.services.engine.chat import encode_text
    from specd.services.engine.engine import EngineConfig, Request, SpecConfig
    from specd.services.engine.sampling import SamplingParams

    target, draft = tiny_pair
    engine = build_engine(
        ModelSpec(str(target), str(draft), "bfloat16", "bfloat16", target_quantize=quantize),
        EngineConfig(max_batch_size=4, max_model_len=256),
    )
    assert engine.target.forward_path == "fused"
    prompts = [tuple(encode_text(engine.tokenizer, p)) for p in ("def f(x):\n", "import os\n", "class A:\n")]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = engine.generate([Request(f"n{i}", p, params, SpecConfig("none", 0)) for i, p in enumerate(prompts)])
    for method, k in (("draft", 2), ("draft", 4), ("ngram", 3), ("auto", 4)):
        got = engine.generate(
            [Request(f"{method}{i}", p, params, SpecConfig(method, k)) for i, p in enumerate(prompts)]
        )
        for i in range(len(prompts)):
            assert got[f"{method}{i}"].token_ids == alone[f"n{i}"].token_ids, (method, k, i)
    assert engine.active_slots == 0


def test_prefill_in_one_pass_or_token_by_token_is_the_same() -> None:
    """Chunked prefill sizes its passes by load, so a prompt's cache must not depend on them: 70
    tokens in one pass (three 32-row attention chunks), in pieces, or one at a time give bit for bit
    the same logits at every position."""
    model = _model("qwen2", {"num_key_value_heads": 2}, torch.bfloat16, quantize="int4")
    ids = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(3))
    outs = []
    for pieces in ((70,), (7, 33, 30), (1,) * 70):
        cache = model.new_paged_cache(2, 16, 8, 128)
        cache.reserve(0, 72)
        start, logits = 0, []
        for n in pieces:
            logits.append(model.forward(ids[:, start : start + n], cache, cache.layout([0], [start], n), "all"))
            start += n
        outs.append(torch.cat(logits, dim=1))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
