"""The target's client of remote draft services: a :class:`Drafter` over gRPC.

Each draft endpoint gets one long-lived bidirectional ``Draft`` stream carrying every sequence the
target assigned to it, so the draft batches them. A round sends, per sequence, only what the draft
has not seen: how many of its last guesses were accepted and the tokens committed since. Sequences
are opened when admitted while rows ask the draft for guesses (so it prefills them between rounds),
else in the first round that wants guesses, and released in-band.

Streams are opened as soon as an endpoint is known and wait for a draft that is not up yet; a
stream is *up* once the draft's headers arrive, and only up streams are asked for guesses, so a
draft that is down costs nothing but its guesses. That state is also the target's view of its
drafts' health (:class:`StreamStates`): there is no separate probe.

Faults never reach the engine: an endpoint that breaks its stream, times out or answers out of
sync gets no rows this round (the target decodes them without speculation), its sequences are
opened again (or on another endpoint), and it is retried with backoff; ``on_failure`` is told each
time. What a draft refuses is typed (DraftError) and acted on: a sequence whose context the draft
cannot hold is never sent again, and k is capped by the room left in the draft's context
(InfoResponse.max_context), so a draft with a shorter context than the target's drafts what fits
and then stops being asked.

Used only from the engine thread, except for one reader thread per stream and :class:`StreamStates`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from specd.services.common.affinity import Placement, competes
from specd.services.common.constants import BLOCK_SOURCES, CATCH_UP_TOKENS, DRAFT_AHEAD_DEFAULT
from specd.services.common.convert import placement_from_pb, sampling_to_pb
from specd.services.common.grpc_server import CHANNEL_OPTIONS
from specd.services.common.tls import TLSConfig, channel
from specd.services.engine.drafters import DraftRow, Proposal
from specd.services.engine.sampling import BatchSampling, SamplingParams, draw_seed, make_generator
from specd.services.engine.sparse import SparseProbs
from specd.services.engine.transfer import to_device
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

# What to do about a row the draft did not serve (DraftError).
REOPEN = (draft_pb2.DRAFT_ERROR_UNKNOWN_SEQUENCE, draft_pb2.DRAFT_ERROR_OUT_OF_SYNC)  # open it again next round
NEVER_AGAIN = (draft_pb2.DRAFT_ERROR_CONTEXT_FULL, draft_pb2.DRAFT_ERROR_INVALID_CONTEXT)  # stop asking for it
LATER = (draft_pb2.DRAFT_ERROR_NO_CAPACITY, draft_pb2.DRAFT_ERROR_DRAINING)  # open it again after a pause


def _unseen(row: draft_pb2.ProposeRow) -> int:
    """Committed tokens of a round's row that the draft has not fed yet (the accepted guesses are in
    its cache)."""
    return len(row.new_token_ids) - row.num_accepted


# A target whose rows have not asked its drafts for this many engine steps (auto has turned
# speculation off under load, say) stops opening sequences at admission: the draft would prefill
# every prompt for nothing, on cores it may share with the target. On the real pair at 16 streams on
# 2 shared cores, auto decoding almost without speculation ran at 18-19 tok/s with every prompt
# opened at admission against 19-23 opened at the first ask, `none` 25-27 (one A/B of two passes
# each; docs/benchmarks.md, "The real pair"). Such sequences are opened at their first ask, as
# when their draft was down at admission. This looks back; the engine also looks ahead, and adds
# an "auto" sequence without prefill_ahead where the controller would not draft for a batch of
# the size it joins (Engine._add_to_draft): a wave of requests after a quiet spell that drafted.
OPEN_AT_ADMISSION_WITHIN_STEPS = 8

# Offered blocks (drafting ahead) spare the target its wait only in a round where every row found
# one, which with a share p of outcomes guessed happens p ** rows of the time (p is about 0.7 on
# the demo pair's code). Past this many rows on an endpoint its rounds do not ask for them, so
# neither side pays for sending and reading them: pinned, 16 streams, demo pair, drafting ahead
# over drafting in turn was 0.96 and 0.96 with offers up to 4 rows, 0.98 and 0.99 up to 1, 1.03
# and 1.00 with none (docs/benchmarks.md, "Drafting ahead").
OFFER_MAX_ROWS = 1


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
    # With draft_ahead: the drafts send each prepared block once complete, and a round whose
    # outcome one of them assumed verifies it without waiting for the draft's answer.
    offer_prepared: bool = True


@dataclass(frozen=True)
class DraftRoundReport:
    """What one round of remote guesses cost the target, for its metrics."""

    wait_seconds: float  # from sending the round to the last reply (or the timeout); 0 when offered
    blocks: dict[str, int]  # blocks received by source: "fresh", "prepared", "continued", "offered"


BLOCK_SOURCE_NAMES = {
    draft_pb2.BLOCK_SOURCE_UNSPECIFIED: "fresh",  # a draft that does not say (an older one) drafted it fresh
    draft_pb2.BLOCK_SOURCE_FRESH: "fresh",
    draft_pb2.BLOCK_SOURCE_PREPARED: "prepared",
    draft_pb2.BLOCK_SOURCE_CONTINUED: "continued",
    draft_pb2.BLOCK_SOURCE_OFFERED: "offered",
}


class StreamStates:
    """Which draft endpoints have a stream up and taking sequences.

    The one piece of the drafter other threads see: the streams' reader threads and the engine
    thread write it, the target's Health (on its gRPC thread) reads it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._up: dict[str, object] = {}  # address -> the stream that is up there

    def up(self, address: str, stream: object) -> None:
        with self._lock:
            self._up[address] = stream

    def down(self, address: str, stream: object) -> None:
        """``stream`` is no longer up (a newer stream to the same address keeps its state)."""
        with self._lock:
            if self._up.get(address) is stream:
                del self._up[address]

    def count(self, addresses: Iterable[str]) -> int:
        with self._lock:
            return sum(a in self._up for a in addresses)


