"""The Ray actors that host specd's services.

- :class:`ServiceActor` owns one ``specd draft`` or ``specd target`` process (one rank of a target).
  The service keeps its own process because the target steps its model on a process's main thread
  (services/common/main_thread.py says why), which a Ray worker does not offer. The child dies with
  its actor (PR_SET_PDEATHSIG), so killing the actor, or losing its node, leaves nothing behind.
  Ray's resource grant (``CUDA_VISIBLE_DEVICES``) is inherited by the child.
- :class:`GatewayActor` runs the FastAPI gateway inside the actor's event loop, so the controller
  can hand it a new target list directly (:meth:`GatewayActor.set_targets`).

"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import grpc
import ray

from specd.services.common.ports import free_ports
from specd.services.common.process import die_with_parent, specd_command, stop_process_group

# Starts of a service on fresh ports after it exits during start-up. Its ports are chosen here and
# bound by the child seconds later (a Python start), and on a Ray node Ray's own workers bind ports
# meanwhile: one CI run lost a draft's port that way ("Address already in use").
START_ATTEMPTS = 3


class _ExitedDuringStartup(RuntimeError):
    pass


def node_ip() -> str:
    return ray.util.get_node_ip_address()


class ServiceHost:
    """Starts and stops one ``specd`` service process on this node (the body of ServiceActor)."""

    def __init__(self, name: str, log_dir: str) -> None:
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.metrics_address: str | None = None

    def start(self, argv: list[str], timeout: float = 300.0, env: dict[str, str] | None = None) -> dict[str, str]:
        """Run ``specd ARGV --host 0.0.0.0 --port P --metrics-port M`` and wait until gRPC answers;
        a process that exits during start-up is started again on new ports (START_ATTEMPTS in all),
        then its log's tail is the error."""
        for _ in range(START_ATTEMPTS):
            try:
                return self._start_once(argv, timeout, env)
            except _ExitedDuringStartup:
                pass
        raise RuntimeError(f"{self.name} exited during start-up ({START_ATTEMPTS} tries):\n{self.log_tail()}")

    def _start_once(self, argv: list[str], timeout: float, env: dict[str, str] | None) -> dict[str, str]:
        port, metrics_port = free_ports(2)
        cmd = specd_command(*argv, "--host", "0.0.0.0")
        cmd += ["--port", str(port), "--metrics-port", str(metrics_port)]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, process_group=0, preexec_fn=die_with_parent
            )
        ip = node_ip()
        self.address, self.metrics_address = f"{ip}:{port}", f"{ip}:{metrics_port}"
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            while True:
                if self.proc.poll() is not None:
                    raise _ExitedDuringStartup(self.name)
                try:
                    grpc.channel_ready_future(ch).result(timeout=1.0)
                    break
                except grpc.FutureTimeoutError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}") from None
        return {"address": self.address, "metrics": self.metrics_address, "pid": str(self.proc.pid)}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the service (it finishes its shutdown), SIGKILL after ``grace`` seconds."""
        p, self.proc = self.proc, None
        if p is not None:
            stop_process_group(p, grace=grace)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class GatewayHost:
    """The gateway's FastAPI app served by uvicorn on the current event loop (the body of GatewayActor)."""

    def __init__(self) -> None:
        self.server = None
        self.task: asyncio.Task | None = None
        self.app = None

    async def start(self, settings) -> str:
        import uvicorn

        from specd.gateway.app import create_app

        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host=settings.host, port=settings.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it (e.g. the port is taken)
                raise RuntimeError("the gateway stopped during start-up")
            await asyncio.sleep(0.05)
        return f"http://{node_ip()}:{settings.port}"

    async def set_targets(self, addresses: list[str]) -> list[str]:
        return list(self.app.state.pool.set_addresses(tuple(addresses)))

    async def draining_requests(self) -> int:
        """Requests still running on targets that have left the pool."""
        return sum(t.outstanding for t in self.app.state.pool.draining)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            await self.task


ServiceActor = ray.remote(ServiceHost)
GatewayActor = ray.remote(GatewayHost)
