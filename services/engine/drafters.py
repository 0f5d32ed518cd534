"""Drafters: who guesses the next k tokens.

Both implement one small interface (:class:`Drafter`). The engine hands them :class:`DraftRow` s,
one per sequence that speculates this round, and gets back a :class:`Proposal`:
``token_ids [B, K]`` with -1 where a row has no guess, and ``probs [B, K, V]`` (the proposal
distributions) or ``None`` for point-mass proposals.

- :class:`ModelDrafter`: a small LM with its own KV cache. Its cache keeps the sequence's committed
  tokens; after verification it is rolled back to the longest prefix the target accepted.
- :class:`NGramDrafter`: prompt lookup (no model). It finds the most recent earlier occurrence of
  the context's last n tokens and proposes what followed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specd.services.common.constants import CATCH_UP_TOKENS
from specd.services.engine.kv_cache import DEFAULT_KV_BLOCK_SIZE, DEFAULT_KV_CACHE_MEMORY, pool_blocks
from specd.services.engine.model import CausalLM
from specd.services.engine.prefill import PrefillRow, plan_chunk, prefill_pass
from specd.services.engine.sampling import (
    BatchSampling,
    SamplingParams,
    argmax_last,
    processed_probs,
    sample_from,
    uniforms,
)
from specd.services.engine.sparse import SparseProbs, truncate_probs
from specd.services.engine.transfer import to_device
from specd.services.engine.warmup import warm_up


@dataclass
class DraftRow:
    """One sequence asking for guesses this round."""

    seq_id: str
    tokens: list[int]  # every committed token, prompt included; the last one is not yet in any cache
    k: int
    greedy: bool
    seed: int | None = None  # sampled rows of a model drafter: this round's seed for the guesses


@dataclass
class Proposal:
    """Guesses for a batch of rows, padded to the longest k with -1."""

    token_ids: torch.Tensor  # [B, K] long
    # [B, K, V] float32, the same sparse (a remote draft's, as it came), or None for point-mass guesses
    probs: torch.Tensor | SparseProbs | None
    # [B, K, ALTERNATIVES] long: per position the draft's likeliest tokens other than its guess,
    # likeliest first (the likeliest replacements if the target rejects it), when asked for; a draft
    # service drafting ahead prepares for them.
    alternatives: torch.Tensor | None = None
    # Committed tokens the drafter fed this round beyond each row's usual CATCH_UP_TOKENS (rows
    # catching up after rounds they sat out): auto's cost model prices them apart from the guesses
    # (CostModel.d_catch).
    caught_up: int = 0
    # False when a draft service also had to prefill a prompt in the round (a sequence opened at
    # its first ask, or not yet prefilled): that round is left out of auto's cost fit. Fitted, the
    # first such round inflated the fit's level, steps included, and on the real pair auto stopped
    # asking at batch 1, so sequences stopped being opened at admission, and every ask after that
    # prefilled a whole context: it never came back (mean k 0.1).
    timed: bool = True
    # Rows (indices into the rows proposed for) that got no guesses because a draft service is
    # still prefilling their context: nobody guessed for them, which is not a failed guess (auto
    # would otherwise turn the draft down for a request whose prompt the target found cached).
    prefilling: frozenset[int] = frozenset()


class Drafter(Protocol):
    """What the engine needs from a drafter."""

    def add(
        self,
        seq_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str = "",
        prefill_ahead: bool = True,
    ) -> None:
        """Start tracking a sequence (``params``: its sampling, for drafters that need it up front;
        ``cache_salt``: the request's prefix-cache salt, for drafters with a prefix cache;
        ``prefill_ahead``: whether the engine expects to ask for its guesses soon, so that a drafter
        which prefills prompts ahead of their first proposal, beside the target, does it for this
        one; without, the prompt is fed at the first proposal, if any)."""

    def propose(self, rows: Sequence[DraftRow], sampling: BatchSampling | None) -> Proposal:
        """Guess up to ``row.k`` tokens for each row (``sampling`` matters only to model drafters)."""

    def accepted(self, seq_id: str, num_accepted: int) -> None:
        """Verification kept the first ``num_accepted`` guesses of the last proposal."""

    def remove(self, seq_id: str) -> None:
        """Forget a sequence and free what it held."""

    def prefill(self, budget: int) -> None:
        """Prefill up to ``budget`` prompt tokens of the sequences added since (chunked prefill)."""

    def ready(self, seq_id: str) -> bool:
        """Whether the sequence can be proposed for (its prompt is prefilled)."""

    def unseen(self, seq_id: str, length: int) -> int:
        """Of the sequence's ``length`` committed tokens, how many the drafter has not fed: its next
        proposal feeds them first (1 or 2 after a round it drafted; more after rounds it sat out)."""

    def close(self) -> None:
        """Release what the drafter holds outside this process (streams, channels); idempotent."""


# Replacement tokens a proposal names per guess (Proposal.alternatives). Two, not one: on the demo
# pair's greedy code, the target's token at a rejection was the draft's second likeliest in 78% of
# rounds at k = 3 (with the all-accepted rounds' two likeliest bonus tokens) and its second or third
# in 88% (ranks of the target's tokens under the draft, rounds replayed from its greedy output).
# Three prepared 87% of rounds in the serve benchmark but finished too late to be offered in half
# of them (docs/benchmarks.md, drafting ahead).
ALTERNATIVES = 2


def other_than(top: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``top`` [..., n + 1] (each row's likeliest tokens, likeliest first) without ``chosen`` [...]:
    [..., n], in the same order; where chosen is not among them, the last one goes instead."""
    n = top.shape[-1] - 1
    keep = top != chosen.unsqueeze(-1)
    last = torch.arange(n + 1, device=top.device) == n
    keep &= ~(keep.all(dim=-1, keepdim=True) & last)
    return top[keep].view(*top.shape[:-1], n)