class _Stream:
    """One Draft call: requests go in through a queue, a reader thread collects replies.

    ``wait_for_ready``: while the draft is down (or not up yet) the call waits for it instead of
    failing; it is up once the draft's headers arrive (the draft sends them at once)."""

    def __init__(self, stub: draft_pb2_grpc.DraftServiceStub, address: str, states: StreamStates) -> None:
        self.address = address
        self.states = states
        self.requests: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.connected = threading.Event()
        self.broken = threading.Event()
        # Blocks the draft offered ahead of a round, by sequence: only those of its latest plan.
        self._offers: dict[str, list[draft_pb2.OfferedBlock]] = {}
        self._offers_lock = threading.Lock()
        self.call = stub.Draft(iter(self.requests.get, None), wait_for_ready=True)
        self.reader = threading.Thread(target=self._read, daemon=True, name="draft-stream-reader")
        self.reader.start()

    @property
    def up(self) -> bool:
        return self.connected.is_set() and not self.broken.is_set()

    def _read(self) -> None:
        try:
            self.call.initial_metadata()  # returns when the draft answers, or when the call ends
            if not self.call.done():
                self.connected.set()
                self.states.up(self.address, self)
            for reply in self.call:
                if reply.offered:
                    self._keep_offers(reply.offered)
                if reply.round_id:  # round 0: offers, or a fire-and-forget open or release's answer
                    self.replies.put(reply)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                log.warning("draft stream to %s failed: %s", self.address, e.code())
        finally:
            self.broken.set()
            self.states.down(self.address, self)
            self.replies.put(None)

    def _keep_offers(self, offered: Iterable[draft_pb2.OfferedBlock]) -> None:
        with self._offers_lock:
            for o in offered:
                held = self._offers.get(o.block.sequence_id)
                if held and held[0].base_length == o.base_length:
                    held.append(o)
                else:  # a newer plan's (or the first): the older ones can no longer match
                    self._offers[o.block.sequence_id] = [o]

    def take_offers(self, seq_id: str) -> list[draft_pb2.OfferedBlock]:
        """The sequence's offered blocks, forgotten here (a round makes them stale either way)."""
        with self._offers_lock:
            return self._offers.pop(seq_id, [])

    def send(self, msg: draft_pb2.DraftRound) -> None:
        self.requests.put(msg)

    def drain(self, late: Callable[[draft_pb2.DraftBlocks], None]) -> None:
        """Hand the replies already here to ``late`` (answers to rounds nobody waited for)."""
        while True:
            try:
                reply = self.replies.get_nowait()
            except queue.Empty:
                return
            if reply is None:
                self.replies.put(None)  # the stream's end stays visible to receive()
                return
            late(reply)

    def receive(
        self, round_id: int, deadline: float, late: Callable[[draft_pb2.DraftBlocks], None] = lambda reply: None
    ) -> draft_pb2.DraftBlocks | None:
        """The reply to ``round_id``, or None; replies to other rounds go to ``late``."""
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
            late(reply)

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


