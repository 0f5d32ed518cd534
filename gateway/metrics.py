"""Prometheus collectors of the gateway, and the per-request timer that feeds them.

Time between tokens: the target emits each verified block as one chunk, so a chunk of n tokens
arriving ``dt`` after the previous one counts as n gaps of ``dt / n`` (one observation per token).
The first chunk: time to first token once, then its other tokens at (time to first chunk) / n.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

_LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)

TIME_TO_FIRST_TOKEN = Histogram(
    "specd_time_to_first_token_seconds",
    "From request arrival to the first generated token leaving the gateway",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24),
)
TIME_BETWEEN_TOKENS = Histogram(
    "specd_time_between_tokens_seconds",
    "Gap per emitted token (a chunk of n tokens counts as n gaps of its interval / n)",
    buckets=_LATENCY_BUCKETS,
)
REQUEST_SECONDS = Histogram(
    "specd_request_seconds",
    "Whole request, arrival to last byte",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
)
REQUESTS = Counter("specd_requests", "Requests by outcome (HTTP status, or 'cancelled')", ["status"])
GENERATED_TOKENS = Counter("specd_generated_tokens", "Completion tokens sent to clients")


class TokenTimer:
    """Per-request latency bookkeeping."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.tokens = 0

    def chunk(self, n: int, now: float | None = None) -> None:
        """A chunk of ``n`` tokens was handed to the client just now (or at ``now``, perf_counter)."""
        if n <= 0:
            return
        now = time.perf_counter() if now is None else now
        if self.last is None:
            TIME_TO_FIRST_TOKEN.observe(now - self.start)
            per = (now - self.start) / n
            for _ in range(n - 1):
                TIME_BETWEEN_TOKENS.observe(per)
        else:
            per = (now - self.last) / n
            for _ in range(n):
                TIME_BETWEEN_TOKENS.observe(per)
        self.last = now
        self.tokens += n
        GENERATED_TOKENS.inc(n)

    def finish(self, status: str) -> None:
        REQUEST_SECONDS.observe(time.perf_counter() - self.start)
        REQUESTS.labels(status=status).inc()
