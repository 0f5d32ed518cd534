"""The FastAPI application: ``create_app(settings)``; the lifespan opens and closes target channels."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.errors import install_error_handlers
from gateway.routes import build_router
from gateway.settings import GatewaySettings
from gateway.target_pool import TargetPool


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool = TargetPool(settings.target_addresses, settings.health_interval)
        await pool.start()
        app.state.pool = pool
        yield
        await pool.close()

    app = FastAPI(title="specd gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.started = int(time.time())
    install_error_handlers(app)
    app.include_router(build_router())
    return app


def run(settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn handles both gracefully)."""
    import uvicorn

    print(f"specd gateway listening on http://{settings.host}:{settings.port}", flush=True)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=3,
    )
