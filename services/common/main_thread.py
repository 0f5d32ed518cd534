"""Run the model on the process's main thread and gRPC's asyncio loop on a background thread.

Measured on this machine (demo target, bf16, oneDNN): the same engine decodes at ~183 tok/s when
called from the main thread and ~110 tok/s from any other thread (with or without
``torch.set_num_threads``; fp32 MKL is unaffected). The target service therefore steps its engine
on the main thread while the asyncio gRPC server, which only moves messages, runs on a helper
thread, so sending one round's tokens overlaps the next round. (Both on one event loop was tried:
a round's messages then left only after the next round unless the loop waited for every send,
which cost ~1 ms per round and 15% of throughput at 16 streams.) The draft service has no loop of
its own to run and computes inline on its main-thread event loop (services/draft/server.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from specd.services.common.drain import Drain
from specd.services.common.grpc_server import drain_then, start_server
from specd.services.common.tls import TLSConfig

log = logging.getLogger(__name__)


class MainThreadWorker:
    """Executes submitted calls, in order, on whichever thread calls :meth:`run`."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fn, args, fut))
        return fut

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Await ``fn(*args)`` run on the worker thread."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, args, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # delivered to the awaiting handler
                fut.set_exception(e)

    def stop(self) -> None:
        self._q.put(None)


def serve_with_main_thread(
    register: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    main: Callable[[], None],
    stop_main: Callable[[], None],
    ready_message: str = "",
    on_stop: Callable[[], Awaitable[None]] | None = None,
    background: Callable[[], Awaitable[None]] | None = None,
    tls: TLSConfig | None = None,
    drain: Drain | None = None,
    idle: Callable[[], bool] = lambda: True,
) -> None:
    """Serve gRPC from a background asyncio loop while ``main()`` runs here until ``stop_main()``.

    ``background``, if given, runs as a task on the gRPC loop for the server's lifetime.

    SIGTERM / SIGINT stop ``main``; then the server stops with a short grace period. With
    ``drain``, the first signal drains instead (services/common/drain.py): ``main`` is stopped once
    ``idle()`` (read on the gRPC loop) or at the drain's timeout; a second signal stops at once.
    """
    loop = asyncio.new_event_loop()
    started: concurrent.futures.Future = concurrent.futures.Future()
    holder: dict[str, Any] = {}  # "server": RunningServer, "background": asyncio.Task

    async def start() -> None:
        holder["server"] = await start_server(register, host, port, ready_message, tls)
        if background is not None:
            holder["background"] = asyncio.create_task(background())

    def io_thread() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as e:
            started.set_exception(e)
            return
        started.set_result(None)
        loop.run_forever()

    threading.Thread(target=io_thread, name="grpc-io", daemon=True).start()
    started.result()  # raises if the port could not be bound

    def on_signal(signum, frame) -> None:
        if drain is None or not drain.begin():
            stop_main()
        else:
            asyncio.run_coroutine_threadsafe(drain_then(holder["server"], drain, idle, stop_main), loop)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        main()
    finally:
        log.info("shutting down")

        async def shutdown() -> None:
            if "background" in holder:
                holder["background"].cancel()
            await holder["server"].stop(grace=2.0)
            if on_stop is not None:
                await on_stop()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        except Exception:
            log.exception("unclean gRPC shutdown")
        loop.call_soon_threadsafe(loop.stop)
