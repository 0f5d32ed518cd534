"""Child processes: their command lines (built here and nowhere else), and children that never
outlive their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

CLI_MODULE = "specd.services.cli"


def module_command(module: str, *args: str) -> list[str]:
    """``python -m MODULE ARGS`` with this interpreter (the same environment; no ``specd`` script
    looked up on PATH, which a venv that is not activated does not have)."""
    return [sys.executable, "-m", module, *args]


def specd_command(*args: str) -> list[str]:
    """The command line of ``specd ARGS`` as a child process."""
    return module_command(CLI_MODULE, *args)


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess: the kernel sends the child SIGTERM when its parent dies.

    Used by ``specd serve`` and by the Ray actors, so a killed supervisor or actor leaves no orphan.
    """
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent's own shutdown still stops the children


def stop_process_group(p: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Stop a child started with ``process_group=0`` and everything in its group: ``sig`` first,
    SIGKILL after ``grace`` seconds. Only that group is signalled, never anything else."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, sig)
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    except ProcessLookupError:
        pass
