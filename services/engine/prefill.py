"""Chunked prefill: which prompts go into one batched prefill pass, and running that pass.

A long prompt is prefilled a chunk at a time between decode rounds (vLLM's and TGI's chunked
prefill), so running streams wait for one chunk, not for the whole prompt. Several prompts share a
pass: rows are right-padded to the longest piece, and the padded pass costs at most ``budget``
token slots, so a chunk's cost stays about the same whatever the mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.services.engine.transfer import to_device

# The largest prefill pass (``--prefill-chunk``): an idle engine prefills a 2,000-token prompt in 4.
DEFAULT_PREFILL_CHUNK = 512
# While sequences decode, a pass takes about as many tokens as the decode round verifies, but at
# least this many (README, "Long prompts": on the demo target a 16-token pass costs about two
# batch-1 rounds, a 64-token pass about one batch-16 round at k = 3).
MIN_PREFILL_CHUNK = 16


def chunk_budget(max_chunk: int, decode_tokens: int) -> int:
    """Tokens of the next prefill pass: ``max_chunk`` when nothing decodes (nobody waits for the
    pass), else about the decode round's own token count, so a pass costs about a round or two
    whatever the batch: ``min(max_chunk, max(MIN_PREFILL_CHUNK, decode_tokens))``."""
    if decode_tokens <= 0:
        return max_chunk
    return min(max_chunk, max(MIN_PREFILL_CHUNK, decode_tokens))


def sliced_budget(budget: int, seconds_per_token: float | None, slice_seconds: float | None) -> int:
    """``budget`` capped so that the pass takes about ``slice_seconds`` at the measured
    ``seconds_per_token``, never below MIN_PREFILL_CHUNK; MIN_PREFILL_CHUNK while nothing is measured
    yet; ``budget`` itself where no slice is set."""
    if slice_seconds is None:
        return budget
    if seconds_per_token is None or seconds_per_token <= 0.0:
        return min(budget, MIN_PREFILL_CHUNK)
    return min(budget, max(MIN_PREFILL_CHUNK, int(slice_seconds / seconds_per_token)))


@dataclass(frozen=True)
class PrefillRow:
    """One sequence's piece of a pass: ``ids`` go to positions ``start..start+len(ids)-1`` of ``slot``."""

    slot: int
    start: int
    ids: Sequence[int]


def plan_chunk(remaining: Sequence[int], budget: int) -> list[int]:
    """Tokens each waiting prompt prefills in the next pass (0 = not in it), first come first.

    The first prompt always gets ``min(remaining, budget)``; later ones join while the padded pass
    (rows x longest piece) stays within ``budget``.
    """
    take = [0] * len(remaining)
    rows, width = 0, 0
    for i, r in enumerate(remaining):
        if r <= 0:
            continue
        n = min(r, budget)
        w = max(width, n)
        if rows and (rows + 1) * w > budget:
            break
        take[i], rows, width = n, rows + 1, w
    return take


def prefill_pass(model, cache, rows: Sequence[PrefillRow]) -> None:
    """One batched forward writing every row's K/V (no logits: the last prompt token is fed by the
    first decode round, as the cache invariant wants). Padded positions land in the row's own
    not-yet-valid positions or in the pool's scratch block."""
    T = max(len(r.ids) for r in rows)
    inp = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        inp[i, : len(r.ids)] = torch.as_tensor(r.ids, dtype=torch.long)
    lengths = [len(r.ids) for r in rows]
    layout = cache.layout([r.slot for r in rows], [r.start for r in rows], T, model.device, lengths)
    model.forward(to_device(inp, model.device), cache, layout, "none")
