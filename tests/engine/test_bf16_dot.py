"""bf16 dot products (``services/engine/kernels/linear.h``, ``bf16_dot_rows``): on CPUs with
AVX512-BF16, bf16 layers round each input row to bf16 and multiply with ``vdpbf16ps``, the default
where there is no AMX tile unit (``SPECD_BF16_DOT=0`` keeps the fp32-input blocks, ``=1`` forces the
dot products). Not the fp32-input blocks' bits, by design; what must hold is that the result is the
product of the rounded input exactly up to fp32 accumulation, that every row's bits are independent
of the rows around it, and so that bf16 greedy speculation stays token-identical to the target alone.
The rest of the suite runs the default, so on such a CPU the dot products; the last test runs the
fp32-input blocks' own checks with ``SPECD_BF16_DOT=0``. The switch is read once per process, so each
check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _fresh(dot: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECD_BF16_DOT": dot}
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
