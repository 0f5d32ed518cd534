"""DNS discovery rules: which addresses expand into one endpoint per replica, and re-resolution."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from specd.services.common import discovery
from specd.services.common.discovery import AddressWatcher, resolve, resolve_all, split_host_port


def _fake_dns(monkeypatch: pytest.MonkeyPatch, table: dict[str, list[str]]) -> None:
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [
            (socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
            for ip in table[host]
        ]

    monkeypatch.setattr(discovery.socket, "getaddrinfo", getaddrinfo)


def test_split_host_port() -> None:
    assert split_host_port("draft:50051") == ("draft", 50051)
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    for bad in ("draft", ":50051", "draft:port", ""):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_a_name_with_several_records_is_several_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(monkeypatch, {"draft": ["10.0.0.7", "10.0.0.3", "10.0.0.5"]})
    assert resolve("draft:50051") == ["10.0.0.3:50051", "10.0.0.5:50051", "10.0.0.7:50051"]


def test_names_that_stay_names(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(
        monkeypatch,
        {
            "single": ["10.0.0.2"],
            "localhost": ["127.0.0.1", "::1"],
            "dual": ["10.0.0.9", "fd00::9"],  # one host with A and AAAA records is one replica
        },
    )
    assert resolve("single:1") == ["single:1"]  # gRPC resolves it, and follows it if it moves
    assert resolve("localhost:1") == ["localhost:1"]
    assert resolve("dual:1") == ["dual:1"]
    assert resolve("not-up-yet:1") == ["not-up-yet:1"]  # left to gRPC, which keeps retrying
    assert resolve("10.1.2.3:1") == ["10.1.2.3:1"]


def test_ipv6_only_replicas_are_bracketed(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(monkeypatch, {"t": ["fd00::2", "fd00::1"]})
    assert resolve("t:50052") == ["[fd00::1]:50052", "[fd00::2]:50052"]


def test_resolve_all_deduplicates_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(monkeypatch, {"draft": ["10.0.0.1", "10.0.0.2"]})
    assert resolve_all(["10.0.0.2:5", "draft:5", "x:6"]) == ("10.0.0.2:5", "10.0.0.1:5", "x:6")


def test_watcher_reports_scale_changes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"draft": ["10.0.0.1", "10.0.0.2"]}
    _fake_dns(monkeypatch, table)
    seen: list[tuple[str, ...]] = []
    watcher = AddressWatcher(("draft:50051",), seen.append, interval=0.01)
    assert watcher.endpoints == ("10.0.0.1:50051", "10.0.0.2:50051")

    async def scenario() -> None:
        task = asyncio.create_task(watcher.run())
        await asyncio.sleep(0.1)  # several re-resolutions, no change: nothing reported
        table["draft"] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]  # docker compose up --scale draft=3
        await asyncio.sleep(0.1)
        assert watcher.set_addresses(("10.9.9.9:1",)) == ("10.9.9.9:1",)
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(scenario())
    assert seen == [("10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"), ("10.9.9.9:1",)]


def test_a_resolution_overtaken_by_set_addresses_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    # The watcher's periodic lookup of the old addresses is still in flight when set_addresses
    # replaces them; its late answer must not flip the replicas back to the old ones.
    table = {"draft": ["10.0.0.1"]}
    _fake_dns(monkeypatch, table)
    started, release = threading.Event(), threading.Event()
    real = discovery.resolve_all

    def slow_for_old(addresses: tuple[str, ...]) -> tuple[str, ...]:
        if addresses == ("draft:50051",) and threading.current_thread() is not threading.main_thread():
            table["draft"] = ["10.0.0.1", "10.0.0.2"]  # a change, so a stale answer would be reported
            started.set()
            release.wait(5)
        return real(addresses)

    monkeypatch.setattr(discovery, "resolve_all", slow_for_old)
    seen: list[tuple[str, ...]] = []
    watcher = AddressWatcher(("draft:50051",), seen.append, interval=0.01, endpoints=("10.0.0.1:50051",))

    async def scenario() -> None:
        task = asyncio.create_task(watcher.run())
        while not started.is_set():
            await asyncio.sleep(0.005)
        watcher.set_addresses(("10.9.9.9:1",))
        release.set()
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(scenario())
    assert seen == [("10.9.9.9:1",)]
    assert watcher.endpoints == ("10.9.9.9:1",)
