"""The AVX2 linear kernels (services/engine/kernels): accurate, and batch invariant (each row's
result is bit-identical whatever else is in the batch), which exact speculation relies on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specd.services.engine.kernels import (
    _cpu_has_avx2_fma,
    _cpu_has_avx512,
    _cpu_has_avx512_vnni,
    bf16_linear,
    kernel_tuning,
)

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


@pytest.mark.parametrize(("n", "k"), [(203, 136), (300, 1536)])
def test_rows_are_bit_identical_whatever_the_batch(op, n: int, k: int) -> None:
    """Decoding's blocks (up to 7 rows) and a prefill's (8 rows and more, 20 where K < 1024:
    block_halves, 3 rows against 4 weight rows, the rest in decoding's blocks) give every row the
    same bits. 136 = 8 * 16 + 8 exercises the scalar tail; 203 weight rows, and 1536's tiles of
    84 rows split over the threads, leave weight rows that block_halves hands to the one-row block.
    float32 activations (as the fused forward passes them), so that the result is compared in
    every bit, not after a rounding to bf16. On a CPU with AVX-512 the blocks run in 512-bit
    registers instead; the next test compares those with the AVX2 ones."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(40, k, generator=g)
    whole = op(x, w, b)
    for m in (1, 2, 6, 7, 8, 9, 13, 39):
        assert torch.equal(op(x[:m], w, b), whole[:m])
    assert torch.equal(op(x[17:18], w, b), whole[17:18])  # a row alone equals it inside a block
    shuffled = torch.randperm(40, generator=g)
    assert torch.equal(op(x[shuffled], w, b), whole[shuffled])


_AVX2_RUN = """
import sys, torch
from specd.services.engine import kernels
op = getattr(kernels, sys.argv[1])()
weights, xs = torch.load(sys.argv[2])
torch.save([op(x, *weights) for x in xs], sys.argv[3])
"""


def _on_avx2(op_name: str, weights: tuple, xs: list[torch.Tensor], tmp_path: Path) -> list[torch.Tensor]:
    """``kernels.<op_name>()(x, *weights)`` for each x, in a process of its own with SPECD_AVX512=0
    (the choice of blocks is made once per process), so on the AVX2 blocks."""
    torch.save((weights, xs), tmp_path / "in.pt")
    env = {**os.environ, "SPECD_AVX512": "0"}
    script = [sys.executable, "-c", _AVX2_RUN, op_name, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]
    subprocess.run(script, env=env, check=True)
    return torch.load(tmp_path / "out.pt")


def _bf16_dot_in_use() -> bool:
    tuning = kernel_tuning()  # None without the kernels (no AVX2 here, say)
    return tuning is not None and tuning.bf16_dot


@pytest.mark.skipif(not _cpu_has_avx512(), reason="no AVX-512 here: only the AVX2 blocks run")
@pytest.mark.skipif(os.environ.get("SPECD_AVX512") == "0", reason="SPECD_AVX512=0: both sides would run AVX2")
@pytest.mark.skipif(
    _bf16_dot_in_use(), reason="bf16 layers take the dot products here; test_bf16_dot.py runs it with SPECD_BF16_DOT=0"
)
@pytest.mark.parametrize(("n", "k"), [(203, 136), (300, 1536)])
def test_avx512_blocks_give_the_avx2_blocks_bits(op, tmp_path: Path, n: int, k: int) -> None:
    """The 512-bit blocks (decoding's 1-7 rows, prefill's 4 x 4) against the AVX2 ones (block, and
    block_halves from 8 rows, 20 where K < 1024), bit for bit. 203 weight rows leave odd rows for
    the one-row blocks; 136 exercises the scalar tail."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    xs = [torch.randn(m, k, generator=g) for m in (1, 2, 3, 5, 7, 8, 13, 20, 41)]
    for x, want in zip(xs, _on_avx2("bf16_linear", (w, b), xs, tmp_path)):
        assert torch.equal(op(x, w, b), want), f"{x.shape[0]} rows"


@pytest.mark.skipif(not _cpu_has_avx512_vnni(), reason="no AVX-512 VNNI here: only the AVX2 int4 blocks run")
@pytest.mark.skipif(os.environ.get("SPECD_AVX512") == "0", reason="SPECD_AVX512=0: both sides would run AVX2")
@pytest.mark.parametrize("k", [256, 608, 1536])
def test_avx512_int4_blocks_give_the_avx2_blocks_bits(tmp_path: Path, k: int) -> None:
    """The int4 blocks in 512-bit registers (q4_block_avx512) against the AVX2 ones, bit for bit, 1-8
    rows and more (37 weight rows). 608 (two whole super-blocks and a short one) keeps the AVX2
    blocks; 256 and 1536 (one and six) do not."""
    from specd.services.engine.kernels import int4_linear
    from specd.services.engine.llama import quantize_int4

    op = int4_linear()
    g = torch.Generator().manual_seed(6)
    (packed,) = quantize_int4(torch.randn(37, k, generator=g).bfloat16())
    b = torch.randn(37, generator=g).bfloat16()
    xs = [torch.randn(m, k, generator=g) * 3 for m in (1, 2, 3, 5, 8, 9, 17)]
    for x, want in zip(xs, _on_avx2("int4_linear", (packed, b), xs, tmp_path)):
        assert torch.equal(op(x, packed, b), want), f"{x.shape[0]} rows"


@pytest.mark.skipif(not _cpu_has_avx512_vnni(), reason="no AVX-512 VNNI here: only the AVX2 int8 blocks run")
@pytest.mark.skipif(os.environ.get("SPECD_AVX512") == "0", reason="SPECD_AVX512=0: both sides would run AVX2")
@pytest.mark.parametrize("k", [128, 136, 160, 896])
def test_avx512_int8_blocks_give_the_avx2_blocks_bits(tmp_path: Path, k: int) -> None:
    """The int8 blocks in 512-bit registers (q8_block_avx512) against the AVX2 ones, bit for bit, 1-8
    rows and more (37 weight rows). 160 ends a super-block in an odd 32-byte step, 136 in a scalar
    tail, 896 (the 0.5B draft's hidden size) in a short super-block."""
    from specd.services.engine.kernels import int8_linear
    from specd.services.engine.llama import quantize_int8

    op = int8_linear()
    g = torch.Generator().manual_seed(7)
    q, scale = quantize_int8(torch.randn(37, k, generator=g).bfloat16())
    b = torch.randn(37, generator=g).bfloat16()
    xs = [torch.randn(m, k, generator=g) * 3 for m in (1, 2, 3, 5, 8, 9, 17)]
    for x, want in zip(xs, _on_avx2("int8_linear", (q, scale, b), xs, tmp_path)):
        assert torch.equal(op(x, q, scale, b), want), f"{x.shape[0]} rows"


def _vnni_int8_op():
    from specd.services.engine.kernels import ensure_built

    usable = ensure_built() and _cpu_has_avx512_vnni() and os.environ.get("SPECD_AVX512") != "0"
    return torch.ops.specd_kernels.int8_vnni_linear if usable else None


@pytest.mark.skipif(_vnni_int8_op() is None, reason="no AVX-512 VNNI here (or SPECD_AVX512=0)")
@pytest.mark.parametrize(("n", "k"), [(64, 128), (48, 160), (32, 896)])
def test_int8_packed_for_vnni_is_exact_per_super_block_and_batch_invariant(n: int, k: int) -> None:
    """The int8 layers the fused decoder packs for VNNI: within 1e-6 of an fp64 product of the
    int8 weights and the int8-rounded activations (each super-block's integer sum is exact; the
    unpacked blocks, eight float lanes a super-block, are held to 1e-5), and each row's bits the
    same alone, in any batch, across the 8-row blocks (37 rows) and in any order. 160 ends in half a
    super-block, 896 (the 0.5B draft's hidden size) in a short one."""
    from specd.services.engine.kernels import int8_linear
    from specd.services.engine.llama import quantize_int8

    op = _vnni_int8_op()
    g = torch.Generator().manual_seed(n + k)
    q, scale = quantize_int8(torch.randn(n, k, generator=g).bfloat16())
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(37, k, generator=g) * 3
    got = op(x, q, scale, b)
    want = F.linear(_quantized_activations(x).double(), q.double() * scale.double()[:, None], b.double())
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    assert (int8_linear()(x, q, scale, b) - got).abs().max() <= 1e-5 * want.abs().max()
    for m in (1, 2, 7, 8, 9, 16):
        assert torch.equal(op(x[:m], q, scale, b), got[:m]), f"{m} rows"
    assert torch.equal(op(x[5:6], q, scale, b), got[5:6])
    shuffled = torch.randperm(37, generator=g)
    assert torch.equal(op(x[shuffled], q, scale, b), got[shuffled])


def _amx_op():
    from specd.services.engine.kernels import amx_usable

    return torch.ops.specd_kernels.amx_bf16_linear if amx_usable() else None


@pytest.mark.skipif(_amx_op() is None, reason="no AMX tile unit here (or SPECD_AMX=0)")
@pytest.mark.parametrize(("n", "k"), [(64, 96), (1376, 512), (96, 1536)])
def test_amx_tiles_keep_16_bits_of_x_and_are_batch_invariant(n: int, k: int) -> None:
    """The AMX kernel (x split into two bf16 terms): every output within 1e-5 of the sum of its terms'
    sizes of an fp64 reference (about 1e-6 measured; fp32 accumulation of fp32 x gives ~5e-8, x taken
    as bf16 alone ~1e-3, which this catches), and each row's bits the
    same alone, in any batch, across the 16-row tiles (37 rows: two whole tiles and 5 rows), and in
    any order."""
    op = _amx_op()
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    x = torch.randn(37, k, generator=g) * 3
    whole = op(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    scale = x.double().abs() @ w.double().abs().T
    assert float(((whole.double() - ref).abs() / scale).max()) < 1e-5
    for m in (1, 2, 5, 16, 17, 33):
        assert torch.equal(op(x[:m], w, b), whole[:m]), f"{m} rows"
    assert torch.equal(op(x[20:21], w, b), whole[20:21])
    shuffled = torch.randperm(37, generator=g)
    assert torch.equal(op(x[shuffled], w, b), whole[shuffled])
    assert torch.equal(op(x, w, None) + b, whole)  # the bias is added last, as the vector blocks add it


def test_amx_is_used_where_the_cpu_has_it() -> None:
    """A CPU that lists the tile unit runs bf16 layers on it unless SPECD_AMX=0 (the kernel's own
    check, CPUID and Linux's permission, must agree with /proc/cpuinfo here, or the fused decoder
    would quietly lose it)."""
    from specd.services.engine.kernels import _cpu_has, amx_usable

    wanted = _cpu_has("amx_tile", "amx_bf16", "avx512bw") and os.environ.get("SPECD_AMX") != "0"
    assert amx_usable() == wanted


def test_leading_dimensions_and_float32_inputs(op) -> None:
    w = torch.randn(24, 32).bfloat16()
    x = torch.randn(2, 3, 32).bfloat16()
    y = op(x, w, None)
    assert y.shape == (2, 3, 24)
    assert torch.equal(y.reshape(6, 24), op(x.reshape(6, 32), w, None))
    assert op(x.float(), w, None).dtype == torch.float32


def test_a_bf16_model_uses_it_by_default() -> None:
    """Where the kernels build, bf16 runs on them (and the fused forward) even if oneDNN could pack."""
    from specd.services.engine.llama import load_llama
    from tests.tiny_models import random_hf_model

    ours = load_llama(random_hf_model("llama", hidden_size=64, num_attention_heads=4), torch.bfloat16, "cpu", None)
    assert ours.kernel_name == "specd-avx2-bf16" and ours.forward_path == "fused"


def test_f32_matches_float64_and_is_batch_invariant() -> None:
    from specd.services.engine.kernels import f32_linear

    op = f32_linear()
    assert op is not None
    g = torch.Generator().manual_seed(4)
    w = torch.randn(150, 136, generator=g)  # 136 = 8 * 16 + 8: the scalar tail too
    b = torch.randn(150, generator=g)
    x = torch.randn(20, 136, generator=g)
    got = op(x, w, b)
    want = F.linear(x.double(), w.double(), b.double())
    # fp32 accumulation of 136 products: a few ulps of the largest terms
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for m in (1, 2, 4, 7, 9, 16):
        assert torch.equal(op(x[:m], w, b), got[:m])
    assert torch.equal(op(x[13:14], w, b), got[13:14])


def test_a_float32_model_uses_it_for_few_rows_and_torch_for_many() -> None:
    """fp32 layers run on the kernel up to F32_KERNEL_MAX_ROWS rows (decoding and verifying) and on
    torch's matmul beyond (a prefill), where MKL's blocked GEMM is the faster."""
    from specd.services.engine.llama import F32_KERNEL_MAX_ROWS, load_llama
    from tests.tiny_models import random_hf_model

    ours = load_llama(random_hf_model("llama", hidden_size=64, num_attention_heads=4), torch.float32, "cpu", None)
    assert ours.kernel_name == "specd-avx2-f32" and ours.forward_path == "per-op"
    lin = ours.lm_head
    calls = []
    real = lin.kernel
    lin.kernel = lambda *a: calls.append(a[0].shape) or real(*a)
    few, many = torch.randn(1, F32_KERNEL_MAX_ROWS, 64), torch.randn(1, F32_KERNEL_MAX_ROWS + 1, 64)
    assert torch.equal(lin(few), real(few, lin.weight, lin.bias))
    assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))
    assert calls == [few.shape]


def test_int8_matches_its_dequantized_weights_and_is_batch_invariant() -> None:
    from specd.services.engine.kernels import int8_linear
    from specd.services.engine.llama import quantize_int8, quantize_int8_reference

    op = int8_linear()
    assert op is not None
    g = torch.Generator().manual_seed(3)
    w = torch.randn(150, 136, generator=g).bfloat16()
    b = torch.randn(150, generator=g).bfloat16()
    x = torch.randn(20, 300, generator=g)[:, :136].contiguous()  # 136: 4 groups of 32 and a scalar tail
    q, scale = quantize_int8(w)
    ref_q, ref_scale = quantize_int8_reference(w)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)  # the compiled quantizer is the reference's
    assert q.dtype == torch.int8 and scale.shape == (150,)
    assert ((q.float() * scale[:, None]) - w.float()).abs().max() <= scale.max() / 2 + 1e-6
    got = op(x, q, scale, b)
    # It multiplies in integers against activations rounded to int8 steps, one scale per 256.
    want = F.linear(_quantized_activations(x).double(), (q.float() * scale[:, None]).double(), b.double())
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got - F.linear(x, q.float() * scale[:, None], b.float())).abs().max() <= 0.02 * want.abs().max()
    for m in (1, 4, 7, 9, 11):
        assert torch.equal(op(x[:m], q, scale, b), got[:m])
    assert op(x.bfloat16(), q, scale, b).dtype == torch.bfloat16


