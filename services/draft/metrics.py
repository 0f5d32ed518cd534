"""Prometheus collectors of the draft service (the only module-level state it has)."""

from prometheus_client import Counter, Gauge, Histogram

from specd.services.common.constants import BLOCK_SOURCES

DRAFT_BLOCK_SECONDS = Histogram(
    "specd_draft_block_seconds",
    "Model time to propose one round of candidate blocks (all sequences of the round)",
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0),
)
DRAFT_SEQUENCES = Gauge("specd_draft_sequences", "Sequences with state (KV cache slot) on this draft service")
DRAFT_BLOCKS = Counter(
    "specd_draft_blocks",
    "Blocks of guesses sent, by how they were made: fresh (drafted when the round came), prepared "
    "(drafted ahead, complete) or continued (drafted ahead in part, finished when the round came)",
    ["source"],
)
for _source in BLOCK_SOURCES:
    DRAFT_BLOCKS.labels(source=_source)  # exported as 0 from the start
DRAFT_AHEAD_STEP_SECONDS = Histogram(
    "specd_draft_ahead_step_seconds",
    "One batched model step of drafting ahead (every prepared branch of a stream), between rounds",
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256),
)
