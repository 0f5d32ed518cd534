"""A test run stopped by SIGTERM still stops the processes its fixtures started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CASE = """
import subprocess, sys, time
import pytest

@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    open("child.pid", "w").write(str(p.pid))
    yield p
    p.terminate()
    p.wait()

def test_waits(child):
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A stopped child not yet reaped by anyone would still answer; it is ours only while running.
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


def test_sigterm_tears_fixtures_down(tmp_path: Path) -> None:
    (tmp_path / "test_case.py").write_text(_CASE)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.interrupt", "test_case.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    pid_file = tmp_path / "child.pid"
    child = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.1)
        assert pid_file.exists(), run.communicate(timeout=30)[0]
        time.sleep(0.2)  # the pid is written before the fixture yields
        child = int(pid_file.read_text())
        assert _alive(child)
        run.send_signal(signal.SIGTERM)
        out = run.communicate(timeout=60)[0].decode()
        assert run.returncode != 0 and "KeyboardInterrupt" in out, out
        assert not _alive(child), out
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
