"""What every specd gRPC service shares: channel/server options and the metrics port."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc

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


async def start_server(
    register: Callable[[grpc.aio.Server], None], host: str, port: int, ready_message: str = ""
) -> grpc.aio.Server:
    """Create, bind and start a server on the running loop; prints ``ready_message`` once bound."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    register(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    if ready_message:
        print(ready_message.format(port=bound), flush=True)
    return server


async def run_server(
    register: Callable[[grpc.aio.Server], None], host: str, port: int, ready_message: str = ""
) -> None:
    """Serve on the running (main-thread) loop until SIGTERM or SIGINT, then stop gracefully."""
    server = await start_server(register, host, port, ready_message)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)
