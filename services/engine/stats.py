"""Speculation counters (plain numbers; exporters turn them into metrics elsewhere).

Derived values, as dashboards compute them from the counters:
- acceptance rate = accepted_tokens / proposed_tokens
  (PromQL: ``rate(specd_spec_accepted_tokens_total[1m]) / rate(specd_spec_draft_tokens_total[1m])``)
- mean accepted length per verification = 1 + accepted_tokens / target_forward_passes
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counts for one request, or summed over many."""

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    target_forward_passes: int = 0  # verification rounds (prefill is not counted)
    emitted_tokens: int = 0
    rejections: int = 0  # rounds that ended on a rejected guess (the rest accepted all they made)
    accepted_per_position: list[int] = field(default_factory=list)  # [j] = times guess j+1 was accepted
    proposed_per_position: list[int] = field(default_factory=list)  # [j] = times guess j+1 was made
    block_tokens: int = 0  # sum over rounds of the block size k asked for (mean k = this / passes)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_block_size(self) -> float:
        """Mean k per verification (what "auto" chose; the fixed k otherwise, shortened at the end)."""
        return self.block_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    def record_round(self, proposed: int, accepted: int, emitted: int, k: int | None = None) -> None:
        """One verification of this request: ``proposed`` guesses, the first ``accepted`` kept
        (``k``: the block size asked for, when it differs from what was proposed)."""
        self.target_forward_passes += 1
        self.block_tokens += proposed if k is None else k
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        self.rejections += int(accepted < proposed)
        for per_pos, upto in ((self.proposed_per_position, proposed), (self.accepted_per_position, accepted)):
            if len(per_pos) < upto:
                per_pos.extend([0] * (upto - len(per_pos)))
            for j in range(upto):
                per_pos[j] += 1

    def merge(self, other: SpecStats) -> None:
        """Add another request's counts into this one."""
        self.proposed_tokens += other.proposed_tokens
        self.accepted_tokens += other.accepted_tokens
        self.target_forward_passes += other.target_forward_passes
        self.emitted_tokens += other.emitted_tokens
        self.rejections += other.rejections
        self.block_tokens += other.block_tokens
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.proposed_per_position, other.proposed_per_position),
        ):
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for j, v in enumerate(theirs):
                mine[j] += v

    def as_dict(self) -> dict:
        return {
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "target_forward_passes": self.target_forward_passes,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_k": round(self.mean_block_size, 3),
        }
