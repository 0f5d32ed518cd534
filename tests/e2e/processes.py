"""Start the real specd services as subprocesses on free loopback ports, and always stop them.

Every process runs in its own process group; :meth:`Stack.stop` signals exactly those groups
(SIGTERM, then SIGKILL after a grace period), so a failing test never leaves anything behind and
never touches a process it did not start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specd.services.common.ports import free_ports
from specd.services.common.process import specd_command, stop_process_group

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    return free_ports(1)[0]


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as f:
        return subprocess.Popen(
            specd_command(*args),
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            process_group=0,
        )


def children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def alive(pid: int) -> bool:
    """Running: it exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_process(p: subprocess.Popen, grace: float = 10.0) -> None:
    stop_process_group(p, grace=grace)


def kill_process(p: subprocess.Popen) -> None:
    """SIGKILL: a crash, not a shutdown."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def wait_grpc(
    port: int,
    proc: subprocess.Popen,
    log: Path,
    timeout: float = 120.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Until the port accepts gRPC connections (over mutual TLS with ``credentials``)."""
    deadline = time.monotonic() + timeout
    address = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel as ch:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"service exited early:\n{log.read_text()[-3000:]}")
            try:
                grpc.channel_ready_future(ch).result(timeout=1.0)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"port {port} not ready:\n{log.read_text()[-3000:]}") from None


def http_get(url: str, timeout: float = 5.0, verify: str | bool = True) -> tuple[int, str]:
    """(status, body); ``verify``: a CA file for https URLs."""
    context = None
    if isinstance(verify, str):
        import ssl

        context = ssl.create_default_context(cafile=verify)
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_http_ok(
    url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0, verify: str | bool = True
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited early:\n{log.read_text()[-3000:]}")
        try:
            if http_get(url, timeout=2.0, verify=verify)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """The value of one sample in Prometheus text format (``labels`` like 'position="0"')."""
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == want:
            return float(value)
    return None


def metric_sum(text: str, name: str) -> float:
    """Sum over every label set of one metric."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


@dataclass
class Stack:
    """draft + target + gateway, each a real ``specd`` process."""

    target_model: Path
    draft_model: Path | None
    logdir: Path
    dtype: str = "float32"
    draft_args: tuple[str, ...] = ()
    target_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    gateway_scheme: str = "http"
    # For the test's own readiness checks of TLS-only gRPC ports (the services get their flags above).
    grpc_credentials: grpc.ChannelCredentials | None = None
    http_verify: str | bool = True  # CA file for an https gateway
    draft_port: int = 0  # 0: five distinct free ports are picked at construction
    draft_metrics: int = 0
    target_port: int = 0
    target_metrics: int = 0
    gateway_port: int = 0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = ("draft_port", "draft_metrics", "target_port", "target_metrics", "gateway_port")
        for name, port in zip(names, free_ports(len(names))):
            if not getattr(self, name):
                setattr(self, name, port)

    @property
    def url(self) -> str:
        return f"{self.gateway_scheme}://127.0.0.1:{self.gateway_port}"

    def start_draft(self) -> None:
        log = self.logdir / "draft.log"
        self.procs["draft"] = p = spawn(
            [
                "draft",
                "--model",
                str(self.draft_model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.draft_port),
                "--metrics-port",
                str(self.draft_metrics),
                "--dtype",
                self.dtype,
                *self.draft_args,
            ],
            log,
        )
        wait_grpc(self.draft_port, p, log, credentials=self.grpc_credentials)

    def start(self) -> Stack:
        self.logdir.mkdir(parents=True, exist_ok=True)
        try:
            if self.draft_model is not None:
                self.start_draft()
            log = self.logdir / "target.log"
            args = [
                "target",
                "--model",
                str(self.target_model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.target_port),
                "--metrics-port",
                str(self.target_metrics),
                "--dtype",
                self.dtype,
                *self.target_args,
            ]
            if self.draft_model is not None:
                args += ["--draft-address", f"127.0.0.1:{self.draft_port}"]
            self.procs["target"] = p = spawn(args, log)
            wait_grpc(self.target_port, p, log, credentials=self.grpc_credentials)
            log = self.logdir / "gateway.log"
            self.procs["gateway"] = p = spawn(
                [
                    "gateway",
                    "--target-address",
                    f"127.0.0.1:{self.target_port}",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.gateway_port),
                    *self.gateway_args,
                ],
                log,
            )
            wait_http_ok(self.url + "/health", p, log, verify=self.http_verify)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in ("gateway", "target", "draft"):
            if name in self.procs:
                stop_process(self.procs[name])

    def metrics(self, which: str) -> str:
        if which == "gateway":
            return http_get(self.url + "/metrics", verify=self.http_verify)[1]
        port = {"draft": self.draft_metrics, "target": self.target_metrics}[which]
        return http_get(f"http://127.0.0.1:{port}/metrics")[1]
