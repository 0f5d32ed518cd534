"""Transparent huge pages under what decoding streams (``services/engine/kernels/huge_pages.h``).

The speed-up is the benchmark's to show; here: the advice lands where it should (the VMA is flagged,
the weights the fused decoder reads fault in as 2 MB pages), collapsing keeps every byte, weights read
in place from a checkpoint's memory map are moved into 2 MB pages at the same addresses with the same
bytes and logits (``services/engine/weight_pages.py``), and ``SPECD_HUGE_PAGES=0`` turns it all off."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specd.services.engine import kernels, llama
from specd.services.engine.model import load_model
from specd.services.engine.weight_pages import HugePageMove
from tests.engine.test_fused_decoder import _run
from tests.tiny_models import random_hf_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = THP.read_text().split("[")[1].split("]")[0] if THP.is_file() else "absent"
pytestmark = [
    pytest.mark.skipif(not kernels.ensure_built(), reason="the AVX2 kernels are unavailable here"),
    pytest.mark.skipif(THP_MODE not in ("madvise", "always"), reason=f"transparent huge pages are {THP_MODE} here"),
]
REPO = Path(__file__).resolve().parents[2]


def _smaps_field(address: int, field: str) -> list[str]:
    """The values of ``field`` (``VmFlags``, ``AnonHugePages``, ...) for the mapping that holds
    ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == field + ":":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    return _smaps_field(address, "VmFlags")


def _anon_huge_kb(address: int) -> int:
    return int(_smaps_field(address, "AnonHugePages")[0])


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


def _file_mapped(path: Path, data: bytes) -> torch.Tensor:
    """``data`` in a file, read back through a private (copy-on-write) memory map, as a checkpoint's
    tensors are (services/engine/checkpoint.py)."""
    path.write_bytes(data)
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(region, dtype=torch.uint8)


def test_moving_a_file_mapping_into_huge_pages_keeps_every_byte_at_its_address(tmp_path: Path) -> None:
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t = _file_mapped(tmp_path / "weights.bin", data.numpy().tobytes())
    address, interior = t.data_ptr(), _huge_interior(t)
    assert _anon_huge_kb(interior) == 0
    # Every whole 2 MB page of the 12 MB map: at least five of them wherever it starts.
    assert kernels.move_to_huge_pages(t, 0, t.nbytes) >= 10 << 20
    assert t.data_ptr() == address
    assert torch.equal(t, data)
    assert _anon_huge_kb(interior) >= 2048
    # Moved before, so anonymous now: left alone; so is memory that never was a file's.
    assert kernels.move_to_huge_pages(t, 0, t.nbytes) == 0
    assert kernels.move_to_huge_pages(torch.ones(12 << 20, dtype=torch.uint8), 0, 12 << 20) == 0


def test_a_piece_moves_the_pages_it_touches_and_no_others(tmp_path: Path) -> None:
    data = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    t = _file_mapped(tmp_path / "weights.bin", data.numpy().tobytes())
    huge = 2 << 20
    first = _huge_interior(t) - t.data_ptr()  # offset of the first whole 2 MB page
    # One byte inside the second whole page: that page moves, the ones around it stay.
    assert kernels.move_to_huge_pages(t, first + huge + 100, 1) == huge
    assert _anon_huge_kb(t.data_ptr() + first + huge) == 2048
    assert _anon_huge_kb(t.data_ptr() + first) == 0
    assert _anon_huge_kb(t.data_ptr() + first + 2 * huge) == 0
    assert torch.equal(t, data)


# One layer whose linear layers are 2-8 MB in bf16, saved as a checkpoint: loaded from disk, its
# weights are views of the file's memory map.
def _checkpoint(path: Path) -> Path:
    hf = random_hf_model(
        "qwen2",
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=4096,
        num_hidden_layers=1,
        vocab_size=512,
    ).to(torch.bfloat16)
    hf.save_pretrained(path)
    return path


def test_weights_read_in_place_move_into_huge_pages_and_decode_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama, "start_move", lambda tensors: None)  # moved by hand below
    model = load_model(str(_checkpoint(tmp_path)), torch.bfloat16)
    assert model.forward_path == "fused"
    in_place = [w for w in model.fused.in_place_weights() if w.nbytes >= 4 << 20]
    if not in_place:
        pytest.skip("every large layer is packed into a copy on this CPU (tiles or chunks)")
    assert all(_anon_huge_kb(_huge_interior(w)) == 0 for w in in_place)
    g = torch.Generator().manual_seed(2)
    prompts, steps = torch.randint(0, 512, (2, 30), generator=g), torch.randint(0, 512, (2, 5), generator=g)
    before = _run(model, prompts, steps)
    move = HugePageMove(model.fused.in_place_weights())
    assert move.wait(120) and move.done
    assert move.bytes_moved >= sum(w.nbytes for w in in_place) - 4 * len(in_place) * (2 << 20)
    assert all(_anon_huge_kb(_huge_interior(w)) >= 2048 for w in in_place)
    assert torch.equal(_run(model, prompts, steps), before)


def test_loading_a_checkpoint_starts_the_move_unless_huge_pages_are_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _checkpoint(tmp_path)
    model = load_model(str(path), torch.bfloat16)
    if not model.fused.in_place_weights():
        pytest.skip("every layer is packed into a copy on this CPU")
    assert model.huge_page_move is not None
    assert model.huge_page_move.wait(120) and model.huge_page_move.bytes_moved > 0
    monkeypatch.setenv("SPECD_HUGE_PAGES", "0")
    assert load_model(str(path), torch.bfloat16).huge_page_move is None


# Starts moving a 256 MB file mapping (8 pieces) and exits once the first piece is done, so while the
# move is most likely inside the kernels: a daemon thread caught there at exit aborts the process.
EXIT_SCRIPT = """
import mmap, sys, time
import torch
from specd.services.engine import kernels
from specd.services.engine.weight_pages import HugePageMove
assert kernels.ensure_built()
with open(sys.argv[1], "rb") as f:
    region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
move = HugePageMove([torch.frombuffer(region, dtype=torch.uint8)])
while move.bytes_moved == 0 and not move.done:
    time.sleep(0.001)
print("started", move.done)
"""


def test_a_process_that_exits_mid_move_exits_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(256 << 20))
    mid_move = False
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, str(path)], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and "started" in out.stdout, out.stderr[-2000:]
        mid_move = mid_move or "False" in out.stdout
    assert mid_move, "every move was done before the process exited: the test saw nothing"
