"""The AVX2 bf16 linear kernel (services/engine/kernels): accurate, and batch invariant (each row's
result is bit-identical whatever else is in the batch), which exact speculation relies on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specd.services.engine.kernels import _cpu_has_avx2_fma, bf16_linear

pytestmark = pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="needs an x86 CPU with AVX2 and FMA")


@pytest.fixture(scope="module")
def op():
    kernel = bf16_linear()
    assert kernel is not None, "the kernel failed to build on a CPU that has AVX2"
    return kernel


@pytest.mark.parametrize(("n", "k"), [(96, 64), (37, 50), (300, 1536), (64, 8960 // 8)])
def test_matches_a_float32_reference(op, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(5, k, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    for bias in (b, None):
        got = op(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (5, n)
        want = ref if bias is not None else F.linear(x.float(), w.float())
        # fp32 accumulation, one bf16 rounding of the result: within bf16's relative precision
        assert (got.float() - want).abs().max() <= 2**-7 * want.abs().max() + 1e-3


def test_rows_are_bit_identical_whatever_the_batch(op) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 136, generator=g).bfloat16()  # 136 = 8 * 16 + 8: exercises the scalar tail
    b = torch.randn(200, generator=g).bfloat16()
    x = torch.randn(40, 136, generator=g).bfloat16()
    whole = op(x, w, b)
    for m in (1, 2, 6, 7, 8, 13, 39):
        assert torch.equal(op(x[:m], w, b), whole[:m])
    assert torch.equal(op(x[17:18], w, b), whole[17:18])  # a row alone equals it inside a block
    shuffled = torch.randperm(40, generator=g)
    assert torch.equal(op(x[shuffled], w, b), whole[shuffled])


def test_leading_dimensions_and_float32_inputs(op) -> None:
    w = torch.randn(24, 32).bfloat16()
    x = torch.randn(2, 3, 32).bfloat16()
    y = op(x, w, None)
    assert y.shape == (2, 3, 24)
    assert torch.equal(y.reshape(6, 24), op(x.reshape(6, 32), w, None))
    assert op(x.float(), w, None).dtype == torch.float32


def test_the_bf16_model_uses_it_where_onednn_cannot_pack() -> None:
    from specd.services.engine.llama import load_llama, onednn_bf16_prepack_supported
    from tests.tiny_models import random_hf_model

    ours = load_llama(random_hf_model("llama"), torch.bfloat16, "cpu", prepack=None)
    expected = "onednn-prepacked" if onednn_bf16_prepack_supported() else "specd-avx2-bf16"
    assert ours.kernel_name == expected


def test_int8_matches_its_dequantized_weights_and_is_batch_invariant() -> None:
    from specd.services.engine.kernels import int8_linear
    from specd.services.engine.llama import quantize_int8

    op = int8_linear()
    assert op is not None
    g = torch.Generator().manual_seed(3)
    w = torch.randn(150, 136, generator=g).bfloat16()
    b = torch.randn(150, generator=g).bfloat16()
    x = torch.randn(20, 136, generator=g).bfloat16()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (150,)
    assert ((q.float() * scale[:, None]) - w.float()).abs().max() <= scale.max() / 2 + 1e-6
    got = op(x, q, scale, b)
    want = F.linear(x.float(), q.float() * scale[:, None], b.float())
    assert (got.float() - want).abs().max() <= 2**-7 * want.abs().max() + 1e-3
    for m in (1, 4, 7, 11):
        assert torch.equal(op(x[:m], q, scale, b), got[:m])


def test_an_int8_draft_leaves_greedy_output_identical(demo_pair) -> None:
    """Exactness depends only on the target: the int8 draft changes guesses, never the output
    (float32 target, where greedy identity is exact; in bf16 attention over k+1 queries may round
    differently from one query, so bf16 identity is measured by the benchmark, not asserted)."""
    from specd.services.engine.builder import ModelSpec, build_engine
    from specd.services.engine.chat import encode_text
    from specd.services.engine.engine import EngineConfig, Request, SpecConfig
    from specd.services.engine.sampling import SamplingParams

    target, draft = demo_pair
    engine = build_engine(
        ModelSpec(str(target), str(draft), "float32", "float32", draft_quantize="int8"),
        EngineConfig(max_batch_size=4, max_model_len=256),
    )
    assert engine.model_drafter.model.kernel_name == "specd-avx2-int8"
    prompts = [tuple(encode_text(engine.tokenizer, p)) for p in ("def f(x):\n", "import os\n", "class A:\n")]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=7)
    for params in (greedy, seeded):
        ref = engine.generate([Request(f"n{i}", p, params, SpecConfig("none", 0)) for i, p in enumerate(prompts)])
        for k in (2, 4):
            got = engine.generate(
                [Request(f"d{k}{i}", p, params, SpecConfig("draft", k)) for i, p in enumerate(prompts)]
            )
            accepted = sum(got[f"d{k}{i}"].stats.accepted_tokens for i in range(len(prompts)))
            assert accepted > 0
            if params is greedy:  # sampled: same law, not the same draws (the sampling-law tests cover it)
                assert [got[f"d{k}{i}"].token_ids for i in range(3)] == [ref[f"n{i}"].token_ids for i in range(3)]


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the int4 kernel multiplies by: each row in groups of 32, rounded to int8 steps of max|x| / 127."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return ((g * inv).round().clamp(-127, 127) * (amax / 127)).view(x.shape)


def test_int4_matches_its_dequantized_weights_and_is_batch_invariant() -> None:
    from specd.services.engine.kernels import int4_linear
    from specd.services.engine.llama import dequantize_int4, quantize_int4

    op = int4_linear()
    assert op is not None
    g = torch.Generator().manual_seed(4)
    w = torch.randn(150, 160, generator=g).bfloat16()  # 160 = 5 groups: the min term's scalar tail runs
    b = torch.randn(150, generator=g).bfloat16()
    x = torch.randn(20, 160, generator=g).float()
    (packed,) = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (150, 80 + 20)
    deq = dequantize_int4(packed)
    groups = w.float().view(150, 5, 32)
    step = (groups.amax(dim=2) - groups.amin(dim=2)) / 15
    # Each weight within half a quantization step (plus fp16 rounding of scale and min) of its value.
    assert ((deq - w.float()).view(150, 5, 32).abs() <= step[..., None] * 0.51 + 2e-3).all()
    got = op(x, packed, b)
    want = F.linear(_quantized_activations(x).double(), deq.double(), b.double())
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for m in (1, 3, 8, 9, 13):
        assert torch.equal(op(x[:m], packed, b), got[:m])
    shuffled = torch.randperm(20, generator=g)
    assert torch.equal(op(x[shuffled], packed, b), got[shuffled])
    assert torch.equal(op(x.view(4, 5, 160), packed, None).view(20, 150), op(x, packed, None))


def test_int4_rejects_a_width_that_is_not_whole_groups() -> None:
    from specd.services.engine.llama import quantize_int4

    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(8, 48))