def other_than_list(top: list[int], chosen: int) -> list[int]:
    """:func:`other_than` for one row held on the host (a drafting-ahead step has its rows' tokens
    there already, and the tensor version's eight small ops cost a sixth of its step)."""
    rest = [t for t in top if t != chosen]
    return rest[: len(top) - 1]


def likeliest(logits: torch.Tensor, n: int = ALTERNATIVES) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [B, V] -> (``logits.argmax(-1)`` [B], the ``n + 1`` likeliest tokens [B, n + 1],
    likeliest first) from one top-k pass over the vocabulary instead of a top-k and an argmax (each
    ~0.1 ms at 10 rows of the demo draft's 8192 on one CPU thread, a tenth of a drafting-ahead
    step). Where the two likeliest tie, top-k may order them otherwise than argmax (the lowest
    index), so those rows take argmax itself: the greedy guess is argmax's in every case."""
    values, top = logits.topk(n + 1, dim=-1)
    best = top[:, 0]
    tied = values[:, 0] == values[:, 1]
    # On an accelerator without asking whether any row tied (a host sync); on a CPU only if one did.
    if logits.device.type != "cpu" or bool(tied.any()):
        best = torch.where(tied, argmax_last(logits), best)
    return best, top


def _pad(rows: list[list[int]], width: int) -> torch.Tensor:
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


