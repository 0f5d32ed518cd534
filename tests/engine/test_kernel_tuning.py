"""The kernels' per-CPU choices (``services/engine/kernels/linear.h``): the software prefetch of each
kernel family, the weight rows a one-input-row bf16 block takes at a time, whether bf16 layers use
AVX512-BF16 dot products and past which row length those are packed in chunks, whether threads take
tiles of each other's share of a layer, fixed once per process for the CPU and overridden by
``SPECD_PREFETCH``, ``SPECD_PREFETCH_QUANT``, ``SPECD_BF16_ONE_ROW_WEIGHT_ROWS``, ``SPECD_BF16_DOT``,
``SPECD_DOT_CHUNK`` and ``SPECD_WORK_STEALING`` for A/B runs. Their
speed is the benchmark's to show; here: each process reads the choices it was given, a malformed
switch keeps the default, and no prefetch or row choice changes a result (the dot products do, by
design: tests/engine/test_bf16_dot.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specd.services.engine import kernels

pytestmark = pytest.mark.skipif(not kernels.ensure_built(), reason="the AVX2 kernels are unavailable here")
REPO = Path(__file__).resolve().parents[2]
SWITCHES = (
    "SPECD_PREFETCH",
    "SPECD_PREFETCH_QUANT",
    "SPECD_BF16_ONE_ROW_WEIGHT_ROWS",
    "SPECD_BF16_DOT",
    "SPECD_AVX512",
    "SPECD_DOT_CHUNK",
    "SPECD_WORK_STEALING",
)

# In a fresh interpreter (the choices are fixed when the kernels load): the choices, and hashes of a
# bf16 and an int4 product for one input row and for three.
PROBE = """
import hashlib, json, torch
from specd.services.engine import kernels
assert kernels.ensure_built()
torch.manual_seed(0)
w = torch.randn(4096, 1536).to(torch.bfloat16)
x = torch.randn(3, 1536)
q = torch.ops.specd_kernels.quantize_int4(w.float())
q8, s8 = torch.ops.specd_kernels.quantize_int8(w.float())
outs = {}
for rows in (1, 3):
    y = torch.ops.specd_kernels.bf16_linear(x[:rows], w, None)
    z = torch.ops.specd_kernels.int4_linear(x[:rows], q, None)
    e = torch.ops.specd_kernels.int8_linear(x[:rows], q8, s8, None)
    outs[f"bf16_{rows}"] = hashlib.sha256(y.numpy().tobytes()).hexdigest()
    outs[f"int4_{rows}"] = hashlib.sha256(z.numpy().tobytes()).hexdigest()
    outs[f"int8_{rows}"] = hashlib.sha256(e.numpy().tobytes()).hexdigest()
