"""Service discovery by DNS: a name with several address records is several replicas.

``docker compose up --scale draft=3`` and a Kubernetes headless Service both publish one A record
per replica under the service name, so ``--draft-address draft:50051`` names every draft there is.
gRPC's own resolver would pick one of them per channel (pick_first); the target instead wants one
stream per replica, so it resolves names itself and re-resolves them periodically
(:class:`AddressWatcher`), and the gateway does the same for targets.

A name that resolves to a single address, or only to loopback, is kept as written: gRPC resolves it
at connect time, which also covers a service that is not up yet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); raises ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def resolve(address: str) -> list[str]:
    """The replica endpoints behind one ``host:port`` (see the module docstring for the rules)."""
    host, port = split_host_port(address)
    try:
        ipaddress.ip_address(host)
        return [address]  # already an address
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return [address]  # not resolvable (yet): leave it to gRPC, which keeps retrying
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
    # A host with both an A and an AAAA record is one replica, not two: prefer IPv4.
    ips = v4 or v6
    if len(ips) <= 1 or all(ipaddress.ip_address(ip).is_loopback for ip in ips):
        return [address]
    return [_join(ip, port) for ip in ips]


def resolve_all(addresses: Iterable[str]) -> tuple[str, ...]:
    """Every endpoint behind every address, without duplicates, in a stable order."""
    out: dict[str, None] = {}
    for a in addresses:
        for endpoint in resolve(a):
            out[endpoint] = None
    return tuple(out)


class AddressWatcher:
    """Re-resolves a list of addresses every ``interval`` seconds on an asyncio loop.

    ``on_change`` gets the new endpoint tuple whenever it differs from the last one. The addresses
    themselves can be replaced at run time (:meth:`set_addresses`), which re-resolves at once.
    """

    def __init__(
        self,
        addresses: tuple[str, ...],
        on_change: Callable[[tuple[str, ...]], None],
        interval: float = 5.0,
        endpoints: tuple[str, ...] | None = None,
    ) -> None:
        """``endpoints``: what ``addresses`` already resolved to, if the caller has it (else resolved here)."""
        self.addresses = addresses
        self.on_change = on_change
        self.interval = interval
        self.endpoints: tuple[str, ...] = resolve_all(addresses) if endpoints is None else endpoints
        self._wake: asyncio.Event | None = None

    async def run(self) -> None:
        """Watch until cancelled."""
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except TimeoutError:
                pass
            self._wake.clear()
            addresses = self.addresses
            # getaddrinfo blocks; keep it off the event loop.
            endpoints = await loop.run_in_executor(None, resolve_all, addresses)
            # set_addresses may have replaced the addresses while that ran: its own resolution is the
            # newer one, and reporting this stale one would flip the replicas back and forth.
            if addresses is self.addresses:
                self._update(endpoints)

    def _update(self, endpoints: tuple[str, ...]) -> None:
        if endpoints != self.endpoints:
            log.info("replicas changed: %s -> %s", ",".join(self.endpoints), ",".join(endpoints))
            self.endpoints = endpoints
            self.on_change(endpoints)

    def set_addresses(self, addresses: tuple[str, ...]) -> tuple[str, ...]:
        """Replace the watched addresses; returns their endpoints (resolved now, on this thread)."""
        self.addresses = addresses
        self._update(resolve_all(addresses))
        if self._wake is not None:
            self._wake.set()
        return self.endpoints
