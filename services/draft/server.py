"""The draft gRPC service: a thin servicer around :class:`DraftWorker` (messages in and out: convert.py).

Model work runs inline on the main-thread event loop (services/common/main_thread.py says why the
main thread): a round blocks the loop for its few milliseconds, and rounds of one model are serial
anyway, and no thread hand-off is paid per round. Each Draft stream gets its own id; closing it frees its sequences.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from specd.services.common.config import ServiceConfig
from specd.services.common.constants import DRAFT_PREFILL_SLICE_SECONDS
from specd.services.common.drain import DEFAULT_DRAIN_TIMEOUT, Drain
from specd.services.common.grpc_server import run_server, start_metrics_server
from specd.services.common.runtime import freeze_startup_heap
from specd.services.common.tls import TLSConfig
from specd.services.draft import convert, metrics
from specd.services.draft.worker import BlockError, BlockOut, DraftWorker
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftServerConfig(ServiceConfig):
    port: int = 50051
    max_sequences: int = 64  # sequences held at once; their KV shares one pool of kv_cache_memory bytes
    support: int = 128  # entries of the truncated q sent per sampled guess
    quantize: str | None = None  # "int8": weight-only, half the bytes per step; the target's output is unchanged
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    tls: TLSConfig | None = None  # mutual TLS on this server's port
    prefix_caching: bool = True  # prompts reuse the K/V of earlier prompts' common prefixes (ModelDrafter)
    # Seconds one prefill pass may take (DraftWorker.prefill_slice): a round waits for the pass in flight.
    prefill_slice: float | None = DRAFT_PREFILL_SLICE_SECONDS


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, worker: DraftWorker, info: common_pb2.InfoResponse, drain: Drain | None = None) -> None:
        self.worker = worker
        self.info = info
        self.drain = drain or Drain()

    def idle(self) -> bool:
        """No sequence held: a draining draft can go (targets re-open elsewhere what comes later)."""
        return self.worker.active == 0

    def _round(self, stream: str, rnd: draft_pb2.DraftRound) -> draft_pb2.DraftBlocks:
        t0 = time.perf_counter()
        for seq_id in rnd.release:
            self.worker.release(stream, seq_id)
        errors: dict[str, BlockError] = {}
        for seq in convert.opens_from_pb(rnd):
            # Draining: finish the sequences held, take no new ones (the target opens them elsewhere).
            err = BlockError.DRAINING if self.drain.draining else self.worker.open(stream, seq)
            if err is not BlockError.NONE:
                errors[seq.seq_id] = err
        reqs = [r for r in convert.rows_from_pb(rnd) if r.seq_id not in errors]
        prefilled = self.worker.prefilled_tokens
        offer = rnd.draft_ahead and rnd.offer_prepared
        blocks = self.worker.propose(stream, reqs, rnd.draft_ahead, offer) if reqs else []
        prefilled = self.worker.prefilled_tokens - prefilled
        blocks += [BlockOut(s, error=e) for s, e in errors.items()]
        if rnd.rows:
            metrics.DRAFT_BLOCK_SECONDS.observe(time.perf_counter() - t0)
            for b in blocks:
                if b.token_ids:
                    metrics.DRAFT_BLOCKS.labels(source=b.source).inc()
        metrics.DRAFT_SEQUENCES.set(self.worker.active)
        return convert.blocks_to_pb(rnd.round_id, blocks, prefilled)

    def _close_stream(self, stream: str) -> None:
        freed = self.worker.release_stream(stream)
        metrics.DRAFT_SEQUENCES.set(self.worker.active)
        log.info("draft stream %s closed; freed %d sequences", stream, freed)

    async def Draft(self, request_iterator, context):
        stream = uuid.uuid4().hex[:12]
        # Headers at once: the target counts a stream as up (its health) from the moment they arrive.
        await context.send_initial_metadata(())
        inbox: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(_read_into(request_iterator, inbox))
        try:
            while True:
                rnd = await self._next_round(stream, inbox)
                if rnd is None:
                    return
                if isinstance(rnd, draft_pb2.DraftBlocks):
                    yield rnd  # blocks offered ahead of the round
                    continue
                try:
                    blocks = self._round(stream, rnd)
                except Exception:
                    log.exception("draft round failed; ending the stream (the target re-opens its sequences)")
                    raise
                yield blocks
        finally:
            # Runs on normal close, on cancellation and when the target dies: nothing leaks.
            reader.cancel()
            self._close_stream(stream)

    async def _next_round(
        self, stream: str, inbox: asyncio.Queue
    ) -> draft_pb2.DraftRound | draft_pb2.DraftBlocks | None:
        """The stream's next round (None at its end), or blocks to offer before it. Until it
        comes, prefill the prompts opened (a chunk at a time), then draft ahead one batched step at
        a time (services/draft/ahead.py), giving the event loop a turn after each, so a round that
        arrives waits at most for the chunk or step in flight."""
        while inbox.empty():
            if self.worker.prefill_idle():
                pass
            elif self.worker.ahead_pending(stream):
                t0 = time.perf_counter()
                if self.worker.ahead_step(stream):
                    metrics.DRAFT_AHEAD_STEP_SECONDS.observe(time.perf_counter() - t0)
                offers = self.worker.take_offers(stream)
                if offers:
                    return convert.offers_to_pb(offers)
            else:
                break
            await asyncio.sleep(0)
        item = await inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def Health(self, request, context):
        return common_pb2.HealthResponse(serving=not self.drain.draining)

    async def Info(self, request, context):
        return self.info


async def _read_into(request_iterator, inbox: asyncio.Queue) -> None:
    """Move a stream's requests into ``inbox``, then None at its end (or the error that ended it)."""
    try:
        async for rnd in request_iterator:
            inbox.put_nowait(rnd)
        inbox.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        inbox.put_nowait(e)


