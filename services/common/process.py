"""Child processes that never outlive their parent."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess: the kernel sends the child SIGTERM when its parent dies.

    Used by ``specd serve`` and by the Ray actors, so a killed supervisor or actor leaves no orphan.
    """
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent's own shutdown still stops the children