def test_an_int8_draft_leaves_greedy_output_identical(demo_pair) -> None:
    """Exactness depends only on the target: the int8 draft changes guesses, never the output
    (a float32 target on the per-op forward; bf16 targets on the fused forward are covered in
    tests/engine/test_fused_decoder.py)."""
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
    """What the int4 kernel multiplies by: each row in super-blocks of 256 (the last may be shorter),
    rounded to int8 steps of max|x| / 127."""
    out = torch.empty_like(x, dtype=torch.float32)
    for k0 in range(0, x.shape[1], 256):
        blk = x[:, k0 : k0 + 256].float()
        amax = blk.abs().amax(dim=1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        out[:, k0 : k0 + 256] = (blk * inv).round().clamp(-127, 127) * (amax / 127)
    return out


# 160: one short super-block ending in an odd group; 256: one whole super-block; 608: two whole ones
# and a short one of three groups.
@pytest.mark.parametrize("k", [160, 256, 608])
def test_int4_matches_its_dequantized_weights_and_is_batch_invariant(k: int) -> None:
    from specd.services.engine.kernels import int4_linear
    from specd.services.engine.llama import dequantize_int4, int4_row_bytes, quantize_int4, quantize_int4_reference

    op = int4_linear()
    assert op is not None
    g = torch.Generator().manual_seed(4)
    w = torch.randn(150, k, generator=g).bfloat16()
    w[3] = w[3].abs()  # a row whose groups are all positive (their min clamps to 0, as in Q4_K)
    b = torch.randn(150, generator=g).bfloat16()
    x = torch.randn(20, k, generator=g).float()
    (packed,) = quantize_int4(w)
    assert torch.equal(packed, quantize_int4_reference(w)[0])  # the compiled quantizer is the reference's bytes
    assert packed.dtype == torch.uint8 and packed.shape == (150, int4_row_bytes(k))
    assert int4_row_bytes(k) == k // 2 + k // 16 + 4 * -(-k // 256)
    deq = dequantize_int4(packed, k)
    groups = w.float().view(150, k // 32, 32)
    lo = groups.amin(dim=2).clamp(max=0)
    step = (groups.amax(dim=2) - lo) / 15
    # Within half a step of its group, plus the 8-bit rounding of the group's scale and min against
    # the super-block's largest (at most half of 1/255 of it, times the 15 steps of the range).
    sb_max = torch.stack([step[:, i : i + 8].amax(dim=1) for i in range(0, k // 32, 8)], dim=1)
    sb_max = sb_max.repeat_interleave(8, dim=1)[:, : k // 32]
    bound = 0.5 * step + 8.5 * sb_max / 255 + (-lo).amax(dim=1, keepdim=True) / 255 + 1e-3
    assert ((deq - w.float()).view(150, k // 32, 32).abs() <= bound[..., None]).all()
    got = op(x, packed, b)
    want = F.linear(_quantized_activations(x).double(), deq.double(), b.double())
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for m in (1, 3, 8, 9, 13):
        assert torch.equal(op(x[:m], packed, b), got[:m])
    shuffled = torch.randperm(20, generator=g)
    assert torch.equal(op(x[shuffled], packed, b), got[shuffled])
    assert torch.equal(op(x.view(4, 5, k), packed, None).view(20, 150), op(x, packed, None))


def test_int4_rejects_a_width_that_is_not_whole_groups() -> None:
    from specd.services.engine.llama import quantize_int4

    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(8, 48))


def test_stream_read_reads_every_whole_line(op) -> None:
    """The bandwidth probe's read (benchmarks/bandwidth.py) visits every whole 64-byte line: it returns
    the XOR of all their 32-bit words, whatever the thread split, and leaves a partial last line out."""
    words = torch.randint(-(2**31), 2**31 - 1, ((1 << 20) + 5,), dtype=torch.int32)
    whole = words[: words.numel() // 16 * 16].numpy()
    expected = int(np.bitwise_xor.reduce(whole).astype(np.uint32))
    assert torch.ops.specd_kernels.stream_read(words) == expected
    assert torch.ops.specd_kernels.stream_read(torch.zeros(1 << 16)) == 0


@pytest.mark.skipif(_amx_op() is None, reason="no AMX tile unit here (or SPECD_AMX=0)")
@pytest.mark.parametrize(("n", "k"), [(64, 96), (8960, 1536), (1536, 8960)])
@pytest.mark.parametrize("scale", [1.0, 1e-30, 3e-38, 1e30])
def test_one_row_on_the_vector_units_gives_the_tiles_bits(n: int, k: int, scale: float) -> None:
    """One input row runs on the vector units (amx_row_span), every other batch on the tile unit:
    each row alone must give the bits it gets among 8 rows, at magnitudes where x's low bf16 term
    (or x itself) is denormal, which the tile unit reads as 0 and the vectors must too, with zeros
    and outliers in x, and bf16 weights that are themselves denormal."""
    op = _amx_op()
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g)
    w[: n // 4] *= 1e-38  # denormal bf16 weights
    w = w.bfloat16()
    b = torch.randn(n, generator=g)
    x = torch.randn(8, k, generator=g) * scale
    x[0, ::7] = 0.0
    x[1, ::5] *= 1e-6
    x[2, ::3] *= 1e6
    whole = op(x, w, b)
    for m in range(8):
        assert torch.equal(op(x[m : m + 1], w, b), whole[m : m + 1]), f"row {m}"
