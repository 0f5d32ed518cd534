"""What every specd gRPC service shares: channel/server options and the metrics port."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specd.services.common.drain import Drain
from specd.services.common.tls import TLSConfig

# Candidate blocks with sparse q and prompts of a full context stay far below this; it only guards
# against a runaway message.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keep long-lived draft streams alive through idle periods and notice dead peers.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]
# Clients also reconnect to a restarted peer within half a second (gRPC's default backoff grows to
# two minutes, which left a restarted draft reported as down long after it was back).
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def start_metrics_server(port: int | None) -> None:
    """Expose the default Prometheus registry on http://0.0.0.0:port/metrics (no-op for None)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)


class RunningServer:
    """A started gRPC server with the standard ``grpc.health.v1`` service.

    The health service lets Kubernetes' native ``grpc:`` probes, load balancers and
    ``grpc_health_probe`` check a specd service without a client of our own protos. It reports
    SERVING from start until :meth:`stop`, which turns it to NOT_SERVING first so that probes see
    the shutdown before connections close. (The richer ``Health`` RPC of each specd service, which
    the gateway uses, also reports whether a target's drafts are reachable.)
    """

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, port: int) -> None:
        self.server = server
        self.health = health_servicer
        self.port = port

    async def stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    ready_message: str = "",
    tls: TLSConfig | None = None,
) -> RunningServer:
    """Create, bind and start a server on the running loop; prints ``ready_message`` once bound.

    With ``tls`` the port speaks mutual TLS only (clients must present a certificate of its CA)."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    await health_servicer.set(health.OVERALL_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    if ready_message:
        print(ready_message.format(port=bound), flush=True)
    return RunningServer(server, health_servicer, bound)


async def drain_then(server: RunningServer, drain: Drain, idle: Callable[[], bool], then: Callable[[], None]) -> None:
    """Turn the health service NOT_SERVING, wait until ``idle()`` or the drain's timeout, then call ``then``."""
    await server.health.enter_graceful_shutdown()
    while not idle() and not drain.expired():
        await asyncio.sleep(0.05)
    then()


async def run_server(
    register: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    ready_message: str = "",
    tls: TLSConfig | None = None,
    drain: Drain | None = None,
    idle: Callable[[], bool] = lambda: True,
) -> None:
    """Serve on the running (main-thread) loop until SIGTERM or SIGINT, then stop gracefully.

    With ``drain``, the first signal drains (services/common/drain.py) until ``idle()``; a second
    one stops at once."""
    server = await start_server(register, host, port, ready_message, tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []

    def on_signal() -> None:
        if drain is None or not drain.begin():
            stop.set()
        else:
            tasks.append(loop.create_task(drain_then(server, drain, idle, stop.set)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    for t in tasks:
        t.cancel()
    await server.stop(grace=2.0)
