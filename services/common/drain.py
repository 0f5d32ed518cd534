"""Graceful drain, shared by every specd process.

The first SIGTERM (or SIGINT) starts a drain: readiness turns NOT_SERVING, new work is refused at
once (HTTP 503, gRPC UNAVAILABLE), and work already running gets up to ``timeout`` seconds to
finish; then the process exits with status 0. A second signal stops at once. Kubernetes'
``terminationGracePeriodSeconds`` and compose's ``stop_grace_period`` must exceed the timeout.
"""

from __future__ import annotations

import time

DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds; as Kubernetes' default grace period


class Drain:
    """The drain state of one process: started from a signal handler, read from any thread."""

    def __init__(self, timeout: float = DEFAULT_DRAIN_TIMEOUT) -> None:
        if timeout < 0:
            raise ValueError("--drain-timeout must be >= 0")
        self.timeout = timeout
        self._deadline: float | None = None

    def begin(self) -> bool:
        """Start draining; True the first time, False if a drain was already under way."""
        # No lock: this runs in signal handlers, which a lock held by the interrupted code would
        # deadlock; signal handlers run one at a time on the main thread.
        if self._deadline is not None:
            return False
        self._deadline = time.monotonic() + self.timeout
        return True

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def expired(self) -> bool:
        """The drain has run out of time (in-flight work is then cut off)."""
        return self._deadline is not None and time.monotonic() >= self._deadline
