"""The kernels' software prefetch policy (``services/engine/kernels/linear.h``): chosen once per process
for the CPU, per kernel family, and overridden by ``SPECD_PREFETCH`` / ``SPECD_PREFETCH_QUANT`` for A/B
runs. Its speed is the benchmark's to show; here: each process reads the policy it was given, a
malformed switch keeps the default, and no policy changes a result."""

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

# In a fresh interpreter (the policy is fixed when the kernels load): the policy, and a hash of a bf16
# and an int4 product streamed from memory-sized weights.
PROBE = """
import hashlib, json, torch
from specd.services.engine import kernels
assert kernels.ensure_built()
torch.manual_seed(0)
w = torch.randn(4096, 1536).to(torch.bfloat16)
x = torch.randn(3, 1536)
y = torch.ops.specd_kernels.bf16_linear(x, w, None)
q = torch.ops.specd_kernels.int4_linear(x, torch.ops.specd_kernels.quantize_int4(w.float()), None)
policy = kernels.prefetch_policy()
print(json.dumps({"policy": {k: list(v) for k, v in policy.items()},
                  "bf16": hashlib.sha256(y.numpy().tobytes()).hexdigest(),
                  "int4": hashlib.sha256(q.numpy().tobytes()).hexdigest()}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("SPECD_PREFETCH", "SPECD_PREFETCH_QUANT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _amd_with_avx512() -> bool:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return "AuthenticAMD" in info and " avx512f" in info


def test_the_default_policy_follows_the_cpu() -> None:
    policy = _probe()["policy"]
    assert policy["float"] == ([16384, True] if _amd_with_avx512() else [4096, False])
    assert policy["quant"] == [4096, False]


def test_switches_override_each_family_and_never_change_a_result() -> None:
    default = _probe()
    float_l1 = _probe(SPECD_PREFETCH="l1:2048")
    quant_l2 = _probe(SPECD_PREFETCH_QUANT="l2:8192")
    malformed = _probe(SPECD_PREFETCH="fast", SPECD_PREFETCH_QUANT="l3:64")
    assert float_l1["policy"] == {"float": [2048, False], "quant": default["policy"]["quant"]}
    assert quant_l2["policy"] == {"float": default["policy"]["float"], "quant": [8192, True]}
    assert malformed["policy"] == default["policy"]
    for run in (float_l1, quant_l2, malformed):
        assert (run["bf16"], run["int4"]) == (default["bf16"], default["int4"])
