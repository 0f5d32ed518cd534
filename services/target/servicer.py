"""The target's gRPC servicer: RPCs in, the engine loop, RPCs out; nothing else.

Messages are converted in :mod:`specd.services.target.convert`, the drafts are the
:class:`~specd.services.target.draft_pool.DraftPool`'s, and the engine is reached only through the
:class:`~specd.services.target.loop.EngineLoop` (of the engine itself the servicer knows only its
immutable :class:`~specd.services.engine.engine.EngineLimits`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from specd.services.common.drain import Drain
from specd.services.engine.engine import EngineLimits
from specd.services.engine.errors import RequestError
from specd.services.target import convert, metrics
from specd.services.target.convert import RequestDefaults
from specd.services.target.draft_pool import DraftPool
from specd.services.target.loop import ACCEPTED, EngineLoop
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc


@dataclass(frozen=True)
class Admission:
    """How many requests the target holds at once, running or queued: past that, Generate fails at
    once with RESOURCE_EXHAUSTED (the gateway tries another target, or answers 429)."""

    max_batch_size: int
    max_waiting: int

    @property
    def capacity(self) -> int:
        return self.max_batch_size + self.max_waiting


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(
        self,
        loop: EngineLoop,
        limits: EngineLimits,
        tokenizer,
        info: common_pb2.InfoResponse,
        admission: Admission,
        defaults: RequestDefaults = RequestDefaults(),
        drafts: DraftPool | None = None,
        drain: Drain | None = None,
    ) -> None:
        self.loop = loop
        self.limits = limits
        self.tokenizer = tokenizer
        self.info = info
        self.admission = admission
        self.defaults = defaults
        self.drafts = drafts
        self.drain = drain or Drain()
        self.in_flight = 0  # Generate calls past admission (changed only on the gRPC loop)

    def idle(self) -> bool:
        """No request in flight (read on the gRPC loop, which alone changes it)."""
        return self.in_flight == 0

    async def Generate(self, request, context):
        # Typed refusals the gateway acts on by status code: UNAVAILABLE (try another target, or
        # 503) while draining; RESOURCE_EXHAUSTED (another target, or 429) when this one is full.
        if self.drain.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this target is shutting down")
        if self.in_flight >= self.admission.capacity:
            metrics.REQUESTS_REJECTED.labels(reason="queue_full").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this target is full ({self.admission.max_batch_size} running, {self.admission.max_waiting} waiting)",
            )
        try:
            # Tokenizing and chat templating a long prompt takes milliseconds: off the event loop that
            # delivers every stream's tokens.
            req = await asyncio.to_thread(convert.request_from_pb, request, self.tokenizer, self.limits, self.defaults)
        except RequestError as e:
            await context.abort(*convert.request_error_status(e))
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def sink(item) -> None:
            aloop.call_soon_threadsafe(queue.put_nowait, item)

        self.in_flight += 1
        self.loop.submit(req, sink)
        finished = False
        completion = 0
        try:
            # The engine validates and queues it: the header goes out only once it has, so every
            # refusal reaches the caller before any message.
            item = await queue.get()
            if isinstance(item, RequestError):
                finished = True
                await context.abort(*convert.request_error_status(item))
            if item is not ACCEPTED:
                finished = True
                await context.abort(grpc.StatusCode.INTERNAL, "the target could not take the request")
            yield convert.header_pb(len(req.prompt_ids))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    await context.abort(grpc.StatusCode.INTERNAL, "generation failed on the target")
                completion += len(item.token_ids)
                yield convert.response_to_pb(item, completion)
                if item.finished:
                    finished = True
                    return
        finally:
            self.in_flight -= 1
            if not finished:  # the caller went away (cancelled, disconnected, deadline): free it now
                self.loop.abort(req.request_id, sink)

    async def Health(self, request, context):
        healthy, total = self.drafts.health() if self.drafts is not None else (0, 0)
        return common_pb2.HealthResponse(
            serving=self.loop.running and not self.drain.draining,
            draft_endpoints_healthy=healthy,
            draft_endpoints_total=total,
        )

    async def Info(self, request, context):
        return self.info

    async def SetDrafts(self, request, context):
        if self.drafts is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this target was started without --draft-address")
        try:
            endpoints = self.drafts.set_addresses(tuple(request.addresses))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return target_pb2.DraftAddresses(addresses=endpoints)
