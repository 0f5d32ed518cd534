"""The draft service's model side: sequences keyed by (stream, id), batched proposals, rollback.

No gRPC here: the servicer converts messages to these dataclasses and back. One worker owns one
:class:`ModelDrafter` and is only ever called from one thread, so it needs no locks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specd.services.draft.ahead import AheadLane, Claim, Offer
from specd.services.engine.drafters import DraftRow, ModelDrafter
from specd.services.engine.prefill import DEFAULT_PREFILL_CHUNK, chunk_budget, sliced_budget
from specd.services.engine.sampling import BatchSampling, SamplingParams
from specd.services.engine.sparse import to_sparse

# The weight of the past in the measured seconds per prefilled token: a pass or two adapts the
# slices to a draft that shares its cores with a busy target.
PREFILL_RATE_DECAY = 0.5


class BlockError(enum.Enum):
    """Why a row gets no guesses, or a sequence is not opened (the wire's DraftError says what the
    target does about each)."""

    NONE = 0
    UNKNOWN_SEQUENCE = 1
    OUT_OF_SYNC = 2
    CONTEXT_FULL = 3
    NO_CAPACITY = 4
    DRAINING = 5
    INVALID_CONTEXT = 6


@dataclass(frozen=True)
class OpenSeq:
    seq_id: str
    token_ids: list[int]  # every committed token so far
    params: SamplingParams
    cache_salt: str = ""  # the request's prefix-cache salt


@dataclass(frozen=True)
class ProposeReq:
    seq_id: str
    num_accepted: int
    new_token_ids: list[int]
    committed_length: int
    k: int
    round_seed: int
    next_round_seed: int = 0  # the seed the sequence's next round will carry (for drafting ahead)
    offer_taken: bool = False  # the target verifies the block this draft offered for this outcome


@dataclass
class BlockOut:
    seq_id: str
    token_ids: list[int] = field(default_factory=list)
    sparse_ids: list[np.ndarray] = field(default_factory=list)  # per guess, for sampled rows
    sparse_probs: list[np.ndarray] = field(default_factory=list)
    error: BlockError = BlockError.NONE
    # "fresh", "prepared" (drafted ahead, complete), "continued" (finished this round) or "offered"
    # (drafted ahead, sent before the round and taken by the target)
    source: str = "fresh"
    # per guess its likeliest replacements, likeliest first (when drafting ahead)
    alternatives: list[list[int]] = field(default_factory=list)
    prefilling: bool = False  # no guesses: the draft has not prefilled the context yet (not a failed guess)


@dataclass
class _State:
    tokens: list[int]
    params: SamplingParams


class DraftWorker:
    """Runs rounds of open / release / propose for any number of streams on one model."""

    def __init__(
        self,
        drafter: ModelDrafter,
        max_len: int,
        support: int,
        max_k: int,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefill_slice: float | None = None,
    ) -> None:
        """``prefill_chunk``: prompt tokens prefilled per round (chunked prefill), so opening a long
        prompt delays the other sequences' blocks by one chunk, not by the whole prompt.
        ``prefill_slice``: seconds a prefill pass may take at the speed this worker measures on
        its own passes (None: passes are sized by tokens alone). A round that arrives while the
        draft prefills waits for the pass in flight: sized by tokens alone, a pass of 512 took the
        real pair's draft 2.9 s on one thread, past the target's round timeout."""
        self.drafter = drafter
        self.prefill_chunk = prefill_chunk
        self.prefill_slice = prefill_slice
        self._seconds_per_token: float | None = None  # of prefill passes, decayed (PREFILL_RATE_DECAY)
        # Prompt tokens prefilled since start; a round's share tells the target that its time was
        # not all drafting (DraftBlocks.prefilled_tokens).
        self.prefilled_tokens = 0
        self.max_len = max_len
        self.support = support
        self.max_k = max_k
        self.vocab = drafter.vocab_size
        self.states: dict[str, _State] = {}
        self.lanes: dict[str, AheadLane] = {}  # per stream: the blocks it prepares between rounds

    @staticmethod
    def key(stream: str, seq_id: str) -> str:
        return f"{stream}/{seq_id}"

    @property
    def active(self) -> int:
        return len(self.states)

    def release(self, stream: str, seq_id: str) -> bool:
        k = self.key(stream, seq_id)
        if self.states.pop(k, None) is None:
            return False
        self._forget(k)
        return True

    def release_stream(self, stream: str) -> int:
        """Forget every sequence of a closed stream; returns how many were freed."""
        prefix = f"{stream}/"
        keys = [k for k in self.states if k.startswith(prefix)]
        for k in keys:
            self.states.pop(k)
            self._forget(k)
        lane = self.lanes.pop(stream, None)
        if lane is not None:
            lane.drop_all()
        return len(keys)

    def _forget(self, key: str) -> None:
        lane = self.lanes.get(key.split("/", 1)[0])
        if lane is not None:
            lane.drop(key)
        self.drafter.remove(key)

    # ------------------------------------------------------------------ drafting ahead

    def lane(self, stream: str) -> AheadLane:
        lane = self.lanes.get(stream)
        if lane is None:
            lane = self.lanes[stream] = AheadLane(self.drafter, self.support, self.max_k, self._spare_blocks)
        return lane

    def _spare_blocks(self) -> int:
        """Cache blocks prepared branches may take: all but two per held sequence (room for their
        next fresh blocks)."""
        return self.drafter.cache.free_blocks - 2 * len(self.states)

    def ahead_pending(self, stream: str) -> bool:
        """Whether the stream has prepared work left to draft (the servicer steps it between rounds)."""
        lane = self.lanes.get(stream)
        return lane is not None and lane.pending()

    def ahead_step(self, stream: str) -> bool:
        """One batched step of the stream's prepared blocks; False when there was nothing to do."""
        lane = self.lanes.get(stream)
        return lane is not None and lane.step()

    def take_offers(self, stream: str) -> list[Offer]:
        """Prepared blocks completed since the last call, to offer the target now."""
        lane = self.lanes.get(stream)
        return lane.take_offers() if lane is not None else []

    def prefill_idle(self) -> bool:
        """One chunk of the prompts still to prefill, between rounds; False when there was none.

        Targets open sequences when they admit them (services/target/draft_client.py), so the
        prompts are prefilled here while the target prefills and verifies, and a sequence's first
        round finds it ready."""
        return self._prefill(self.prefill_chunk) > 0

    def _prefill(self, budget: int) -> int:
        """One prefill pass of at most ``budget`` tokens, fewer where ``prefill_slice`` bounds its
        time; timed for the next pass's size. Returns the tokens prefilled."""
        t0 = time.perf_counter()
        n = self.drafter.prefill(sliced_budget(budget, self._seconds_per_token, self.prefill_slice))
        if n > 0:
            rate, past = (time.perf_counter() - t0) / n, self._seconds_per_token
            self._seconds_per_token = rate if past is None else past + (1 - PREFILL_RATE_DECAY) * (rate - past)
        self.prefilled_tokens += n
        return n

    def open(self, stream: str, seq: OpenSeq) -> BlockError:
        """Start a sequence; BlockError.NONE on success."""
        k = self.key(stream, seq.seq_id)
        if k in self.states:
            self.release(stream, seq.seq_id)  # a re-open after a desync starts from scratch
        if not seq.token_ids or min(seq.token_ids) < 0 or max(seq.token_ids) >= self.vocab:
            return BlockError.INVALID_CONTEXT
        if len(seq.token_ids) >= self.max_len:
            return BlockError.CONTEXT_FULL
        if self.drafter.free_slots == 0:
            for lane in self.lanes.values():  # prepared branches give their slots up first
                lane.drop_all()
        if self.drafter.free_slots == 0:
            return BlockError.NO_CAPACITY
        self.drafter.add(k, seq.token_ids, cache_salt=seq.cache_salt)
        self.states[k] = _State(list(seq.token_ids), seq.params)
        return BlockError.NONE

    @torch.inference_mode()
    def propose(self, stream: str, reqs: list[ProposeReq], ahead: bool = False, offer: bool = False) -> list[BlockOut]:
        """Apply each row's accepted count and new tokens, then propose all rows in one batch.

        A row whose outcome a prepared branch guessed gets that branch's block (services/draft/ahead.py).
        ``ahead``: after this round, prepare each row's next block while the target verifies;
        ``offer``: and send each to the target once complete (:meth:`take_offers`).
        """
        out: dict[str, BlockOut] = {}
        rows: list[DraftRow] = []
        params: list[SamplingParams] = []
        claims: list[tuple[Claim, int]] = []
        lane = self.lane(stream)
        keys = [self.key(stream, r.seq_id) for r in reqs]
        lane.round_started(set(keys))
        # Sized like the target's passes: about this round's own work (one step per guess per row).
        decoding = sum(r.k for r, k in zip(reqs, keys) if k in self.states and self.drafter.ready(k))
        self._prefill(chunk_budget(self.prefill_chunk, decoding))
        for r, k in zip(reqs, keys):
            st = self.states.get(k)
            if st is None:
                out[r.seq_id] = BlockOut(r.seq_id, error=BlockError.UNKNOWN_SEQUENCE)
                continue
            st.tokens.extend(r.new_token_ids)
            if len(st.tokens) != r.committed_length or not 0 < r.k <= self.max_k:
                # Out of sync (or a bad k): drop the sequence; the target re-opens it.
                self.release(stream, r.seq_id)
                out[r.seq_id] = BlockOut(r.seq_id, error=BlockError.OUT_OF_SYNC)
                continue
            fits = len(st.tokens) + r.k <= self.max_len
            claim = lane.claim(k, st.tokens, r.round_seed, r.k, r.offer_taken) if fits else None
            if r.offer_taken and (claim is None or not claim.ready):
                # The target verified a block this draft no longer holds whole: its cache could
                # disagree with what the target verified, so start the sequence over.
                if claim is not None and claim.branch.holder != k:
                    self.drafter.remove(claim.branch.holder)
                self.release(stream, r.seq_id)
                out[r.seq_id] = BlockOut(r.seq_id, error=BlockError.OUT_OF_SYNC)
                continue
            if claim is None:
                lane.drop(k)
                if self.drafter.has_proposed(k):
                    self.drafter.accepted(k, r.num_accepted)
            if not fits:
                # The context only grows: the target stops asking (and releases it).
                out[r.seq_id] = BlockOut(r.seq_id, error=BlockError.CONTEXT_FULL)
                continue
            if claim is not None:
                if claim.branch.holder == k:
                    self.drafter.proposed(k, len(st.tokens))
                else:
                    self.drafter.adopt(k, claim.branch.holder, len(st.tokens))
                    claim.branch.holder = k
                claims.append((claim, r.k))
                source = "offered" if r.offer_taken else "prepared" if claim.ready else "continued"
                out[r.seq_id] = BlockOut(r.seq_id, source=source)
                continue
            if not self.drafter.ready(k) and not st.params.seeded_sampling:
                # Still prefilling: no guesses this round, no error. A seeded row is drafted for
                # anyway (the draft feeds the rest of its context first), as the in-process engine
                # does: its tokens must not depend on how far this draft's prefill has got.
                out[r.seq_id] = BlockOut(r.seq_id, prefilling=True)
                continue
            greedy = st.params.greedy
            rows.append(DraftRow(k, st.tokens, r.k, greedy, None if greedy else r.round_seed))
            params.append(st.params)
            out[r.seq_id] = BlockOut(r.seq_id)
        lane.round_claimed()
        if rows:
            sampling = BatchSampling.from_params(params, self.drafter.model.device)
            prop = self.drafter.propose(rows, sampling, alternatives=ahead)
            token_ids = prop.token_ids.tolist()  # [B, K], one host copy for the whole round
            alts = prop.alternatives.tolist() if prop.alternatives is not None else None
            ids = probs = None
            if prop.probs is not None:
                ids, probs = (t.cpu().numpy() for t in to_sparse(prop.probs, self.support))  # [B, K, m]
            for i, row in enumerate(rows):
                b = out[row.seq_id.split("/", 1)[1]]
                # A row whose cache blocks ran out got no guesses (-1): it proposes nothing.
                n = sum(t >= 0 for t in token_ids[i][: row.k])
                b.token_ids = token_ids[i][:n]
                if alts is not None:
                    b.alternatives = alts[i][:n]
                if ids is not None and not row.greedy:
                    for j in range(n):
                        keep = probs[i, j] > 0.0  # the wire carries only the support
                        b.sparse_ids.append(ids[i, j][keep])
                        b.sparse_probs.append(probs[i, j][keep])
        if claims:
            lane.finish([(c, k) for c, k in claims if not c.ready])
            for c, k in claims:
                seq_id = c.plan.key.split("/", 1)[1]
                br = c.branch
                b = out[seq_id]
                b.token_ids, b.alternatives = br.tokens[:k], br.alternatives[:k]
                b.sparse_ids, b.sparse_probs = br.sparse_ids[:k], br.sparse_probs[:k]
        if ahead:
            for r, k in zip(reqs, keys):
                b = out[r.seq_id]
                st = self.states.get(k)
                # Room for the next block past a whole accepted one: else nothing to prepare for.
                if (
                    st is None
                    or b.error is not BlockError.NONE
                    or not b.token_ids
                    or len(st.tokens) + 2 * r.k + 2 > self.max_len
                ):
                    continue
                lane.plan(k, len(st.tokens), b.token_ids, b.alternatives, st.params, r.next_round_seed, offer)
        return [out[r.seq_id] for r in reqs]
