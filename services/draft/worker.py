"""The draft service's model side: sequences keyed by (stream, id), batched proposals, rollback.

No gRPC here: the servicer converts messages to these dataclasses and back. One worker owns one
:class:`ModelDrafter` and is only ever called from one thread, so it needs no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specd.services.engine.drafters import DraftRow, ModelDrafter
from specd.services.engine.prefill import DEFAULT_PREFILL_CHUNK, chunk_budget
from specd.services.engine.sampling import BatchSampling, SamplingParams, make_generator
from specd.services.engine.sparse import to_sparse


@dataclass(frozen=True)
class OpenSeq:
    seq_id: str
    token_ids: list[int]  # every committed token so far
    params: SamplingParams


@dataclass(frozen=True)
class ProposeReq:
    seq_id: str
    num_accepted: int
    new_token_ids: list[int]
    committed_length: int
    k: int
    round_seed: int


@dataclass
class BlockOut:
    seq_id: str
    token_ids: list[int] = field(default_factory=list)
    sparse_ids: list[np.ndarray] = field(default_factory=list)  # per guess, for sampled rows
    sparse_probs: list[np.ndarray] = field(default_factory=list)
    error: str = ""


@dataclass
class _State:
    tokens: list[int]
    params: SamplingParams


class DraftWorker:
    """Runs rounds of open / release / propose for any number of streams on one model."""

    def __init__(
        self, drafter: ModelDrafter, max_len: int, support: int, max_k: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    ) -> None:
        """``prefill_chunk``: prompt tokens prefilled per round (chunked prefill), so opening a long
        prompt delays the other sequences' blocks by one chunk, not by the whole prompt."""
        self.drafter = drafter
        self.prefill_chunk = prefill_chunk
        self.max_len = max_len
        self.support = support
        self.max_k = max_k
        self.vocab = drafter.vocab_size
        self.states: dict[str, _State] = {}

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
        self.drafter.remove(k)
        return True

    def release_stream(self, stream: str) -> int:
        """Forget every sequence of a closed stream; returns how many were freed."""
        prefix = f"{stream}/"
        keys = [k for k in self.states if k.startswith(prefix)]
        for k in keys:
            self.states.pop(k)
            self.drafter.remove(k)
        return len(keys)

    def release_anywhere(self, seq_id: str) -> bool:
        """Release a sequence id on whichever stream holds it (the Release RPC)."""
        keys = [k for k in self.states if k.split("/", 1)[1] == seq_id]
        for k in keys:
            self.states.pop(k)
            self.drafter.remove(k)
        return bool(keys)

    def open(self, stream: str, seq: OpenSeq) -> str:
        """Start a sequence; returns an error message, or "" on success."""
        k = self.key(stream, seq.seq_id)
        if k in self.states:
            self.release(stream, seq.seq_id)  # a re-open after a desync starts from scratch
        if not seq.token_ids:
            return "empty context"
        if len(seq.token_ids) >= self.max_len:
            return f"context of {len(seq.token_ids)} tokens exceeds the draft's {self.max_len}"
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= self.vocab:
            return "token id outside the draft's vocabulary"
        if self.drafter.free_slots == 0:
            return "draft out of cache slots"
        self.drafter.add(k, seq.token_ids)
        self.states[k] = _State(list(seq.token_ids), seq.params)
        return ""

    @torch.inference_mode()
    def propose(self, stream: str, reqs: list[ProposeReq]) -> list[BlockOut]:
        """Apply each row's accepted count and new tokens, then propose all rows in one batch."""
        out: dict[str, BlockOut] = {}
        rows: list[DraftRow] = []
        params: list[SamplingParams] = []
        # Sized like the target's passes: about this round's own work (one step per guess per row).
        keys = [self.key(stream, r.seq_id) for r in reqs]
        decoding = sum(r.k for r, k in zip(reqs, keys) if k in self.states and self.drafter.ready(k))
        self.drafter.prefill(chunk_budget(self.prefill_chunk, decoding))
        for r in reqs:
            k = self.key(stream, r.seq_id)
            st = self.states.get(k)
            if st is None:
                out[r.seq_id] = BlockOut(r.seq_id, error="unknown sequence")
                continue
            if self.drafter.has_proposed(k):
                self.drafter.accepted(k, r.num_accepted)
            st.tokens.extend(r.new_token_ids)
            if len(st.tokens) != r.committed_length or not 0 < r.k <= self.max_k:
                # Out of sync (or a bad k): drop the sequence; the target re-opens it.
                self.release(stream, r.seq_id)
                out[r.seq_id] = BlockOut(r.seq_id, error="out of sync: re-open the sequence")
                continue
            if len(st.tokens) + r.k > self.max_len:
                out[r.seq_id] = BlockOut(r.seq_id, error="context limit reached")
                continue
            if not self.drafter.ready(k):
                out[r.seq_id] = BlockOut(r.seq_id)  # still prefilling: no guesses this round, no error
                continue
            greedy = st.params.greedy
            gen = None if greedy else make_generator(r.round_seed)  # on the CPU: sampling.py says why
            rows.append(DraftRow(k, st.tokens, r.k, greedy, gen))
            params.append(st.params)
            out[r.seq_id] = BlockOut(r.seq_id)
        if rows:
            sampling = BatchSampling.from_params(params, self.drafter.model.device)
            prop = self.drafter.propose(rows, sampling)
            token_ids = prop.token_ids.tolist()  # [B, K], one host copy for the whole round
            ids = probs = None
            if prop.probs is not None:
                ids, probs = (t.cpu().numpy() for t in to_sparse(prop.probs, self.support))  # [B, K, m]
            for i, row in enumerate(rows):
                b = out[row.seq_id.split("/", 1)[1]]
                b.token_ids = token_ids[i][: row.k]
                if ids is not None and not row.greedy:
                    for j in range(row.k):
                        keep = probs[i, j] > 0.0  # the wire carries only the support
                        b.sparse_ids.append(ids[i, j][keep])
                        b.sparse_probs.append(probs[i, j][keep])
        return [out[r.seq_id] for r in reqs]
