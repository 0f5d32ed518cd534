"""The target's client of remote draft services: a :class:`Drafter` over gRPC.

Each draft endpoint gets one long-lived bidirectional ``Draft`` stream carrying every sequence the
target assigned to it, so the draft batches them. A round sends, per sequence, only what the draft
has not seen: how many of its last guesses were accepted and the tokens committed since. Sequences
are opened lazily (in the first round that wants guesses) and released in-band.

Faults never reach the engine: if an endpoint is down, times out or answers out of sync, its rows
simply get no guesses this round (the target decodes them without speculation), its sequences are
marked for re-opening, and the endpoint is retried with backoff. ``on_failure`` is told each time.

Used only from the engine thread, except for one reader thread per stream.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from specd.services.common.convert import sampling_to_pb
from specd.services.common.grpc_server import CHANNEL_OPTIONS
from specd.services.common.tls import TLSConfig, channel
from specd.services.engine.drafters import DraftRow, Proposal
from specd.services.engine.sampling import BatchSampling, SamplingParams, draw_seed, make_generator
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

# Drafting ahead is off unless asked for (--draft-ahead on): it pays when the draft has cores of its
# own (specd serve --pin-cores, separate machines); on shared cores its extra steps take the
# target's cycles. README, "Drafting ahead", has the measurements this default rests on.
DRAFT_AHEAD_DEFAULT = False


@dataclass(frozen=True)
class DraftClientConfig:
    addresses: tuple[str, ...]
    round_timeout: float = 2.0  # seconds to wait for a round's blocks before decoding without them
    retry_initial: float = 0.25  # backoff after a failure, doubling up to retry_max
    retry_max: float = 4.0
    tls: TLSConfig | None = None  # mutual TLS to the drafts (None: plaintext)
    # Ask the drafts to draft each sequence's next block while this target verifies
    # (services/draft/ahead.py); the output is the same either way.
    draft_ahead: bool = DRAFT_AHEAD_DEFAULT


@dataclass(frozen=True)
class DraftRoundReport:
    """What one round of remote guesses cost the target, for its metrics."""

    wait_seconds: float  # from sending the round to the last reply (or the timeout)
    blocks: dict[str, int]  # blocks received by source: "fresh", "prepared", "continued"


BLOCK_SOURCE_NAMES = {
    draft_pb2.BLOCK_SOURCE_UNSPECIFIED: "fresh",  # a draft that does not say (an older one) drafted it fresh
    draft_pb2.BLOCK_SOURCE_FRESH: "fresh",
    draft_pb2.BLOCK_SOURCE_PREPARED: "prepared",
    draft_pb2.BLOCK_SOURCE_CONTINUED: "continued",
}


class _Stream:
    """One open Draft call: requests go in through a queue, a reader thread collects replies."""

    def __init__(self, stub: draft_pb2_grpc.DraftServiceStub) -> None:
        self.requests: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.broken = threading.Event()
        self.call = stub.Draft(iter(self.requests.get, None))
        self.reader = threading.Thread(target=self._read, daemon=True, name="draft-stream-reader")
        self.reader.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.put(reply)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                log.warning("draft stream failed: %s", e.code())
        finally:
            self.broken.set()
            self.replies.put(None)

    def send(self, msg: draft_pb2.DraftRound) -> None:
        self.requests.put(msg)

    def receive(self, round_id: int, deadline: float) -> draft_pb2.DraftBlocks | None:
        """The reply to ``round_id`` (replies to fire-and-forget rounds are skipped), or None."""
        while True:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return None
            try:
                reply = self.replies.get(timeout=timeout)
            except queue.Empty:
                return None
            if reply is None:
                return None
            if reply.round_id == round_id:
                return reply

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


class DraftEndpoint:
    """One draft service address, with its stream (if any) and the sequences it holds."""

    def __init__(self, address: str, cfg: DraftClientConfig) -> None:
        self.address = address
        self.cfg = cfg
        self.channel = channel(address, cfg.tls, CHANNEL_OPTIONS)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.stream: _Stream | None = None
        self.opened: set[str] = set()  # sequences the draft holds on the current stream
        self.retry_at = 0.0
        self.backoff = cfg.retry_initial
        self.assigned = 0  # sequences routed here (open or not)

    @property
    def up(self) -> bool:
        return self.stream is not None and not self.stream.broken.is_set()

    def usable(self) -> bool:
        """Up, or down long enough that it is worth trying again."""
        return self.up or time.monotonic() >= self.retry_at

    def ensure_stream(self) -> bool:
        if self.up:
            return True
        if time.monotonic() < self.retry_at:
            return False
        self.stream = _Stream(self.stub)
        self.opened.clear()
        return True

    def fail(self) -> None:
        """Drop the stream; its sequences must be re-opened; retry after a growing backoff."""
        if self.stream is not None:
            self.stream.close()
        self.stream = None
        self.opened.clear()
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, self.cfg.retry_max)

    def succeeded(self) -> None:
        self.backoff = self.cfg.retry_initial

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        self.opened.clear()
        self.channel.close()


@dataclass
class _SeqState:
    endpoint: DraftEndpoint
    sampling: common_pb2.SamplingParams  # what the draft needs to build the same q as the target's p
    known: int = 0  # committed tokens the draft has seen
    num_accepted: int = 0  # of the last proposal, to report next round
    # The sequence's round seeds (sampled rows): a stream of its own, seeded once from the request's
    # draft stream, so the next round's seed is known a round early (a draft drafting ahead needs
    # it) and every seed still comes from the request's own seeded stream.
    seeds: torch.Generator | None = None
    next_seed: int = 0


class RemoteDrafter:
    """A :class:`~specd.services.engine.drafters.Drafter` backed by one or more draft services."""

    def __init__(
        self,
        cfg: DraftClientConfig,
        vocab_size: int,
        device: torch.device | str = "cpu",
        on_failure: Callable[[str], None] | None = None,
        on_round: Callable[[DraftRoundReport], None] | None = None,
    ) -> None:
        if not cfg.addresses:
            raise ValueError("at least one draft address is needed")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.on_failure = on_failure or (lambda address: None)
        self.on_round = on_round or (lambda report: None)
        self.blocks_by_source = {"fresh": 0, "prepared": 0, "continued": 0}  # since start, for tests and tools
        self.endpoints = [DraftEndpoint(a, cfg) for a in cfg.addresses]
        self.seqs: dict[str, _SeqState] = {}
        self._round_ids = itertools.count(1)

    # ------------------------------------------------------------------ Drafter protocol

    def add(self, seq_id: str, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self.seqs[seq_id] = _SeqState(self._pick(), sampling_to_pb(params or SamplingParams()))
        self.seqs[seq_id].endpoint.assigned += 1

    def prefill(self, budget: int) -> None:
        pass  # each draft service prefills its sequences itself, a chunk per round

    def ready(self, seq_id: str) -> bool:
        return True  # a draft still prefilling answers with an empty block: no guesses that round

    def accepted(self, seq_id: str, num_accepted: int) -> None:
        st = self.seqs.get(seq_id)
        if st is not None:
            st.num_accepted = num_accepted

    def remove(self, seq_id: str) -> None:
        st = self.seqs.pop(seq_id, None)
        if st is None:
            return
        st.endpoint.assigned -= 1
        ep = st.endpoint
        if seq_id in ep.opened and ep.up:
            ep.opened.discard(seq_id)
            # Sent now, not with the next round: with no other traffic the draft must still free it.
            ep.stream.send(draft_pb2.DraftRound(round_id=0, release=[seq_id]))

    def propose(self, rows: Sequence[DraftRow], sampling: BatchSampling | None) -> Proposal:
        K = max(r.k for r in rows)
        token_ids = torch.full((len(rows), K), -1, dtype=torch.long)
        any_sampled = any(not r.greedy for r in rows)
        probs = torch.zeros((len(rows), K, self.vocab_size), device=self.device) if any_sampled else None
        by_ep: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            st = self.seqs[r.seq_id]
            if not st.endpoint.usable():
                self._reassign(r.seq_id)
            by_ep.setdefault(id(self.seqs[r.seq_id].endpoint), []).append(i)
        # Send every endpoint its round first, then collect: the drafts work in parallel.
        pending: list[tuple[DraftEndpoint, int, list[int]]] = []
        for idx in by_ep.values():
            ep = self.seqs[rows[idx[0]].seq_id].endpoint
            if not ep.ensure_stream():
                continue
            round_id = next(self._round_ids)
            ep.stream.send(self._round_msg(ep, round_id, [rows[i] for i in idx]))
            pending.append((ep, round_id, idx))
        t0 = time.monotonic()
        deadline = t0 + self.cfg.round_timeout
        blocks = dict.fromkeys(self.blocks_by_source, 0)
        for ep, round_id, idx in pending:
            reply = ep.stream.receive(round_id, deadline) if ep.stream is not None else None
            if reply is None:
                self._failed(ep)
                continue
            ep.succeeded()
            self._fill(reply, {rows[i].seq_id: i for i in idx}, rows, token_ids, probs, blocks)
        if pending:
            for source, n in blocks.items():
                self.blocks_by_source[source] += n
            self.on_round(DraftRoundReport(time.monotonic() - t0, blocks))
        # Only as wide as what arrived: with every draft down the target verifies a single token.
        width = int((token_ids >= 0).sum(dim=1).max())
        if width == 0:
            return Proposal(token_ids[:, :0].to(self.device), None)
        return Proposal(token_ids[:, :width].to(self.device), None if probs is None else probs[:, :width])

    # ------------------------------------------------------------------ internals

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Speculate with exactly these draft services from now on (replicas scaled or re-resolved).

        Kept endpoints keep their streams. Sequences on a removed endpoint move to the others and
        are re-opened there with their full context at their next round, so nothing in flight is
        lost: at worst one round goes without guesses. Closing the removed stream frees the
        draft's copies. An empty list is ignored (a scaled-to-zero draft pool is "no speculation",
        which a request can ask for itself).
        """
        if not addresses:
            log.warning("ignoring an empty draft address list; keeping %d draft(s)", len(self.endpoints))
            return
        wanted = list(dict.fromkeys(addresses))
        current = {e.address: e for e in self.endpoints}
        gone = [e for e in self.endpoints if e.address not in wanted]
        self.endpoints = [current.get(a) or DraftEndpoint(a, self.cfg) for a in wanted]
        for e in gone:
            e.close()
        for seq_id, st in self.seqs.items():
            if st.endpoint in gone:
                self._reassign(seq_id)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(e.address for e in self.endpoints)

    def _pick(self) -> DraftEndpoint:
        """The usable endpoint with the fewest sequences (any endpoint if none is usable)."""
        candidates = [e for e in self.endpoints if e.usable()] or self.endpoints
        return min(candidates, key=lambda e: e.assigned)

    def _reassign(self, seq_id: str) -> None:
        st = self.seqs[seq_id]
        new = self._pick()
        if new is not st.endpoint:
            st.endpoint.assigned -= 1
            st.endpoint.opened.discard(seq_id)
            new.assigned += 1
            self.seqs[seq_id] = _SeqState(new, st.sampling, seeds=st.seeds, next_seed=st.next_seed)

    def _round_msg(self, ep: DraftEndpoint, round_id: int, rows: list[DraftRow]) -> draft_pb2.DraftRound:
        msg = draft_pb2.DraftRound(round_id=round_id, draft_ahead=self.cfg.draft_ahead)
        for r in rows:
            st = self.seqs[r.seq_id]
            seed = next_seed = 0
            if r.generator is not None:
                if st.seeds is None:
                    st.seeds = make_generator(draw_seed(r.generator))
                    st.next_seed = draw_seed(st.seeds)
                seed, st.next_seed = st.next_seed, draw_seed(st.seeds)
                next_seed = st.next_seed
            if r.seq_id not in ep.opened:
                msg.open.add(sequence_id=r.seq_id, token_ids=r.tokens, sampling=st.sampling)
                ep.opened.add(r.seq_id)
                st.known, st.num_accepted = len(r.tokens), 0
            msg.rows.add(
                sequence_id=r.seq_id,
                num_accepted=st.num_accepted,
                new_token_ids=r.tokens[st.known :],
                committed_length=len(r.tokens),
                num_tokens=r.k,
                round_seed=seed,
                next_round_seed=next_seed,
            )
            st.known, st.num_accepted = len(r.tokens), 0
        return msg

    def _fill(
        self, reply, index: dict[str, int], rows, token_ids: torch.Tensor, probs: torch.Tensor | None, blocks
    ) -> None:
        for b in reply.blocks:
            i = index.get(b.sequence_id)
            if i is None:
                continue
            if b.error:
                # The draft dropped (or never opened) it: open it again next round.
                self.seqs[b.sequence_id].endpoint.opened.discard(b.sequence_id)
                continue
            n = min(len(b.token_ids), rows[i].k)
            if n == 0:
                continue
            if probs is not None and not rows[i].greedy:
                if len(b.probs) < n:
                    continue  # a sampled row without its q cannot be verified losslessly
                for j in range(n):
                    d = b.probs[j]
                    probs[i, j, torch.tensor(d.token_ids, dtype=torch.long)] = torch.tensor(list(d.probs))
            token_ids[i, :n] = torch.tensor(b.token_ids[:n], dtype=torch.long)
            blocks[BLOCK_SOURCE_NAMES.get(b.source, "fresh")] += 1

    def _failed(self, ep: DraftEndpoint) -> None:
        log.warning("draft %s did not answer; decoding without its guesses", ep.address)
        ep.fail()
        self.on_failure(ep.address)

    @property
    def healthy_endpoints(self) -> int:
        return sum(e.up for e in self.endpoints)

    def close(self) -> None:
        for e in self.endpoints:
            e.close()