t = kernels.kernel_tuning()
print(json.dumps({"tuning": [list(t.float_prefetch), list(t.quant_prefetch), t.bf16_one_row_weight_rows],
                  "bf16_dot": t.bf16_dot, "dot_chunk": t.dot_chunk, "work_stealing": t.work_stealing, **outs}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _amd_with_avx512() -> bool:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return "AuthenticAMD" in info and " avx512f" in info


def test_the_defaults_follow_the_cpu() -> None:
    float_prefetch, quant_prefetch, one_row = _probe()["tuning"]
    amd = _amd_with_avx512()
    assert float_prefetch == ([16384, True] if amd else [4096, False])
    assert quant_prefetch == [4096, False]
    assert one_row == (1 if amd else 2)


def test_dot_products_where_the_cpu_has_avx512_bf16_and_no_tile_unit() -> None:
    bf16_dot = kernels._cpu_has("avx512_bf16")
    assert _probe()["bf16_dot"] is (bf16_dot and not kernels._cpu_has("amx_tile"))
    assert _probe(SPECD_BF16_DOT="1")["bf16_dot"] is bf16_dot
    assert _probe(SPECD_BF16_DOT="0")["bf16_dot"] is False
    assert _probe(SPECD_AVX512="0", SPECD_BF16_DOT="1")["bf16_dot"] is False  # the AVX2 blocks only


@pytest.mark.skipif(not kernels._cpu_has("avx512_bf16"), reason="no AVX512-BF16 here: no dot products to chunk")
def test_the_chunk_limit_of_long_rows() -> None:
    """Rows longer than 4480 weights are packed in chunks (``SPECD_DOT_CHUNK``: another limit of at
    least 64, or 0 for never); a malformed or too small value keeps the default; without the dot
    products nothing is chunked."""
    assert _probe(SPECD_BF16_DOT="1")["dot_chunk"] == 4480
    assert _probe(SPECD_BF16_DOT="1", SPECD_DOT_CHUNK="64")["dot_chunk"] == 64
    assert _probe(SPECD_BF16_DOT="1", SPECD_DOT_CHUNK="0")["dot_chunk"] == 0
    for bad in ("32", "4k", "-64", ""):
        assert _probe(SPECD_BF16_DOT="1", SPECD_DOT_CHUNK=bad)["dot_chunk"] == 4480, bad
    assert _probe(SPECD_BF16_DOT="0")["dot_chunk"] == 0


def test_switches_override_each_choice_and_never_change_a_result() -> None:
    def probe(**env: str) -> dict:  # on the fp32-input bf16 blocks, which the row switch tunes
        return _probe(SPECD_BF16_DOT="0", **env)

    default = probe()
    runs = {
        "float": probe(SPECD_PREFETCH="l1:2048"),
        "quant": probe(SPECD_PREFETCH_QUANT="l2:8192"),
        "rows 1": probe(SPECD_BF16_ONE_ROW_WEIGHT_ROWS="1"),
        "rows 2": probe(SPECD_BF16_ONE_ROW_WEIGHT_ROWS="2"),
        "malformed": probe(SPECD_PREFETCH="fast", SPECD_PREFETCH_QUANT="l3:64", SPECD_BF16_ONE_ROW_WEIGHT_ROWS="7"),
        "not a number": probe(SPECD_PREFETCH="l2:16k", SPECD_PREFETCH_QUANT="l1:-64"),
    }
    f, q, r = default["tuning"]
    assert runs["float"]["tuning"] == [[2048, False], q, r]
    assert runs["quant"]["tuning"] == [f, [8192, True], r]
    assert runs["rows 1"]["tuning"] == [f, q, 1]
    assert runs["rows 2"]["tuning"] == [f, q, 2]
    assert runs["malformed"]["tuning"] == default["tuning"]
    assert runs["not a number"]["tuning"] == default["tuning"]
    for name, run in runs.items():
        assert {k: v for k, v in run.items() if k != "tuning"} == {k: v for k, v in default.items() if k != "tuning"}, (
            name
        )


def test_work_stealing_is_the_default_and_never_changes_a_result() -> None:
    """Threads take tiles from the back of each other's share of a layer unless
    ``SPECD_WORK_STEALING=0``; which thread computes a weight row never changes its bits (bf16 with
    and without the dot products, int4, int8; which tiles get stolen varies from call to call, so
    tests/engine/test_work_stealing.py checks the hand-out itself)."""

    def results(run: dict) -> dict:
        return {f"{kind}_{rows}": run[f"{kind}_{rows}"] for kind in ("bf16", "int4", "int8") for rows in (1, 3)}

    for dot in ("0", "1") if kernels._cpu_has("avx512_bf16") else ("0",):
        on, off = _probe(SPECD_BF16_DOT=dot), _probe(SPECD_BF16_DOT=dot, SPECD_WORK_STEALING="0")
        assert on["work_stealing"] is True and off["work_stealing"] is False
        assert _probe(SPECD_BF16_DOT=dot, SPECD_WORK_STEALING="yes")["work_stealing"] is True
        assert results(on) == results(off), dot
