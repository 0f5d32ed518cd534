"""The weights a model streams in place, moved into transparent huge pages on a background thread.

Decoding reads every weight once per step, and the real pair's 1.5B target reads most of its 3.1 GB
straight from the checkpoint's memory map (``checkpoint.py``), in 4 KB pages: Linux does not fold a
private file mapping into huge pages (``MADV_COLLAPSE`` refuses it). Moved, the target alone decoded
1.108x faster and with ``auto`` 1.086x (medians of alternated rounds in one process on the AMD Zen 4
VM: faster in its fast minutes, level in its slow ones). The kernels copy a range into fresh huge
pages and move them over the old ones at the same addresses (``kernels/huge_pages.h``,
``move_to_huge_pages``), so nothing that points at the weights changes and the bytes are the same.

Why in the background, a piece at a time, at the lowest CPU priority: on a VM that hands free memory
back to its host every 2 MB page costs milliseconds to fault in (13 s more to load the real pair's
target here), which would break a cold start (issue 11: first token under 4 s). So the model is
ready at once, decodes from the old pages meanwhile, and the move runs in the cores' idle time. A
short ``specd generate`` never wins that back, so it keeps 4 KB pages unless given ``--huge-pages``
(``SPECD_HUGE_PAGES=0``, which also turns this off).
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Iterable, Sequence

import torch

from specd.services.common.constants import HUGE_PAGES_SWITCH

PIECE_BYTES = 32 << 20  # one move: the thread can stop between pieces; a multiple of 2 MB
LOWEST_PRIORITY = 19  # niceness: the move takes what decoding leaves


def huge_pages_enabled() -> bool:
    """Whether this process puts what decoding streams in huge pages (``SPECD_HUGE_PAGES`` not 0)."""
    return os.environ.get(HUGE_PAGES_SWITCH, "1") != "0"


def _pieces(t: torch.Tensor) -> list[tuple[int, int]]:
    """(offset, length) pieces of ``t``'s bytes whose ends fall on multiples of PIECE_BYTES in the
    address space (so on 2 MB pages, which a move takes whole)."""
    start, end = t.data_ptr(), t.data_ptr() + t.nbytes
    out, at = [], start
    while at < end:
        nxt = min((at // PIECE_BYTES + 1) * PIECE_BYTES, end)
        out.append((at - start, nxt - at))
        at = nxt
    return out


class HugePageMove:
    """Moves ``tensors``' memory into huge pages on a daemon thread (see the module docstring).

    ``bytes_moved`` counts what moved so far; :meth:`wait` waits for the end, :meth:`stop` ends it
    early (between pieces). Reading the tensors meanwhile is safe: the bytes never change. The thread
    holds the tensors until it ends, so a model dropped mid-move should :meth:`cancel` it."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._stop = threading.Event()
        self._done = threading.Event()
        self.bytes_moved = 0
        self._thread = threading.Thread(target=self._run, name="specd-huge-pages", daemon=True)
        # A daemon thread still inside the kernels when the interpreter exits is unwound through C++
        # frames that may not be, and the process aborts ("terminate called without an active
        # exception"): so exiting stops the move first (at most one piece's wait).
        atexit.register(_stop_at_exit, weakref.ref(self))
        self._thread.start()

    def _run(self) -> None:
        from specd.services.engine.kernels import move_to_huge_pages

        try:
            try:  # Linux applies a thread id's niceness to that thread alone
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
            except (AttributeError, OSError):
                pass
            for t in self._tensors:
                for offset, length in _pieces(t):
                    if self._stop.is_set():
                        return
                    self.bytes_moved += move_to_huge_pages(t, offset, length)
        finally:
            self._tensors = []
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every piece is moved (or the move stopped); False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop after the piece being moved, without waiting."""
        self._stop.set()

    def stop(self) -> None:
        """Stop after the piece being moved, and wait for that."""
        self.cancel()
        self._thread.join()


def _stop_at_exit(move: weakref.ref[HugePageMove]) -> None:
    m = move()
    if m is not None:
        m.stop()


def start_move(tensors: Sequence[torch.Tensor]) -> HugePageMove | None:
    """A background move of ``tensors`` into huge pages, or None where this process keeps 4 KB pages
    or there is nothing to move."""
    if not tensors or not huge_pages_enabled():
        return None
    return HugePageMove(tensors)


def wait_for_moves(models: Iterable[object], timeout: float | None = None) -> int:
    """Wait for the huge-page moves of ``models`` (those with one: ``model.huge_page_move``); the bytes
    moved. For benchmarks, which time the models as they serve once settled."""
    total = 0
    for model in {id(m): m for m in models}.values():
        move = getattr(model, "huge_page_move", None)
        if move is not None:
            move.wait(timeout)
            total += move.bytes_moved
    return total


def wait_for_engines(engines: Iterable[object], timeout: float | None = None) -> int:
    """:func:`wait_for_moves` for the target and the in-process draft model of each engine."""
    models = []
    for engine in engines:
        models += [getattr(engine, "target", None), getattr(getattr(engine, "model_drafter", None), "model", None)]
    return wait_for_moves([m for m in models if m is not None], timeout)