class DraftEndpoint:
    """One draft service address: its stream, its limits (from Info) and the sequences it holds."""

    def __init__(self, address: str, cfg: DraftClientConfig, states: StreamStates) -> None:
        self.address = address
        self.cfg = cfg
        self.states = states
        self.channel = channel(address, cfg.tls, CHANNEL_OPTIONS)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.stream: _Stream | None = None
        self.info: grpc.Future | None = None  # InfoResponse, asked for with each new stream
        self.opened: set[str] = set()  # sequences the draft holds on the current stream
        self.draining = False  # it refused a sequence because it is shutting down (this stream)
        self.retry_at = 0.0
        self.backoff = cfg.retry_initial
        self.assigned = 0  # sequences routed here (open or not)
        self.last_round = 0  # the last round with rows sent on the current stream
        # Rounds verified from offered blocks, not waited for: their answers are read later, for errors.
        self.unwaited: set[int] = set()

    @property
    def up(self) -> bool:
        return self.stream is not None and self.stream.up and not self.draining

    @property
    def max_context(self) -> int | None:
        """The draft's longest sequence, once its Info has answered."""
        info = self._info()
        return None if info is None else info.max_context

    @property
    def placement(self) -> Placement | None:
        """Where the draft computes, once its Info has answered (None from a draft that does not say)."""
        info = self._info()
        if info is None or not info.HasField("placement"):
            return None
        return placement_from_pb(info.placement)

    def _info(self) -> common_pb2.InfoResponse | None:
        if self.info is None or not self.info.done() or self.info.exception() is not None:
            return None
        return self.info.result()

    def open_stream(self) -> None:
        """A new stream (and a new Info) if there is none and the backoff has passed."""
        if self.stream is not None or time.monotonic() < self.retry_at:
            return
        self.stream = _Stream(self.stub, self.address, self.states)
        self.info = None
        self.opened.clear()
        self.draining = False

    def ask_info(self) -> None:
        """Ask the draft for its limits once its stream is up (again, if the last answer failed)."""
        if self.up and (self.info is None or (self.info.done() and self.info.exception() is not None)):
            self.info = self.stub.Info.future(common_pb2.InfoRequest(), timeout=self.cfg.round_timeout)

    def fail(self) -> None:
        """Drop the stream; its sequences must be re-opened; retry after a growing backoff."""
        self._drop_stream()
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, self.cfg.retry_max)

    def succeeded(self) -> None:
        self.backoff = self.cfg.retry_initial

    def refusing(self) -> None:
        """It refused a sequence because it is draining: no new sequences, and not healthy."""
        self.draining = True
        if self.stream is not None:
            self.states.down(self.address, self.stream)

    def _drop_stream(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.states.down(self.address, self.stream)
        self.stream = None
        self.info = None
        self.opened.clear()
        self.unwaited.clear()

    def close(self) -> None:
        self._drop_stream()
        self.channel.close()


@dataclass
class _SeqState:
    endpoint: DraftEndpoint
    sampling: common_pb2.SamplingParams  # what the draft needs to build the same q as the target's p
    cache_salt: str = ""  # the request's prefix-cache salt, sent with each opening
    known: int = 0  # committed tokens the draft has seen
    num_accepted: int = 0  # of the last proposal, to report next round
    full: bool = False  # no draft can take it any more (its context outgrew the draft's): never asked again
    retry_at: float = 0.0  # refused for want of room: not asked again before then
    # The sequence's round seeds (sampled rows): a stream of its own, seeded once from the request's
    # draft stream, so the next round's seed is known a round early (a draft drafting ahead needs
    # it) and every seed still comes from the request's own seeded stream.
    seeds: torch.Generator | None = None
    next_seed: int = 0
    asked_round: int = 0  # the last round that asked its endpoint for this sequence's guesses


class RemoteDrafter:
    """A :class:`~specd.services.engine.drafters.Drafter` backed by one or more draft services."""

    def __init__(
        self,
        cfg: DraftClientConfig,
        vocab_size: int,
        device: torch.device | str = "cpu",
        on_failure: Callable[[str], None] | None = None,
        states: StreamStates | None = None,
        on_round: Callable[[DraftRoundReport], None] | None = None,
    ) -> None:
        if not cfg.addresses:
            raise ValueError("at least one draft address is needed")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # named as a draft names its own
        # Where this target computes: drafting ahead is not asked of a draft that competes with it.
        self.placement = Placement.of_this_process(torch.get_num_threads(), str(self.device))
        self._competing: set[str] = set()  # draft addresses found competing (logged once each)
        self.on_failure = on_failure or (lambda address: None)
        self.states = states or StreamStates()
        self.endpoints = [DraftEndpoint(a, cfg, self.states) for a in cfg.addresses]
        for e in self.endpoints:
            e.open_stream()
        self.on_round = on_round or (lambda report: None)
        self.blocks_by_source = dict.fromkeys(BLOCK_SOURCES, 0)  # since start, for tests and tools
        self.seqs: dict[str, _SeqState] = {}
        self._unopened: list[tuple[str, list[int]]] = []  # (sequence, prompt) added since the last step
        self._round_ids = itertools.count(1)
        self._steps_since_ask = 0  # engine steps (prefill calls) since rows last asked for guesses

    # ------------------------------------------------------------------ Drafter protocol

    def add(
        self,
        seq_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str = "",
        prefill_ahead: bool = True,
    ) -> None:
        """Assign the sequence an endpoint; with ``prefill_ahead`` it is opened there at the next
        step (:meth:`prefill`), else at its first ask, if any."""
        self.seqs[seq_id] = _SeqState(self._pick(), sampling_to_pb(params or SamplingParams()), cache_salt)
        self.seqs[seq_id].endpoint.assigned += 1
        if prefill_ahead:
            self._unopened.append((seq_id, list(prompt_ids)))

    def prefill(self, budget: int) -> None:
        """Called every engine step, with or without work: each draft service prefills its own
        sequences, so this only keeps the streams: a broken one counts as a failure, and an
        endpoint without a stream gets a new one once its backoff has passed."""
        for ep in self.endpoints:
            if ep.stream is not None and ep.stream.broken.is_set():
                self._failed(ep, "its stream ended")
            ep.open_stream()
            ep.ask_info()
        self._steps_since_ask += 1
        if self._unopened:
            if self._steps_since_ask <= OPEN_AT_ADMISSION_WITHIN_STEPS:
                self._open_admitted()
            else:
                self._unopened.clear()  # opened at their first ask, if there is one

    def _open_admitted(self) -> None:
        """Open the sequences admitted since the last step at their drafts now, fire and forget.

        The draft prefills them between rounds (DraftWorker.prefill_idle), while this target
        prefills and verifies, so a row's first ask finds it ready. Opened only when first asked,
        a batch of new rows made the draft prefill them all inside that round (94 ms where a round
        takes 15 at 16 rows), or answer them with nothing, which counts as a failed guess. A
        sequence whose draft is not up now, or whose prompt fills the draft's context, is opened
        at its first ask as before; an open the draft refuses is answered at that ask
        (UNKNOWN_SEQUENCE, then re-opened with the full context)."""
        rounds: dict[int, tuple[DraftEndpoint, draft_pb2.DraftRound]] = {}
        for seq_id, prompt in self._unopened:
            st = self.seqs.get(seq_id)
            if st is None:
                continue
            ep = st.endpoint
            if st.full or not ep.up or ep.stream is None or seq_id in ep.opened:
                continue
            if ep.max_context is not None and len(prompt) >= ep.max_context:
                continue
            _, msg = rounds.setdefault(id(ep), (ep, draft_pb2.DraftRound(round_id=0)))
            self._open(ep, msg, seq_id, prompt)
        self._unopened.clear()
        for ep, msg in rounds.values():
            ep.stream.send(msg)

    def ready(self, seq_id: str) -> bool:
        # A draft still prefilling answers with a block marked so instead (Block.prefilling).
        return not self.seqs[seq_id].full

    def unseen(self, seq_id: str, length: int) -> int:
        st = self.seqs[seq_id]
        if seq_id not in st.endpoint.opened:
            return length  # opened at this ask: the draft prefills the whole context
        return length - st.known - st.num_accepted  # as _unseen counts the row it would send

    def accepted(self, seq_id: str, num_accepted: int) -> None:
        st = self.seqs.get(seq_id)
        if st is not None:
            st.num_accepted = num_accepted

    def remove(self, seq_id: str) -> None:
        st = self.seqs.pop(seq_id, None)
        if st is None:
            return
        st.endpoint.assigned -= 1
        self._release(st.endpoint, seq_id)

    def propose(self, rows: Sequence[DraftRow], sampling: BatchSampling | None) -> Proposal:
        K = max(r.k for r in rows)
        token_ids = torch.full((len(rows), K), -1, dtype=torch.long)
        any_sampled = any(not r.greedy for r in rows)
        by_ep: dict[int, list[tuple[int, int]]] = {}  # endpoint -> (row, k to ask)
        for i, r in enumerate(rows):
            if not self.seqs[r.seq_id].endpoint.up:
                self._reassign(r.seq_id)
            st = self.seqs[r.seq_id]
            k = self._askable(r, st)
            if k > 0:
                by_ep.setdefault(id(st.endpoint), []).append((i, k))
        if by_ep:
            self._steps_since_ask = 0
        # Send every endpoint its round first, then collect: the drafts work in parallel. A row
        # whose draft offered a block for its outcome takes it; an endpoint that offered every
        # row's is not waited for.
        pending: list[tuple[DraftEndpoint, int, list[int]]] = []
        offered: dict[int, draft_pb2.Block] = {}  # row -> the block its draft offered
        caught_up, timed = 0, True
        for asks in by_ep.values():
            ep = self.seqs[rows[asks[0][0]].seq_id].endpoint
            if ep.unwaited:
                ep.stream.drain(functools.partial(self._late, ep))
            asked = [(rows[i], k) for i, k in asks]
            ahead = self._drafts_ahead(ep)
            taken = self._offered(ep, asked) if ahead else [None] * len(asked)
            round_id = next(self._round_ids)
            msg = self._round_msg(ep, round_id, asked, ahead, [b is not None for b in taken])
            # Rows with many tokens to catch up (an opened sequence makes the draft prefill instead).
            caught_up += sum(max(0, _unseen(r) - CATCH_UP_TOKENS) for r in msg.rows)
            timed = timed and not msg.open
            ep.stream.send(msg)
            offered.update((i, b) for (i, _), b in zip(asks, taken) if b is not None)
            if all(b is not None for b in taken):
                ep.unwaited.add(round_id)
            else:
                pending.append((ep, round_id, [i for i, _ in asks]))
        t0 = time.monotonic()
        deadline = t0 + self.cfg.round_timeout
        blocks: dict[int, draft_pb2.Block] = dict(offered)  # row -> its block
        prefilling: set[int] = set()  # rows whose draft has not prefilled them yet (Block.prefilling)
        for ep, round_id, idx in pending:
            late = functools.partial(self._late, ep)
            reply = ep.stream.receive(round_id, deadline, late) if ep.stream is not None else None
            if reply is None:
                self._failed(ep, "it did not answer")
                continue
            ep.succeeded()
            timed = timed and not reply.prefilled_tokens
            by_id = {rows[i].seq_id: i for i in idx}
            for b in reply.blocks:
                i = by_id.get(b.sequence_id)
                if i in offered:
                    if b.error != draft_pb2.DRAFT_ERROR_UNSPECIFIED:  # the draft no longer held it
                        self._draft_error(b.sequence_id, self.seqs[b.sequence_id], b.error)
                        del offered[i], blocks[i]
                elif i is not None and self._usable_block(b, rows[i]):
                    blocks[i] = b
                elif i is not None and b.prefilling:
                    prefilling.add(i)
        for i, b in blocks.items():
            n = min(len(b.token_ids), rows[i].k)
            token_ids[i, :n] = torch.tensor(b.token_ids[:n], dtype=torch.long)
        if pending or offered:
            sources = dict.fromkeys(self.blocks_by_source, 0)
            for i, b in blocks.items():
                sources["offered" if i in offered else BLOCK_SOURCE_NAMES.get(b.source, "fresh")] += 1
            for source, n in sources.items():
                self.blocks_by_source[source] += n
            self.on_round(DraftRoundReport(time.monotonic() - t0 if pending else 0.0, sources))
        # Only as wide as what arrived: with every draft down the target verifies a single token.
        width = int((token_ids >= 0).sum(dim=1).max())
        waiting = frozenset(prefilling)
        if width == 0:
            return Proposal(
                to_device(token_ids[:, :0], self.device), None, caught_up=caught_up, timed=timed, prefilling=waiting
            )
        probs = self._sparse_q(blocks, rows, len(rows), width) if any_sampled else None
        return Proposal(
            to_device(token_ids[:, :width], self.device), probs, caught_up=caught_up, timed=timed, prefilling=waiting
        )

    def close(self) -> None:
        for e in self.endpoints:
            e.close()

    # ------------------------------------------------------------------ endpoints

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
        self.endpoints = [current.get(a) or DraftEndpoint(a, self.cfg, self.states) for a in wanted]
        for e in self.endpoints:
            e.open_stream()
        for e in gone:
            e.close()
        for seq_id, st in self.seqs.items():
            if st.endpoint in gone:
                self._reassign(seq_id)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(e.address for e in self.endpoints)

    def _pick(self) -> DraftEndpoint:
        """The up endpoint with the fewest sequences (any endpoint if none is up)."""
        candidates = [e for e in self.endpoints if e.up] or self.endpoints
        return min(candidates, key=lambda e: e.assigned)

    def _reassign(self, seq_id: str) -> None:
        st = self.seqs[seq_id]
        new = self._pick()
        if new is not st.endpoint:
            st.endpoint.assigned -= 1
            self._release(st.endpoint, seq_id)
            new.assigned += 1
            self.seqs[seq_id] = _SeqState(new, st.sampling, full=st.full, seeds=st.seeds, next_seed=st.next_seed)

    def _failed(self, ep: DraftEndpoint, why: str) -> None:
        log.warning("draft %s failed (%s); decoding without its guesses", ep.address, why)
        ep.fail()
        self.on_failure(ep.address)

    def _release(self, ep: DraftEndpoint, seq_id: str) -> None:
        """Free the draft's copy now (with no other traffic the draft must still free it)."""
        if seq_id in ep.opened:
            ep.opened.discard(seq_id)
            if ep.stream is not None:
                ep.stream.send(draft_pb2.DraftRound(round_id=0, release=[seq_id]))

    # ------------------------------------------------------------------ rounds

    def _askable(self, r: DraftRow, st: _SeqState) -> int:
        """How many guesses to ask of the row's draft now: none when its endpoint is not up, when it
        was refused for want of room a moment ago, or when its context is past the draft's
        (which is then final); else k capped by the room left in the draft's context."""
        ep = st.endpoint
        if st.full or not ep.up or time.monotonic() < st.retry_at:
            return 0
        room = r.k if ep.max_context is None else ep.max_context - len(r.tokens)
        if room <= 0:
            self._never_again(r.seq_id, st)
            return 0
        return min(r.k, room)

    def _never_again(self, seq_id: str, st: _SeqState) -> None:
        st.full = True
        self._release(st.endpoint, seq_id)

    def _open(self, ep: DraftEndpoint, msg: draft_pb2.DraftRound, seq_id: str, tokens: Sequence[int]) -> None:
        """Add the sequence's opening (its whole context so far) to ``msg``; the draft has then seen
        ``tokens`` and no proposal of it is outstanding."""
        st = self.seqs[seq_id]
        msg.open.add(sequence_id=seq_id, token_ids=tokens, sampling=st.sampling, cache_salt=st.cache_salt)
        ep.opened.add(seq_id)
        st.known, st.num_accepted = len(tokens), 0

    def _offered(self, ep: DraftEndpoint, asks: list[tuple[DraftRow, int]]) -> list[draft_pb2.Block | None]:
        """Per row, the block its draft offered for its exact outcome (its committed tokens since
        its last round, this round's seed, at least k guesses), or None. The rows' offers are
        spent either way: after this round none can match. Asked only of a draft drafting ahead.

        Only a plan made in the endpoint's latest round with rows still exists at the draft (a
        round without the sequence drops it), hence the round check."""
        if not self.cfg.offer_prepared or ep.stream is None:
            return [None] * len(asks)
        found: list[draft_pb2.Block | None] = []
        for r, k in asks:
            offers = ep.stream.take_offers(r.seq_id)
            st = self.seqs[r.seq_id]
            if not offers or r.seq_id not in ep.opened or st.asked_round != ep.last_round:
                found.append(None)
                continue
            assumed = list(r.tokens[st.known :])
            seed = 0 if r.seed is None else st.next_seed
            found.append(
                next(
                    (
                        o.block
                        for o in offers
                        if o.base_length == st.known
                        and o.round_seed == seed
                        and len(o.block.token_ids) >= k
                        and (r.greedy or len(o.block.probs) >= k)
                        and list(o.assumed_token_ids) == assumed
                    ),
                    None,
                )
            )
        return found

    def _drafts_ahead(self, ep: DraftEndpoint) -> bool:
        """Whether to ask ``ep`` to draft ahead: asked for, and the draft does not compete with
        this target for its compute (drafting in turn until its Info has answered; a draft whose
        Info does not say where it computes is taken at the flag's word)."""
        if not self.cfg.draft_ahead or ep.max_context is None:
            return False
        placement = ep.placement
        if placement is not None and competes(self.placement, placement):
            if ep.address not in self._competing:
                self._competing.add(ep.address)
                log.warning(
                    "draft %s shares this target's compute (%s); drafting in turn with it, not ahead "
                    "(specd serve --pin-cores gives each its own cores)",
                    ep.address,
                    placement.device if placement.device != "cpu" else f"cores {sorted(placement.cores)}",
                )
            return False
        return True

    def _late(self, ep: DraftEndpoint, reply: draft_pb2.DraftBlocks) -> None:
        """The answer to a round verified from offered blocks: act on the errors it carries
        (a draft that no longer held an offered block dropped the sequence)."""
        if reply.round_id not in ep.unwaited:
            return
        ep.unwaited.discard(reply.round_id)
        for b in reply.blocks:
            st = self.seqs.get(b.sequence_id)
            if b.error != draft_pb2.DRAFT_ERROR_UNSPECIFIED and st is not None and st.endpoint is ep:
                self._draft_error(b.sequence_id, st, b.error)

    def _round_msg(
        self, ep: DraftEndpoint, round_id: int, asks: list[tuple[DraftRow, int]], ahead: bool, taken: list[bool]
    ) -> draft_pb2.DraftRound:
        msg = draft_pb2.DraftRound(
            round_id=round_id,
            draft_ahead=ahead,
            offer_prepared=self.cfg.offer_prepared and len(asks) <= OFFER_MAX_ROWS,
        )
        ep.last_round = round_id
        for (r, k), offer_taken in zip(asks, taken):
            st = self.seqs[r.seq_id]
            seed = next_seed = 0
            if r.seed is not None:
                # The sequence's own seed stream, started from its first round's seed: the next
                # round's seed is known a round early (for drafting ahead), and seeded requests
                # stay reproducible.
                if st.seeds is None:
                    st.seeds = make_generator(r.seed)
                    st.next_seed = draw_seed(st.seeds)
                seed, st.next_seed = st.next_seed, draw_seed(st.seeds)
                next_seed = st.next_seed
            if r.seq_id not in ep.opened:
                self._open(ep, msg, r.seq_id, r.tokens)
            msg.rows.add(
                sequence_id=r.seq_id,
                num_accepted=st.num_accepted,
                new_token_ids=r.tokens[st.known :],
                committed_length=len(r.tokens),
                num_tokens=k,
                round_seed=seed,
                next_round_seed=next_seed,
                offer_taken=offer_taken,
            )
            st.known, st.num_accepted, st.asked_round = len(r.tokens), 0, round_id
        return msg

    def _usable_block(self, b: draft_pb2.Block, row: DraftRow) -> bool:
        """Act on the block's error, if any; whether it carries guesses to use."""
        if b.error == draft_pb2.DRAFT_ERROR_UNSPECIFIED:
            # A sampled row without its q cannot be verified losslessly.
            return bool(b.token_ids) and (row.greedy or len(b.probs) >= min(len(b.token_ids), row.k))
        self._draft_error(row.seq_id, self.seqs[row.seq_id], b.error)
        return False

    def _draft_error(self, seq_id: str, st: _SeqState, error: int) -> None:
        """Act on what the draft refused for a sequence."""
        ep = st.endpoint
        if error in REOPEN:
            ep.opened.discard(seq_id)  # the draft dropped (or never had) it
        elif error in NEVER_AGAIN:
            self._never_again(seq_id, st)  # released, as a draft may hold it (refused at a round)
        elif error in LATER:
            ep.opened.discard(seq_id)
            st.retry_at = time.monotonic() + self.cfg.retry_initial
            if error == draft_pb2.DRAFT_ERROR_DRAINING:
                ep.refusing()  # its sequences move to another draft, if there is one, next round
        else:
            log.warning("draft %s: unknown error %d for %s", ep.address, error, seq_id)
            ep.opened.discard(seq_id)

    def _sparse_q(
        self, blocks: dict[int, draft_pb2.Block], rows: Sequence[DraftRow], B: int, width: int
    ) -> SparseProbs:
        """The sampled rows' q as they came, [B, width, m], padded with probability 0."""
        m = max((len(d.token_ids) for b in blocks.values() for d in b.probs), default=1)
        ids = np.zeros((B, width, m), dtype=np.int64)
        probs = np.zeros((B, width, m), dtype=np.float32)
        for i, b in blocks.items():
            if rows[i].greedy:
                continue
            for j, d in enumerate(b.probs[: min(width, rows[i].k, len(b.token_ids))]):
                ids[i, j, : len(d.token_ids)] = d.token_ids
                probs[i, j, : len(d.probs)] = d.probs
        return SparseProbs(torch.from_numpy(ids), torch.from_numpy(probs))
