"""bf16 dot products (``services/engine/kernels/linear.h``, ``bf16_dot_rows``): on CPUs with
AVX512-BF16, bf16 layers round each input row to bf16 and multiply with ``vdpbf16ps``, the default
where there is no AMX tile unit (``SPECD_BF16_DOT=0`` keeps the fp32-input blocks, ``=1`` forces the
dot products). Not the fp32-input blocks' bits, by design; what must hold is that the result is the
product of the rounded input exactly up to fp32 accumulation, that every row's bits are independent
of the rows around it, and so that bf16 greedy speculation stays token-identical to the target alone.
The rest of the suite runs the default, so on such a CPU the dot products; one test here runs the
fp32-input blocks' own checks with ``SPECD_BF16_DOT=0``. Layers with long rows are packed in chunks
for the dot products (``dot_chunk_pack``), which must give the rows in place's bits. The switches are
read once per process, so each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specd.services.engine import kernels

REPO = Path(__file__).resolve().parents[2]


pytestmark = [
    pytest.mark.skipif(not kernels.ensure_built(), reason="the AVX2 kernels are unavailable here"),
    pytest.mark.skipif(not kernels._cpu_has("avx512_bf16"), reason="no AVX512-BF16 here: the switch is ignored"),
]

PRODUCTS = """
import torch
from specd.services.engine import kernels
op = kernels.bf16_linear()
for n, k in [(203, 136), (300, 1536), (75, 7000), (33, 40)]:
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(40, k, generator=g)
    whole = op(x, w, b)
    for m in (1, 2, 6, 7, 8, 9, 13, 39):
        assert torch.equal(op(x[:m], w, b), whole[:m]), (n, k, m)
    assert torch.equal(op(x[17:18], w, b), whole[17:18])
    rounded = x.bfloat16().double() @ w.double().T + b.double()
    exact = x.double() @ w.double().T + b.double()
    scale = exact.abs().max().item()
    assert (whole.double() - rounded).abs().max().item() < 1e-5 * scale, (n, k)  # the rounded input's product
    assert (whole.double() - exact).abs().max().item() > 1e-4 * scale, (n, k)  # and not the fp32 input's
print("ok")
"""


CHUNKED = """
import torch
from specd.services.engine import kernels
op = kernels.bf16_linear()
chunked = torch.ops.specd_kernels.bf16_dot_chunked_linear
# (rows, width, chunk): the real pair's down projections (8960 in two chunks, the draft's 4864 in two),
# and small ones with several chunks and more weight rows than a tile.
for n, k, c in [(75, 8960, 4480), (40, 4864, 2432), (300, 192, 64), (600, 256, 64), (257, 640, 128)]:
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(40, k, generator=g)
    for m in (1, 2, 3, 7, 8, 9, 13, 40):
        assert torch.equal(chunked(x[:m], w, b, c), op(x[:m], w, b)), (n, k, c, m)
    assert torch.equal(chunked(x[:5], w, None, c), op(x[:5], w, None)), (n, k, c)
print("ok")
"""

# Several weights against one input in one pass of the threads (bf16_dot_parts, as the fused decoder
# runs q, k and v, gate and up): the bits of each weight's own product, biases or not, at every block
# of input rows, with parts that end inside a tile and tiles that hold several parts.
PARTS = """
import torch
from specd.services.engine import kernels
op = kernels.bf16_linear()
parts = torch.ops.specd_kernels.bf16_dot_parts_linear
g = torch.Generator().manual_seed(0)
for k, ns in [(1536, [1536, 256, 256]), (1536, [8960, 8960]), (136, [203, 7, 300]), (40, [5]), (64, [1, 1, 1, 1])]:
    ws = [torch.randn(n, k, generator=g).bfloat16() for n in ns]
    bs = [torch.randn(n, generator=g) if i % 2 == 0 else torch.empty(0) for i, n in enumerate(ns)]
    x = torch.randn(9, k, generator=g)
    for m in (1, 2, 5, 7, 8, 9):
        whole = torch.cat([op(x[:m], w, b if b.numel() else None) for w, b in zip(ws, bs)], dim=-1)
        assert torch.equal(parts(x[:m], ws, bs), whole), (k, ns, m)
