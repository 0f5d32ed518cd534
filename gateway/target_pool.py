"""The gateway's view of its target replicas: channels, health, and least-outstanding selection."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.grpc_server import CHANNEL_OPTIONS
from specd.v1 import common_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


class TargetClient:
    """One target replica."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self.info: common_pb2.InfoResponse | None = None
        self.healthy = False
        self.drafts_healthy = 0
        self.drafts_total = 0
        self.outstanding = 0

    async def probe(self, timeout: float = 1.5) -> None:
        try:
            h = await self.stub.Health(common_pb2.HealthRequest(), timeout=timeout)
            if self.info is None:
                self.info = await self.stub.Info(common_pb2.InfoRequest(), timeout=timeout)
            self.healthy = h.serving
            self.drafts_healthy, self.drafts_total = h.draft_endpoints_healthy, h.draft_endpoints_total
        except grpc.RpcError as e:
            if self.healthy:
                log.warning("target %s unhealthy: %s", self.address, e.code())
            self.healthy = False

    @property
    def fully_healthy(self) -> bool:
        """Serving, and (if it has drafts) at least one of them reachable."""
        return self.healthy and (self.drafts_total == 0 or self.drafts_healthy > 0)


class TargetPool:
    """All target replicas; probes them in the background."""

    def __init__(self, addresses: tuple[str, ...], health_interval: float) -> None:
        if not addresses:
            raise ValueError("at least one target address is needed")
        self.targets = [TargetClient(a) for a in addresses]
        self.health_interval = health_interval
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._probe_forever())

    async def refresh(self) -> None:
        await asyncio.gather(*(t.probe() for t in self.targets))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in self.targets:
            await t.channel.close()

    def candidates(self) -> list[TargetClient]:
        """Healthy targets, least outstanding requests first (all targets if none looks healthy:
        the health view may be stale, and trying is cheap: a dead target fails fast)."""
        healthy = [t for t in self.targets if t.healthy] or list(self.targets)
        return sorted(healthy, key=lambda t: t.outstanding)

    def model_name(self) -> str | None:
        for t in self.targets:
            if t.info is not None:
                return t.info.model_name
        return None

    def info(self) -> common_pb2.InfoResponse | None:
        for t in self.targets:
            if t.info is not None:
                return t.info
        return None
