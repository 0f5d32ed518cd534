"""Transparent huge pages under what decoding streams (``services/engine/kernels/huge_pages.h``).

The speed-up is the benchmark's to show; here: the advice lands where it should (the VMA is flagged,
the weights the fused decoder reads fault in as 2 MB pages), collapsing keeps every byte, and
``SPECD_HUGE_PAGES=0`` turns it all off."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specd.services.engine import kernels

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = THP.read_text().split("[")[1].split("]")[0] if THP.is_file() else "absent"
pytestmark = [
    pytest.mark.skipif(not kernels.ensure_built(), reason="the AVX2 kernels are unavailable here"),
    pytest.mark.skipif(THP_MODE not in ("madvise", "always"), reason=f"transparent huge pages are {THP_MODE} here"),
]
REPO = Path(__file__).resolve().parents[2]


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _huge_interior(t: torch.Tensor) -> int:
    """An address 2 MB-aligned inside ``t``'s memory (the part that can be advised)."""
    huge = 2 << 20
    address = (t.data_ptr() + huge - 1) // huge * huge
    assert address + huge <= t.data_ptr() + t.nbytes
    return address


def test_advice_flags_the_memory_and_collapsing_keeps_every_byte() -> None:
    # A mapping of its own, so no earlier advice (another test's weights, freed into a heap range
    # that stays flagged) can be what the flag shows.
    region = mmap.mmap(-1, 12 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.int32)  # 12 MB
    g = torch.Generator().manual_seed(0)
    t.copy_(torch.randint(-(2**31), 2**31 - 1, t.shape, dtype=torch.int32, generator=g))  # written
    before = t.clone()
    assert "hg" not in _vm_flags(_huge_interior(t))
    assert kernels.advise_huge_pages(t)
    assert "hg" in _vm_flags(_huge_interior(t))
    assert torch.equal(t, before)
    # Too small to hold an aligned 2 MB page: nothing to advise.
    assert not kernels.advise_huge_pages(torch.zeros(1024))


# A one-layer model whose linear layers are 4-16 MB each, loaded on the fused path; prints how much
# of the process sits in 2 MB pages before and after (AnonHugePages, kB).
LOAD_SCRIPT = """
import torch
from pathlib import Path
from specd.services.engine.llama import load_llama
from tests.tiny_models import random_hf_model

def huge_kb():
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])

hf = random_hf_model("llama", hidden_size=1024, num_attention_heads=8, num_key_value_heads=8,
                     intermediate_size=4096, num_hidden_layers=1, vocab_size=512).to(torch.bfloat16)
before = huge_kb()
model = load_llama(hf, torch.bfloat16, "cpu", prepack=False)
assert model.forward_path == "fused", model.forward_path
print(huge_kb() - before)
"""


def _huge_kb_after_loading(switch: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "SPECD_HUGE_PAGES"}
    if switch is not None:
        env["SPECD_HUGE_PAGES"] = switch
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def test_the_fused_decoder_streams_its_weights_from_huge_pages() -> None:
    # The layer's weights are 4 + 16 + 8 MB in bf16 (q/k/v/o, gate/up, down): most of them must now
    # sit in 2 MB pages, whichever copy the decoder reads (packed for the tiles, or in place).
    assert _huge_kb_after_loading(None) >= 16 * 1024
    if THP_MODE == "madvise":  # only the advice gives huge pages here, so the switch must stop it
        assert _huge_kb_after_loading("0") == 0
