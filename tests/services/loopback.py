"""A draft service in this process, reached without a network: the real :class:`DraftServicer`
(proto in, proto out) behind a stub that :class:`RemoteDrafter` talks to like a gRPC one.

For the statistical and exactness tests of drafting ahead, which need thousands of rounds in
seconds and a deterministic schedule: after answering each round this draft finishes every block it
prepares before it reads the next one (a draft with time to spare), so every guessed outcome is
served from a prepared block; with offers on, those blocks ride on the round's answer (a real draft
sends them in messages of their own as each completes), so in rounds that ask for offers the target
verifies every guessed outcome from an offered block. The network path itself is covered by the tests that start a real
``specd draft`` process (tests/services/test_remote_drafter.py, tests/e2e/).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

from specd.services.draft import convert
from specd.services.draft.ahead import MAX_WIDTH, AheadPolicy
from specd.services.draft.server import DraftServerConfig, DraftServicer, build_worker
from specd.services.target.draft_client import DraftClientConfig, RemoteDrafter
from specd.v1 import draft_pb2


class LoopbackCall:
    """What ``stub.Draft(requests)`` returns: an iterator of replies, computed as they are read."""

    def __init__(self, servicer: DraftServicer, requests: Iterator[draft_pb2.DraftRound], width: int) -> None:
        self.servicer = servicer
        self.requests = requests
        self.stream = uuid.uuid4().hex[:12]
        servicer.worker.lane(self.stream).policy = AheadPolicy(width=width, max_width=width)

    def __iter__(self) -> LoopbackCall:
        return self

    def __next__(self) -> draft_pb2.DraftBlocks:
        try:
            rnd = next(self.requests)
        except StopIteration:
            self.servicer._close_stream(self.stream)
            raise
        reply = self.servicer._round(self.stream, rnd)
        while self.servicer.worker.ahead_step(self.stream):
            pass
        reply.offered.extend(convert.offers_to_pb(self.servicer.worker.take_offers(self.stream)).offered)
        return reply

    def initial_metadata(self) -> tuple:
        return ()  # the draft is up at once

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass  # the requests iterator ends the call (RemoteDrafter closes it before cancelling)


class _Answered:
    """A unary call's future that has its answer already."""

    def __init__(self, value: object) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> object:
        return self.value


class _Unary:
    def __init__(self, value: object) -> None:
        self.value = value

    def future(self, request: object, timeout: float | None = None) -> _Answered:
        return _Answered(self.value)


class LoopbackStub:
    def __init__(self, servicer: DraftServicer, width: int) -> None:
        self.servicer = servicer
        self.width = width
        self.Info = _Unary(servicer.info)  # noqa: N815 (gRPC's name)

    def Draft(  # noqa: N802 (gRPC's name)
        self, requests: Iterator[draft_pb2.DraftRound], wait_for_ready: bool = False
    ) -> LoopbackCall:
        return LoopbackCall(self.servicer, requests, self.width)


def loopback_drafter(
    draft_dir: str,
    vocab_size: int,
    draft_ahead: bool,
    support: int = 4,
    width: int = MAX_WIDTH,
    offer_prepared: bool = True,
) -> tuple[RemoteDrafter, DraftServicer]:
    """A RemoteDrafter whose one endpoint is an in-process draft servicer over ``draft_dir`` (float32)."""
    worker, info = build_worker(
        DraftServerConfig(model=draft_dir, port=0, dtype="float32", support=support, max_sequences=256)
    )
    info.ClearField("placement")  # in this process, it would compete with the target: not said
    servicer = DraftServicer(worker, info)
    cfg = DraftClientConfig(("loopback:1",), round_timeout=60.0, draft_ahead=draft_ahead, offer_prepared=offer_prepared)
    drafter = RemoteDrafter(cfg, vocab_size)
    ep = drafter.endpoints[0]
    ep.close()  # the stream opened to the unreachable address
    ep.stub = LoopbackStub(servicer, width)
    ep.open_stream()
    return drafter, servicer
