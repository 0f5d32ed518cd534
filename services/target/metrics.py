"""Prometheus collectors of the target service and the exporter that feeds them from engine rounds.

The engine keeps plain counters (:class:`SpecStats`, :class:`RoundInfo`); this module is the only
place that knows about Prometheus. Derived values for dashboards:
- acceptance rate: ``rate(specd_spec_accepted_tokens_total[1m]) / rate(specd_spec_draft_tokens_total[1m])``
- mean accepted length per verification:
  ``1 + rate(specd_spec_accepted_tokens_total[1m]) / rate(specd_spec_verifications_total[1m])``
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

from specd.services.common.constants import BLOCK_SOURCES
from specd.services.engine.engine import DRAFTER_LABELS, StepOutput
from specd.services.target.draft_client import DraftRoundReport

DRAFT_TOKENS = Counter("specd_spec_draft_tokens", "Draft tokens proposed and verified")
ACCEPTED_TOKENS = Counter("specd_spec_accepted_tokens", "Draft tokens the target accepted")
VERIFICATIONS = Counter(
    "specd_spec_verifications", "Per-sequence verifications (one per sequence per batched target pass)"
)
ACCEPTED_PER_POSITION = Counter(
    "specd_spec_accepted_tokens_per_position",
    "Accepted draft tokens by their position in the block (0 = first guess)",
    ["position"],
)
ACCEPTANCE_RATE = Gauge(
    "specd_spec_acceptance_rate", "Accepted / proposed draft tokens over the last minute of verifications"
)
VERIFY_SECONDS = Histogram(
    "specd_verify_seconds",
    "Target forward pass + verification of one batched round",
    buckets=(0.001, 0.002, 0.004, 0.006, 0.008, 0.012, 0.016, 0.024, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0),
)
DRAFT_ROUND_SECONDS = Histogram(
    "specd_draft_round_seconds",
    "Time the target waited for one round of guesses (draft model + network, or n-gram lookup)",
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0),
)
BATCH_SIZE = Histogram(
    "specd_batch_size", "Sequences verified together in one target pass", buckets=(1, 2, 4, 8, 12, 16, 24, 32, 64)
)
BLOCK_SIZE = Histogram(
    "specd_spec_block_size",
    "Guesses asked for per sequence per round: what the auto controller chose (0: no speculation), "
    "or the fixed method's k",
    buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16),
)
ROWS_WITHOUT_SPECULATION = Counter(
    "specd_spec_rows_without_speculation",
    "Per-sequence verifications that verified no guess (k = 0, or the drafter had none)",
)
VERIFICATIONS_BY_DRAFTER = Counter(
    "specd_spec_verifications_by_drafter",
    "Per-sequence verifications by who made the guesses (draft, ngram, or none)",
    ["drafter"],
)
for _label in DRAFTER_LABELS:
    VERIFICATIONS_BY_DRAFTER.labels(drafter=_label)  # exported as 0 from the start
REQUESTS_RUNNING = Gauge("specd_requests_running", "Requests admitted or queued on this target")
KV_SLOTS_USED = Gauge("specd_kv_slots_used", "Target KV cache slots holding a sequence (0 when idle: nothing leaked)")
REQUESTS_REJECTED = Counter(
    "specd_requests_rejected",
    "Generate calls refused before admission (queue_full: running and waiting at capacity)",
    ["reason"],
)
DRAFT_WAIT_SECONDS = Histogram(
    "specd_draft_wait_seconds",
    "Time the target waited for a draft service's guesses in one round (from sending the round's "
    "outcome to the last reply); a draft drafting ahead answers a guessed outcome at once",
    buckets=(0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0),
)
DRAFT_BLOCKS_RECEIVED = Counter(
    "specd_spec_draft_blocks",
    "Per-sequence blocks of guesses received from draft services, by how the draft made them: fresh "
    "(when the round came), prepared (drafted ahead, complete) or continued (drafted ahead in part); "
    "share served by a prepared block: (prepared + continued) / all",
    ["source"],
)
for _source in BLOCK_SOURCES:
    DRAFT_BLOCKS_RECEIVED.labels(source=_source)  # exported as 0 from the start
PROMPT_TOKENS = Counter("specd_prompt_tokens", "Prompt tokens of the requests admitted")
PREFIX_CACHE_HIT_TOKENS = Counter(
    "specd_prefix_cache_hit_tokens",
    "Prompt tokens whose K/V the target's prefix cache held at admission (not prefilled again); "
    "hit rate: rate(specd_prefix_cache_hit_tokens_total[5m]) / rate(specd_prompt_tokens_total[5m])",
)
DRAFT_FAILURES = Counter(
    "specd_draft_failures",
    "Rounds in which a draft endpoint failed or timed out (decoded without guesses)",
    ["endpoint"],
)

WINDOW_SECONDS = 60.0


class SpecExporter:
    """Turns each round's outputs into metric updates; keeps the acceptance-rate window."""

    def __init__(self, window_seconds: float = WINDOW_SECONDS) -> None:
        self.window_seconds = window_seconds
        self._window: deque[tuple[float, int, int]] = deque()  # (time, proposed, accepted)
        self._proposed = 0
        self._accepted = 0
        self._prompt_tokens = 0
        self._cached_prompt_tokens = 0

    def record_round(self, outputs: list[StepOutput], batch_size: int, draft_s: float, verify_s: float) -> None:
        """One batched target pass and what each of its sequences produced."""
        VERIFY_SECONDS.observe(verify_s)
        DRAFT_ROUND_SECONDS.observe(draft_s)
        BATCH_SIZE.observe(batch_size)
        now = time.monotonic()
        proposed = accepted = 0
        for out in outputs:
            if out.finish_reason == "abort":
                continue  # evicted, not verified
            VERIFICATIONS.inc()
            BLOCK_SIZE.observe(out.k)
            VERIFICATIONS_BY_DRAFTER.labels(drafter=out.drafter).inc()
            if out.proposed == 0:
                ROWS_WITHOUT_SPECULATION.inc()
            proposed += out.proposed
            accepted += out.accepted
            for j in range(out.accepted):
                ACCEPTED_PER_POSITION.labels(position=str(j)).inc()
        DRAFT_TOKENS.inc(proposed)
        ACCEPTED_TOKENS.inc(accepted)
        self._window.append((now, proposed, accepted))
        self._proposed += proposed
        self._accepted += accepted
        while self._window and self._window[0][0] < now - self.window_seconds:
            _, p, a = self._window.popleft()
            self._proposed -= p
            self._accepted -= a
        if self._proposed:
            ACCEPTANCE_RATE.set(self._accepted / self._proposed)

    def record_prompts(self, prompt_tokens: int, cached_prompt_tokens: int) -> None:
        """The engine's running totals of admitted prompt tokens and prefix-cache hits (called every
        round; the counters move only when a request was admitted)."""
        if prompt_tokens == self._prompt_tokens:
            return
        PROMPT_TOKENS.inc(prompt_tokens - self._prompt_tokens)
        PREFIX_CACHE_HIT_TOKENS.inc(cached_prompt_tokens - self._cached_prompt_tokens)
        self._prompt_tokens, self._cached_prompt_tokens = prompt_tokens, cached_prompt_tokens

    @staticmethod
    def set_running(n: int) -> None:
        REQUESTS_RUNNING.set(n)

    @staticmethod
    def set_kv_slots(n: int) -> None:
        KV_SLOTS_USED.set(n)


def record_draft_round(report: DraftRoundReport) -> None:
    """One round of remote guesses: the target's wait, and how each block was made (engine thread)."""
    DRAFT_WAIT_SECONDS.observe(report.wait_seconds)
    for source, n in report.blocks.items():
        if n:
            DRAFT_BLOCKS_RECEIVED.labels(source=source).inc(n)