def build_worker(cfg: DraftServerConfig) -> tuple[DraftWorker, common_pb2.InfoResponse]:
    import torch

    from specd.services.common.affinity import Placement
    from specd.services.common.constants import MAX_SPECULATIVE_TOKENS
    from specd.services.common.convert import placement_to_pb
    from specd.services.engine.builder import DTYPES
    from specd.services.engine.drafters import ModelDrafter
    from specd.services.engine.model import load_model

    model = load_model(cfg.model, DTYPES[cfg.dtype], cfg.device, cfg.backend, quantize=cfg.quantize)
    max_len = min(cfg.max_model_len or model.info.max_context, model.info.max_context)
    drafter = ModelDrafter(
        model,
        cfg.max_sequences,
        max_len + MAX_SPECULATIVE_TOKENS + 2,
        cfg.support,
        cfg.kv_cache_memory,
        prefix_caching=cfg.prefix_caching,
    )
    drafter.warm_up()
    info = common_pb2.InfoResponse(
        model_name=cfg.model_name,
        vocab_size=model.info.vocab_size,
        max_context=max_len,
        role="draft",
        max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
        placement=placement_to_pb(Placement.of_this_process(torch.get_num_threads(), str(model.device))),
    )
    worker = DraftWorker(drafter, max_len, cfg.support, MAX_SPECULATIVE_TOKENS, cfg.prefill_chunk, cfg.prefill_slice)
    return worker, info


def serve(cfg: DraftServerConfig) -> None:
    """Load the draft model and serve DraftService until SIGTERM."""
    worker, info = build_worker(cfg)
    start_metrics_server(cfg.metrics_port)
    metrics.DRAFT_SEQUENCES.set(0)
    servicer = DraftServicer(worker, info, Drain(cfg.drain_timeout))
    freeze_startup_heap()
    asyncio.run(
        run_server(
            lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
            cfg.host,
            cfg.port,
            ready_message=f"specd draft service ({info.model_name}) listening on port {{port}}",
            tls=cfg.tls,
            drain=servicer.drain,
            idle=servicer.idle,
        )
    )
