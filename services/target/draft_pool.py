"""The target's draft endpoints as its gRPC side sees them: discovery, SetDrafts and health.

The drafter that talks to them (:class:`~specd.services.target.draft_client.RemoteDrafter`) lives on
the engine thread. This pool re-resolves the configured addresses (DNS names expand to one endpoint
per replica), takes new addresses from SetDrafts, and hands every change to the drafter through
the engine loop; their health is the drafter's own stream state (:class:`StreamStates`), read here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from specd.services.common.discovery import AddressWatcher, split_host_port
from specd.services.target.draft_client import StreamStates

log = logging.getLogger(__name__)


class DraftPool:
    """Draft endpoints for one target. ``apply`` gets every new endpoint list (on the gRPC loop:
    it must only hand the list over, e.g. with ``EngineLoop.call``)."""

    def __init__(
        self,
        addresses: tuple[str, ...],
        endpoints: tuple[str, ...],
        apply: Callable[[tuple[str, ...]], None],
        states: StreamStates,
        discovery_interval: float = 5.0,
    ) -> None:
        """``endpoints``: what ``addresses`` resolved to when the drafter was built."""
        self.apply = apply
        self.states = states
        self.watcher = AddressWatcher(addresses, apply, discovery_interval, endpoints=endpoints)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.watcher.endpoints

    def set_addresses(self, addresses: tuple[str, ...]) -> tuple[str, ...]:
        """Speculate with these drafts from now on; returns the endpoints they resolved to.
        ValueError for an empty list or an address that is not HOST:PORT."""
        if not addresses:
            raise ValueError("at least one draft address is needed")
        for a in addresses:
            split_host_port(a)
        endpoints = self.watcher.set_addresses(addresses)
        log.info("draft services set to %s", ",".join(endpoints))
        return endpoints

    def health(self) -> tuple[int, int]:
        """(endpoints with a stream up and taking sequences, endpoints)."""
        endpoints = self.endpoints
        return self.states.count(endpoints), len(endpoints)

    async def run(self) -> None:
        """Re-resolve the addresses until cancelled."""
        await self.watcher.run()
