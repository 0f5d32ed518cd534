"""The gateway's view of its target replicas: channels, health, and least-outstanding selection.

Replicas come from ``--target-address``; a DNS name with several address records is several
replicas, re-resolved periodically (services/common/discovery.py), and a deployment can replace the
list at run time (:meth:`TargetPool.set_addresses`). A replica that leaves the list stops getting
new requests; its channel is closed once its last request has finished.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from specd.services.common.discovery import AddressWatcher
from specd.services.common.grpc_server import CHANNEL_OPTIONS
from specd.services.common.tls import TLSConfig, aio_channel
from specd.v1 import common_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


class TargetClient:
    """One target replica."""

    def __init__(self, address: str, tls: TLSConfig | None = None) -> None:
        self.address = address
        self.channel = aio_channel(address, tls, CHANNEL_OPTIONS)
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

    def __init__(
        self,
        addresses: tuple[str, ...],
        health_interval: float,
        discovery_interval: float = 5.0,
        tls: TLSConfig | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("at least one target address is needed")
        self.tls = tls
        self.watcher = AddressWatcher(addresses, self._endpoints_changed, discovery_interval)
        self.targets = [TargetClient(a, tls) for a in self.watcher.endpoints]
        self.draining: list[TargetClient] = []  # removed, still finishing requests
        self.health_interval = health_interval
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [asyncio.create_task(self._probe_forever()), asyncio.create_task(self.watcher.run())]

    def set_addresses(self, addresses: tuple[str, ...]) -> tuple[str, ...]:
        """Serve from exactly these targets from now on; returns the endpoints they resolved to.

        Call on the gateway's event loop. In-flight requests on removed targets run to the end.
        """
        if not addresses:
            raise ValueError("at least one target address is needed")
        return self.watcher.set_addresses(addresses)

    def _endpoints_changed(self, endpoints: tuple[str, ...]) -> None:
        current = {t.address: t for t in self.targets}
        self.draining += [t for t in self.targets if t.address not in endpoints]
        self.targets = [current.get(a) or TargetClient(a, self.tls) for a in endpoints]
        # New replicas count as healthy only once probed: probe now rather than at the next tick.
        asyncio.get_running_loop().create_task(self.refresh())

    async def refresh(self) -> None:
        await asyncio.gather(*(t.probe() for t in self.targets))
        done = [t for t in self.draining if t.outstanding == 0]
        self.draining = [t for t in self.draining if t.outstanding > 0]
        for t in done:
            await t.channel.close()

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.refresh()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for t in self.targets + self.draining:
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