print("ok")
"""

# A tiny model whose every linear layer has rows longer than SPECD_DOT_CHUNK=64 (hidden 128, MLP 192):
# prefill two rows, then one pass of five tokens over both; its formats and logits to a file.
FUSED = """
import sys
import torch
from specd.services.engine import kernels
from specd.services.engine.llama import load_llama
from tests.engine.test_fused_decoder import _run
from tests.tiny_models import random_hf_model
hf = random_hf_model("qwen2", hidden_size=128, intermediate_size=192, num_key_value_heads=2)
model = load_llama(hf.to(torch.bfloat16).to(torch.float32), torch.bfloat16, "cpu", prepack=False)
assert model.forward_path == "fused", model.forward_path
g = torch.Generator().manual_seed(3)
prompts, steps = torch.randint(0, 300, (2, 30), generator=g), torch.randint(0, 300, (2, 5), generator=g)
torch.save((kernels.kernel_tuning().dot_chunk, model.fused.formats(), _run(model, prompts, steps)), sys.argv[1])
"""
CHUNKED_FORMAT = 6  # linear.h, Format::kBf16DotChunked


def _fresh(dot: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECD_BF16_DOT": dot, **env}
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True)


def test_products_are_the_rounded_input_s_and_batch_invariant() -> None:
    out = _fresh("1", "-c", PRODUCTS)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("dot", ["1", "0"])
def test_the_fused_decoder_stays_batch_invariant_and_speculation_token_identical(dot: str) -> None:
    """The fused decoder's own batch-invariance test and the bf16 speculation identity (draft k = 2
    and 4, n-gram, auto against the target alone) on each kind of bf16 block; with ``0`` also the
    fp32-input blocks' batch invariance and their 512-bit blocks' agreement with the AVX2 ones."""
    tuning = kernels.kernel_tuning()
    if dot == "1" and tuning is not None and tuning.bf16_dot:
        pytest.skip("the dot products are this CPU's default: the rest of the suite runs these on them")
    tests = ["test_fused_forward_is_batch_invariant", "test_bf16_greedy_speculation_is_token_identical"]
    files = ["tests/engine/test_fused_decoder.py"]
    if dot == "0":
        tests += ["test_rows_are_bit_identical_whatever_the_batch", "test_avx512_blocks_give_the_avx2_blocks_bits"]
        files.append("tests/engine/test_linear_kernels.py")
    out = _fresh(dot, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", " or ".join(tests))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], out.stdout[-500:]


def test_rows_packed_in_chunks_give_the_rows_in_place_bits() -> None:
    """Long rows packed chunk by chunk (``dot_chunk_pack``) give, bit for bit, the products of the rows
    in place, at every block of input rows and through the prefill's tiles."""
    out = _fresh("1", "-c", CHUNKED)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_parts_in_one_pass_give_each_part_s_own_bits() -> None:
    """The fused decoder's q, k and v (gate and up) in one pass of the threads give each weight's own
    products bit for bit, so the batch invariance and speculation identity shown part by part hold."""
    out = _fresh("1", "-c", PARTS)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_fused_decoder_packs_long_rows_in_chunks_with_the_same_bits(tmp_path: Path) -> None:
    """With ``SPECD_DOT_CHUNK=64`` the fused decoder packs every layer of a tiny model in chunks, and
    its logits (a prefill, then a pass of several rows) are the bits of the same model with its rows
    in place (``SPECD_DOT_CHUNK=0``): so the batch invariance and speculation identity shown on the
    rows in place hold for the chunked layers too."""
    runs = {}
    for chunk in ("64", "0"):
        path = tmp_path / f"chunk{chunk}.pt"
        out = _fresh("1", "-c", FUSED, str(path), SPECD_DOT_CHUNK=chunk, SPECD_FUSED="1")
        assert out.returncode == 0, out.stderr[-3000:]
        runs[chunk] = torch.load(path)
    (limit, formats, chunked), (off, whole_formats, whole) = runs["64"], runs["0"]
    assert (limit, off) == (64, 0)
    assert formats.count(CHUNKED_FORMAT) == len(formats), formats  # every part packed in chunks
    assert CHUNKED_FORMAT not in whole_formats, whole_formats
    assert torch.equal(chunked, whole)
