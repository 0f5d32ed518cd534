"""The FastAPI application: ``create_app(settings)``; the lifespan opens and closes target channels.

:func:`run` serves it with uvicorn and drains on SIGTERM (services/common/drain.py): /health turns
503 and new API requests get 503 at once while requests in flight run to their end (or to
``--drain-timeout``); then the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import ssl
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from specd.gateway.errors import install_error_handlers
from specd.gateway.guard import RequestGuard
from specd.gateway.routes import build_router
from specd.gateway.settings import GatewaySettings
from specd.gateway.target_pool import TargetPool
from specd.services.common.drain import Drain
from specd.services.common.runtime import freeze_startup_heap

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings, drain: Drain | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool = TargetPool(settings.target_addresses, settings.health_interval, tls=settings.tls)
        await pool.start()
        app.state.pool = pool
        yield
        await pool.close()

    app = FastAPI(title="specd gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.drain = drain or Drain(settings.drain_timeout)
    app.state.started = int(time.time())
    install_error_handlers(app)
    app.include_router(build_router())
    return app


def run(settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT, draining first (a second signal stops at once)."""
    import uvicorn

    drain = Drain(settings.drain_timeout)
    guard = RequestGuard(create_app(settings, drain), drain, settings.max_body_bytes)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            # Not recorded in _captured_signals: uvicorn would re-raise it at exit, and a process
            # that drained cleanly exits 0, not by the signal.
            if drain.begin():
                log.warning("draining: %d request(s) in flight, up to %.0f s", guard.in_flight, drain.timeout)
                return
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT

        async def on_tick(self, counter: int) -> bool:
            if drain.draining and (guard.in_flight == 0 or drain.expired()):
                self.should_exit = True
            return await super().on_tick(counter)

    https = {}
    if settings.ssl_certfile:
        https = {"ssl_certfile": settings.ssl_certfile, "ssl_keyfile": settings.ssl_keyfile}
        if settings.ssl_ca_certs:
            https |= {"ssl_ca_certs": settings.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    scheme = "https" if https else "http"
    print(f"specd gateway listening on {scheme}://{settings.host}:{settings.port}", flush=True)
    config = uvicorn.Config(
        guard,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=3,  # after the drain: what is still running then is cut off
        **https,
    )
    freeze_startup_heap()
    DrainingServer(config).run()
