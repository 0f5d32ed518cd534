"""``specd serve``: prints the URL once ready; Ctrl-C stops all three; no orphan survives the supervisor."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from specd.services.common.ports import free_ports
from specd.services.common.process import specd_command
from tests.e2e.processes import REPO, alive, children

pytestmark = pytest.mark.demo


def _start(tmp_path: Path, installed: Path | None = None) -> tuple[subprocess.Popen, int, Path]:
    """``specd serve`` from the checkout, or with ``installed`` (a built package) from that package
    alone, run from a folder outside the checkout."""
    port, *others = free_ports(5)
    args = specd_command("serve", "--host", "127.0.0.1", "--port", str(port))
    for flag, p in zip(("--draft-port", "--target-port", "--draft-metrics-port", "--target-metrics-port"), others):
        args += [flag, str(p)]
    log = tmp_path / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(installed)) if installed else None
    with open(log, "wb") as f:
        p = subprocess.Popen(
            args, cwd=tmp_path if installed else REPO, env=env, stdout=f, stderr=subprocess.STDOUT, process_group=0
        )
    deadline = time.monotonic() + 180
    while "specd is ready" not in log.read_text():
        assert p.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return p, port, log


def _cleanup(p: subprocess.Popen, kids: list[int]) -> None:
    for pid in [p.pid, *kids]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def test_serve_prints_url_serves_and_stops_on_ctrl_c(tmp_path, built_package) -> None:
    # As installed by a plain `pip install .`: the demo pair is found inside the package.
    p, port, log = _start(tmp_path, installed=built_package)
    kids = children(p.pid)
    try:
        assert len(kids) == 3
        cmdlines = [Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0") for k in kids]
        models = [Path(c[c.index(b"--model") + 1].decode()) for c in cmdlines if b"--model" in c]
        assert sorted(m.name for m in models) == ["demo-draft", "demo-target"]
        assert all(m.is_relative_to(built_package) for m in models), models
        assert f"http://localhost:{port}/v1" in log.read_text()
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        os.kill(p.pid, signal.SIGINT)  # what Ctrl-C sends
        assert p.wait(timeout=30) == 0
        assert not any(alive(k) for k in kids)
    finally:
        _cleanup(p, kids)


def test_no_orphans_when_the_supervisor_is_killed(tmp_path) -> None:
    p, _, _ = _start(tmp_path)
    kids = children(p.pid)
    try:
        assert len(kids) == 3
        os.kill(p.pid, signal.SIGKILL)  # no chance to clean up: the kernel's parent-death signal must
        p.wait()
        deadline = time.monotonic() + 30
        while any(alive(k) for k in kids):
            assert time.monotonic() < deadline, "children outlived the supervisor"
            time.sleep(0.2)
    finally:
        _cleanup(p, kids)