class NGramIndex:
    """Where each n-gram (``min_n <= n <= max_n``) of one growing token sequence last occurred.

    Brought up to date with the tokens appended since the last lookup, so a round's lookup costs
    O(max_n) whatever the context's length (a scan of the context costs O(length) every round).
    Contract: the sequence only grows by appending (an engine's committed tokens do).
    """

    __slots__ = ("min_n", "max_n", "length", "after")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.length = 0  # tokens seen; the n-grams ending before the last of them are indexed
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> the position right after its latest occurrence

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """The up-to-k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        L = len(tokens)
        if L < self.length:  # not the sequence this index was built on: start again
            self.length, self.after = 0, {}
        after = self.after
        # Occurrences end before the suffix's own end: index the n-grams ending at L - 2 at most.
        for end in range(max(self.length - 1, 0), L - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                after[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self.length = L
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = after.get(tuple(tokens[L - n :]))
            if start is not None:
                return list(tokens[start : start + k])
        return []


class NGramDrafter:
    """Prompt-lookup decoding: match the last n tokens (n from ``max_n`` down to ``min_n``).

    Lookups for a known sequence (``seq_id``) use an :class:`NGramIndex` kept per sequence until
    :meth:`remove`."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NGramIndex] = {}

    def add(
        self,
        seq_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str = "",
        prefill_ahead: bool = True,
    ) -> None:
        pass  # the context travels in each DraftRow; an index is made at the first lookup

    def remove(self, seq_id: str) -> None:
        self._indexes.pop(seq_id, None)

    def accepted(self, seq_id: str, num_accepted: int) -> None:
        pass

    def prefill(self, budget: int) -> None:
        pass

    def ready(self, seq_id: str) -> bool:
        return True

    def unseen(self, seq_id: str, length: int) -> int:
        return 0  # it reads the context as it is

    def close(self) -> None:
        pass

    def lookup(self, tokens: Sequence[int], k: int, seq_id: str | None = None) -> list[int]:
        """The up-to-k tokens that followed the latest earlier occurrence of the longest matching
        suffix (of at least ``min_n`` tokens); with ``seq_id``, from that sequence's index (without,
        from an index made for this call)."""
        if seq_id is None:
            return NGramIndex(self.min_n, self.max_n).lookup(tokens, k)
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NGramIndex(self.min_n, self.max_n)
        return index.lookup(tokens, k)

    def propose(self, rows: Sequence[DraftRow], sampling: BatchSampling | None = None) -> Proposal:
        guesses = [self.lookup(r.tokens, r.k, r.seq_id) if r.k > 0 else [] for r in rows]
        # Only as wide as the longest match: no match anywhere means a plain one-token target step.
        width = max((len(g) for g in guesses), default=0)
        return Proposal(_pad(guesses, width), None)


@dataclass
class _DraftSeq:
    slot: int
    cache_len: int  # positions of the draft cache holding committed tokens
    fed_until: int = 0  # cache positions written by the last proposal (committed or guessed)
    last_n: int = 0  # committed length when the last proposal was made
    prompt: list[int] = field(default_factory=list)  # prompt ids still to prefill up to (all but the last)
    # The committed context of the last proposal (the caller's list, which only grows): its first
    # last_n tokens are what the cache holds below last_n.
    tokens: Sequence[int] = ()


