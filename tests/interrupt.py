"""A pytest plugin: SIGTERM stops the run as an interrupt, so fixtures are torn down first.

A SIGTERM (a CI time-out, `kill PID`) otherwise ends pytest at once, and the gRPC servers and
gateways that fixtures started in process groups of their own outlive it. As a KeyboardInterrupt,
pytest stops the run and tears the fixtures down, and they stop what they started."""

from __future__ import annotations

import signal

import pytest


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _interrupted)
