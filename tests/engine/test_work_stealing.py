"""How the linear kernels hand a layer's weight rows to their threads (``linear.h``,
``for_each_weight_tile``): each thread walks its own contiguous share in tiles from the front, and a
thread done with its share takes tiles from the back of another's. Whatever the timing, every row is
in exactly one tile; the bits of a row do not depend on the thread (test_kernel_tuning.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specd.services.engine import kernels

pytestmark = pytest.mark.skipif(not kernels.ensure_built(), reason="the AVX2 kernels are unavailable here")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tiles(n: int, tile: int, hold: bool) -> list[tuple[int, int, int]]:
    out = torch.ops.specd_kernels.weight_tiles(n, tile, hold)
    return [tuple(r) for r in out.tolist()]


def _assert_partition(tiles: list[tuple[int, int, int]], n: int) -> None:
    spans = sorted((a, b) for a, b, _ in tiles)
    assert all(a < b for a, b in spans), spans
    ends = [0] + [b for _, b in spans]
    assert [a for a, _ in spans] == ends[:-1], spans  # no gap, no overlap
    assert ends[-1] == n


@pytest.mark.parametrize("n,tile", [(1, 1), (15, 4), (1536, 256), (2048, 85), (8960, 14), (151936, 85), (17, 100)])
def test_every_row_in_exactly_one_tile(two_threads: None, n: int, tile: int) -> None:
    for hold in (False, True):
        tiles = _tiles(n, tile, hold)
        _assert_partition(tiles, n)
        assert max(b - a for a, b, _ in tiles) <= max(tile, 16)


def test_no_rows_no_tiles(two_threads: None) -> None:
    assert _tiles(0, 8, False) == []


def test_a_thread_done_early_takes_tiles_from_the_back_of_the_other_share(two_threads: None) -> None:
    """Thread 0 is held in its first tile until thread 1, done with its own share, has taken one
    of thread 0's; stolen tiles come from the back of the share, and their rows are not run twice."""
    n, tile = 2048, 64
    tiles = _tiles(n, tile, True)
    _assert_partition(tiles, n)
    stolen = [(a, b) for a, b, thread in tiles if thread == 1 and b <= n // 2]
    assert stolen, tiles
    assert max(b for _, b in stolen) == n // 2  # the first steal is the share's last tile
    owned = sorted((a, b) for a, b, thread in tiles if thread == 0)
    assert owned[0][0] == 0 and all(b <= min(a for a, _ in stolen) for _, b in owned)


def test_a_share_of_one_tile_is_not_shared(two_threads: None) -> None:
    """Below two tiles a share, nothing finer than the whole share could be taken: the plain split
    (no thread start-up for a small layer's stealing)."""
    tiles = _tiles(256, 128, True)
    _assert_partition(tiles, 256)
    assert sorted((a, thread) for a, _, thread in tiles) == [(0, 0), (128, 1)]


def test_switched_off_each_thread_runs_only_its_own_share() -> None:
    code = (
        "import torch; from specd.services.engine import kernels; assert kernels.ensure_built();"
        "torch.set_num_threads(2);"
        "t = torch.ops.specd_kernels.weight_tiles(2048, 64, True).tolist();"
        "print(sorted(set((a < 1024, th) for a, _, th in t)))"
    )
    env = {**os.environ, "SPECD_WORK_STEALING": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[(False, 1), (True, 0)]"


def test_claims_shrink_as_a_share_runs_out(two_threads: None) -> None:
    """A thread claims at most half of what is left of a share (down to 16 rows), so the last
    claims, which no other thread can take any more, are short. Thread 1 drains its own share alone
    here (thread 0 is held until thread 1 has stolen, which it does only once its share is done)."""
    n, tile = 1536, 256
    tiles = _tiles(n, tile, True)
    _assert_partition(tiles, n)
    own = [b - a for a, b, thread in tiles if thread == 1 and a >= n // 2]
    assert own == [256, 256, 128, 64, 32, 16, 16]
    # Steals shrink too: the first is half of what thread 0 left unclaimed ([256, 768)); how many
    # follow depends on when thread 0, released, claims the rest.
    stolen = [b - a for a, b, thread in tiles if thread == 1 and b <= n // 2]
    assert stolen and stolen[0] == 256 and stolen == sorted(stolen, reverse=True), stolen