class ModelDrafter:
    """A small causal LM proposing k tokens autoregressively from its own KV cache.

    ``support`` > 0 makes sampled guesses come from the processed q truncated to its ``support``
    most likely tokens (renormalised), so q can travel sparse; the returned probs are that
    truncated q, which is what the rejection rule must see to stay lossless.
    """

    def __init__(
        self,
        model: CausalLM,
        max_slots: int,
        max_len: int,
        support: int = 0,
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        block_size: int = DEFAULT_KV_BLOCK_SIZE,
        prefix_caching: bool = False,
    ) -> None:
        """``max_len``: positions one sequence may use; ``kv_cache_memory``: bytes of the block pool
        all sequences share (a row that cannot get blocks gets no guesses, it never fails);
        ``prefix_caching``: prompts reuse the K/V of earlier sequences' full blocks where the pool
        can share them (kv_cache.BlockTable), so a shared system prompt or an earlier turn, its
        answer included, is not prefilled again."""
        self.model = model
        self.support = support
        blocks = pool_blocks(kv_cache_memory, model.kv_bytes_per_token, block_size, max_slots, max_len)
        self.cache = model.new_paged_cache(max_slots, blocks, block_size, max_len)
        self.seqs: dict[str, _DraftSeq] = {}
        if prefix_caching and self.cache.supports_prefix_caching:
            self.cache.enable_prefix_caching()

    @property
    def vocab_size(self) -> int:
        return self.model.info.vocab_size

    def add(
        self,
        seq_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str = "",
        prefill_ahead: bool = True,
    ) -> None:
        """Take a slot; the prompt is prefilled by :meth:`prefill`, a chunk at a time (after the
        longest prefix cached under ``cache_salt``), whatever ``prefill_ahead`` says: a sequence
        this drafter has not prefilled is not :meth:`ready`, so the engine would never draft for it."""
        slot = self.cache.allocate()
        # All but the last token: the last committed token is fed at the next proposal.
        prompt = list(prompt_ids[:-1])
        cached = self.cache.attach_prefix(slot, prompt, len(prompt), cache_salt)
        self.seqs[seq_id] = _DraftSeq(slot=slot, cache_len=cached, prompt=prompt)

    def ready(self, seq_id: str) -> bool:
        s = self.seqs[seq_id]
        return s.cache_len >= len(s.prompt)  # a proposal's catch-up may also have fed the prompt

    def unseen(self, seq_id: str, length: int) -> int:
        return length - min(self.seqs[seq_id].cache_len, length - 1)  # as _propose feeds them

    @torch.inference_mode()
    def prefill(self, budget: int) -> int:
        """One batched pass over the sequences still prefilling, up to ``budget`` tokens (first come
        first); returns the tokens prefilled (0: none waits, or none can get its blocks now)."""
        waiting = [s for s in self.seqs.values() if s.cache_len < len(s.prompt)]
        # A prompt takes its blocks when it starts, all at once: two half-prefilled prompts can
        # then never hold the pool between them (a prompt that holds them already gets True).
        waiting = [s for s in waiting if self.cache.reserve(s.slot, len(s.prompt) + 1)]
        if not waiting:
            return 0
        take = plan_chunk([len(s.prompt) - s.cache_len for s in waiting], budget)
        rows = [(s, n) for s, n in zip(waiting, take) if n > 0]
        prefill_pass(
            self.model,
            self.cache,
            [PrefillRow(s.slot, s.cache_len, s.prompt[s.cache_len : s.cache_len + n]) for s, n in rows],
        )
        for s, n in rows:
            s.cache_len += n
            self.cache.register(s.slot, s.prompt, s.cache_len)
            if s.cache_len == len(s.prompt):
                s.prompt = []
        return sum(n for _, n in rows)

    def remove(self, seq_id: str) -> None:
        """Free the sequence's slot. Its committed blocks stay cached (with prefix caching): the
        answer too, which a next turn's prompt repeats, as the target's engine keeps its own."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            # Positions below last_n hold committed tokens once written (a branch the draft adopted
            # may not have fed its last one yet); accepted guesses may reach past it (cache_len).
            committed = min(max(seq.cache_len, min(seq.last_n, seq.fed_until)), len(seq.tokens))
            self.cache.register(seq.slot, seq.tokens, committed)
            self.cache.release(seq.slot)

    def warm_up(self) -> None:
        """Run the model once (a prefill, a decode step), so the first proposal is not a cold one."""
        warm_up(self.model, self.cache, (1, 2))

    def accepted(self, seq_id: str, num_accepted: int) -> None:
        seq = self.seqs[seq_id]
        # Cache holds committed tokens up to last_n, then guesses d1..d_{k-1}; the first
        # num_accepted guesses are now committed, the rest are rolled back.
        seq.cache_len = min(seq.fed_until, seq.last_n + num_accepted)

    @property
    def active(self) -> int:
        return len(self.seqs)

    def close(self) -> None:
        pass  # everything it holds is in this process

    @property
    def free_slots(self) -> int:
        return self.cache.free_slots

    def has_proposed(self, seq_id: str) -> bool:
        """Whether a proposal was made for this sequence since it was added."""
        return self.seqs[seq_id].fed_until > 0

    # ------------------------------------------------------------------ prepared branches
    # A draft service drafting ahead (services/draft/ahead.py) writes past the last proposal and
    # keeps side branches in slots of their own; these keep the rollback bookkeeping right.

    def slot_of(self, seq_id: str) -> int:
        return self.seqs[seq_id].slot

    def wrote(self, seq_id: str, until: int) -> None:
        """Cache positions below ``until`` now hold guesses or committed tokens (written ahead)."""
        seq = self.seqs[seq_id]
        seq.fed_until = max(seq.fed_until, until)

    def fork(self, seq_id: str, branch_id: str, length: int) -> bool:
        """A new entry ``branch_id`` whose cache holds ``seq_id``'s first ``length`` positions
        (shared blocks, see PagedKVCache.fork). False when the cache cannot fork or is full."""
        if not self.cache.can_fork or self.cache.free_slots == 0:
            return False
        slot = self.cache.allocate()
        if not self.cache.fork(self.seqs[seq_id].slot, slot, length):
            self.cache.release(slot)
            return False
        self.seqs[branch_id] = _DraftSeq(slot=slot, cache_len=length, fed_until=length)
        return True

    def adopt(self, seq_id: str, branch_id: str, committed: int) -> None:
        """``seq_id`` continues from branch ``branch_id`` (whose block was served on a committed
        prefix of length ``committed``); its own slot is freed."""
        branch = self.seqs.pop(branch_id)
        line = self.seqs[seq_id]
        self.cache.release(line.slot)
        branch.last_n, branch.tokens = committed, line.tokens
        self.seqs[seq_id] = branch

    def proposed(self, seq_id: str, committed: int) -> None:
        """A block was served for ``seq_id`` on a committed prefix of length ``committed`` from what
        its cache holds (a prepared block of its own line)."""
        self.seqs[seq_id].last_n = committed

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], sampling: BatchSampling | None, alternatives: bool = False) -> Proposal:
        """``sampling``: the rows' settings (None when every row is greedy); ``alternatives``: also return
        each guess's likeliest replacements (Proposal.alternatives)."""
        # A row whose blocks for this proposal cannot be had (the pool is full) gets no guesses.
        # Every row writes guesses up to the widest block.
        K = max(r.k for r in rows)
        ok = [i for i, r in enumerate(rows) if self.cache.reserve(self.seqs[r.seq_id].slot, len(r.tokens) + K)]
        if len(ok) == len(rows):
            return self._propose(rows, sampling, alternatives)
        token_ids = torch.full((len(rows), K), -1, dtype=torch.long, device=self.model.device)
        if not ok:
            return Proposal(token_ids[:, :0], None)
        part = self._propose([rows[i] for i in ok], sampling.select(ok) if sampling is not None else None, alternatives)
        idx = to_device(ok, self.model.device)
        width = part.token_ids.shape[1]
        token_ids[idx, :width] = part.token_ids
        probs = alts = None
        if part.probs is not None:
            probs = torch.zeros((len(rows), width, part.probs.shape[-1]), device=self.model.device)
            probs[idx] = part.probs
        if part.alternatives is not None:
            alts = torch.full((len(rows), width, ALTERNATIVES), -1, dtype=torch.long, device=self.model.device)
            alts[idx] = part.alternatives
        return Proposal(token_ids[:, :width], probs, alts, part.caught_up)

    def _catch_up(self, pending: list[list[int]], slots: list[int], starts: list[int]) -> torch.Tensor:
        """Feed each row its committed tokens not yet in its cache (``pending[b]``, from position
        ``starts[b]``) and return the logits after each row's last one, [B, 1, V].

        A long catch-up (a row back after rounds without the draft, more than CATCH_UP_TOKENS) is
        fed without logits, in a pass of the long rows alone, and its last token with the other
        rows' usual one or two: the output head over every position of every padded row was most
        of its cost (the demo draft, 2 rows x 50 tokens: 4.1 ms with logits at every position, 1.6
        ms without), padding the short rows to the long one's length more than doubled what was
        left (one row of 48 beside three of 1-2: 3.6 ms, 1.6 ms without), and the controller prices
        a row's return to the draft by what catch-ups cost."""
        long_rows = [i for i, p in enumerate(pending) if len(p) > CATCH_UP_TOKENS]
        if long_rows:
            # A prefill pass: no logits, and its padding lands past each row's last token, where
            # the step below and the guesses write before anything attends to it.
            prefill_pass(self.model, self.cache, [PrefillRow(slots[i], starts[i], pending[i][:-1]) for i in long_rows])
            tails = [p[-1:] if len(p) > CATCH_UP_TOKENS else p for p in pending]
            starts = [st + len(p) - len(t) for st, p, t in zip(starts, pending, tails)]
            pending = tails
        device = self.model.device
        B, M = len(pending), max(len(p) for p in pending)
        inp = torch.zeros((B, M), dtype=torch.long)
        for i, p in enumerate(pending):
            inp[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        layout = self.cache.layout(slots, starts, M, device, [len(p) for p in pending])
        logits = self.model.forward(to_device(inp, device), self.cache, layout, "all")  # [B, M, V]
        last_idx = to_device([len(p) - 1 for p in pending], device)
        return logits[torch.arange(B, device=device), last_idx].unsqueeze(1)

    def _propose(
        self, rows: Sequence[DraftRow], sampling: BatchSampling | None, alternatives: bool = False
    ) -> Proposal:
        device = self.model.device
        B = len(rows)
        K = max(r.k for r in rows)
        states = [self.seqs[r.seq_id] for r in rows]
        for r, s in zip(rows, states):
            # Asked again with nothing new since the last proposal (0 accepted, no new token, which
            # a draft-service client may send): re-feed the last committed token, whose cache
            # entry is simply rewritten, so step 0 has an input instead of failing the round.
            s.cache_len = min(s.cache_len, len(r.tokens) - 1)
        slots = [s.slot for s in states]
        # Step 0 catches each cache up with the committed tokens it has not seen (usually 1, or 2
        # after a fully accepted block), right-padded; later steps feed one guess each.
        pending = [r.tokens[s.cache_len :] for r, s in zip(rows, states)]
        starts = [s.cache_len for s in states]
        greedy = to_device([r.greedy for r in rows], device)
        any_sampled = not all(r.greedy for r in rows)
        u = uniforms((K,), [r.seed for r in rows], B, device) if any_sampled else None  # [B, K]
        logits = self._catch_up(pending, slots, starts)  # [B, 1, V]
        tokens, probs, tops = [], [], []
        for j in range(K):
            if alternatives:
                best, top = likeliest(logits[:, 0])  # argmax, and the tokens the replacements come from
            else:
                best = argmax_last(logits[:, 0])
            if any_sampled:
                q = processed_probs(logits, sampling)[:, 0]  # [B, V]
                if self.support:
                    q = truncate_probs(q, self.support)
                tok = torch.where(greedy, best, sample_from(q, u[:, j]))
                probs.append(q)
            else:
                tok = best
            tokens.append(tok)
            if alternatives:
                tops.append(top)
            if j + 1 < K:
                positions = [len(r.tokens) + j for r in rows]
                layout = self.cache.layout(slots, positions, 1, device)
                logits = self.model.forward(tok.view(B, 1), self.cache, layout, "all")
        for r, s in zip(rows, states):
            s.last_n = len(r.tokens)
            s.fed_until = len(r.tokens) + K - 1
            s.tokens = r.tokens
        token_ids = torch.stack(tokens, dim=1)  # [B, K]
        ks = to_device([r.k for r in rows], device)
        token_ids = torch.where(torch.arange(K, device=device)[None, :] < ks[:, None], token_ids, -1)
        return Proposal(
            token_ids,
            torch.stack(probs, dim=1) if any_sampled else None,
            # One pass for every step's replacements (its small ops cost 0.05 ms a step on a CPU).
            other_than(torch.stack(tops, dim=1), torch.stack(tokens, dim=1)) if alternatives else None,
            sum(max(0, len(p) - CATCH_UP_TOKENS) for p in pending),
        )
