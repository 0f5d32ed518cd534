"""The target gRPC service: validates and tokenizes requests, feeds the engine loop, streams results.

Proto types stop here: requests become :class:`~specd.services.engine.engine.Request` dataclasses, step
outputs become GenerateResponse messages.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import grpc

from specd.services.common.config import ServiceConfig
from specd.services.common.convert import sampling_from_pb
from specd.services.common.discovery import AddressWatcher, resolve_all, split_host_port
from specd.services.common.drain import DEFAULT_DRAIN_TIMEOUT, Drain
from specd.services.common.grpc_server import CHANNEL_OPTIONS, start_metrics_server
from specd.services.common.main_thread import serve_with_main_thread
from specd.services.common.tls import TLSConfig, aio_channel
from specd.services.engine.chat import encode_chat, encode_text
from specd.services.engine.engine import (
    AUTO_NUM_TOKENS,
    FIXED_NUM_TOKENS,
    MAX_SPECULATIVE_TOKENS,
    Engine,
    Request,
    SpecConfig,
    StepOutput,
)
from specd.services.target import metrics
from specd.services.target.loop import EngineLoop
from specd.v1 import common_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetServerConfig(ServiceConfig):
    port: int = 50052
    draft_addresses: tuple[str, ...] = ()
    max_batch_size: int = 16
    # Requests queued beyond the running batch; past max_batch_size + max_waiting in flight, Generate
    # fails at once with RESOURCE_EXHAUSTED (the gateway answers 429 when every target is full).
    max_waiting: int = 64
    discovery_interval: float = 5.0  # seconds between DNS re-resolutions of the draft addresses
    default_method: str | None = None  # None: "auto" (the draft model is one of its drafters when addresses are given)
    default_num_tokens: int | None = None  # None: AUTO_NUM_TOKENS for "auto", FIXED_NUM_TOKENS otherwise
    draft_round_timeout: float = 2.0
    tensor_parallel_size: int = 1  # shard the target over this many processes (services/engine/tensor_parallel.py)
    quantize: str | None = None  # "int8" | "int4": serve the target quantized at load
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    tls: TLSConfig | None = None  # mutual TLS for this server and for its channels to the drafts
    draft_ahead: bool = False  # the drafts prepare each sequence's next block while this target verifies

    @property
    def capacity(self) -> int:
        """Requests this target holds at once, running or queued."""
        return self.max_batch_size + self.max_waiting

    @property
    def method(self) -> str:
        return self.default_method or "auto"

    def num_tokens(self, method: str) -> int:
        """The k a request of ``method`` gets when it names none (for "auto": the largest k)."""
        if self.default_num_tokens is not None:
            return self.default_num_tokens
        return AUTO_NUM_TOKENS if method == "auto" else FIXED_NUM_TOKENS


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(
        self,
        loop: EngineLoop,
        info: common_pb2.InfoResponse,
        cfg: TargetServerConfig,
        draft_endpoints: tuple[str, ...],
        drain: Drain | None = None,
    ) -> None:
        self.loop = loop
        self.drain = drain or Drain(cfg.drain_timeout)
        self.engine: Engine = loop.engine
        self.tokenizer = self.engine.tokenizer
        self.info = info
        self.cfg = cfg
        self.live: set[str] = set()
        # Draft endpoints as last resolved (DNS names expand to one endpoint per replica); the
        # watcher re-resolves them and SetDrafts replaces them.
        self.drafts = AddressWatcher(
            cfg.draft_addresses, self._drafts_changed, cfg.discovery_interval, endpoints=draft_endpoints
        )
        # Async channels for health probes (the engine loop owns the Draft streams), created on the
        # gRPC loop at first use: aio channels belong to the loop they are made on.
        self._draft_health: dict[str, tuple[grpc.aio.Channel, draft_pb2_grpc.DraftServiceStub]] = {}

    def _drafts_changed(self, endpoints: tuple[str, ...]) -> None:
        self.loop.set_draft_addresses(endpoints)

    def draft_health(self) -> list[draft_pb2_grpc.DraftServiceStub]:
        """Health stubs for the current draft endpoints (stale ones are dropped)."""
        current = self.drafts.endpoints if self.cfg.draft_addresses else ()
        for gone in set(self._draft_health) - set(current):
            channel, _ = self._draft_health.pop(gone)
            asyncio.get_running_loop().create_task(channel.close())
        for a in current:
            if a not in self._draft_health:
                ch = aio_channel(a, self.cfg.tls, CHANNEL_OPTIONS)
                self._draft_health[a] = (ch, draft_pb2_grpc.DraftServiceStub(ch))
        return [stub for _, stub in self._draft_health.values()]

    # ----------------------------------------------------------------------- conversion

    def to_request(self, msg: target_pb2.GenerateRequest) -> Request:
        """Validate and tokenize; raises ValueError with a message fit for the client."""
        kind = msg.WhichOneof("prompt")
        if kind == "text":
            prompt = encode_text(self.tokenizer, msg.text)
        elif kind == "chat":
            if not msg.chat.messages:
                raise ValueError("messages must not be empty")
            try:
                prompt = encode_chat(
                    self.tokenizer, [{"role": m.role, "content": m.content} for m in msg.chat.messages]
                )
            except Exception as e:  # jinja errors from the model's template (e.g. a role it rejects)
                raise ValueError(f"could not apply the chat template: {e}") from None
        elif kind == "tokens":
            prompt = list(msg.tokens.token_ids)
        else:
            raise ValueError("a prompt is required")
        max_len = self.engine.max_len
        if msg.max_tokens and len(prompt) + msg.max_tokens > max_len:
            raise ValueError(
                f"this model's maximum context length is {max_len} tokens; you requested "
                f"{len(prompt) + msg.max_tokens} tokens ({len(prompt)} in the prompt, {msg.max_tokens} to generate)"
            )
        # Unset max_tokens: up to the context. (An empty or over-long prompt is refused by
        # engine.validate below; max(1, ...) only keeps SamplingParams from refusing it first.)
        max_tokens = msg.max_tokens or max(1, max_len - len(prompt))
        params = sampling_from_pb(msg.sampling, max_tokens=max_tokens, stop=tuple(msg.stop), ignore_eos=msg.ignore_eos)
        sp = msg.speculation
        method = sp.method or self.cfg.method
        num = sp.num_tokens or self.cfg.num_tokens(method)
        spec = SpecConfig(method, 0 if method == "none" else num)
        req = Request(msg.request_id or uuid.uuid4().hex, tuple(prompt), params, spec)
        self.engine.validate(req)
        return req

    @staticmethod
    def to_response(out: StepOutput, completion_tokens: int) -> target_pb2.GenerateResponse:
        n = len(out.token_ids)
        d = out.num_from_draft
        st = out.stats
        return target_pb2.GenerateResponse(
            token_ids=out.token_ids,
            sources=[target_pb2.TOKEN_SOURCE_DRAFT] * d + [target_pb2.TOKEN_SOURCE_TARGET] * (n - d),
            text=out.text,
            finish_reason=out.finish_reason or "",
            completion_tokens=completion_tokens,
            stats=target_pb2.SpeculationStats(
                proposed_tokens=st.proposed_tokens,
                accepted_tokens=st.accepted_tokens,
                target_forward_passes=st.target_forward_passes,
                block_tokens=st.block_tokens,
            )
            if st is not None
            else None,
        )

    # -------------------------------------------------------------------------- RPCs

    def idle(self) -> bool:
        """No request in flight (read on the gRPC loop, which alone changes ``live``)."""
        return not self.live

    async def Generate(self, request, context):
        # Typed refusals the gateway acts on by status code: UNAVAILABLE (try another target, or
        # 503) while draining; RESOURCE_EXHAUSTED (another target, or 429) when this one is full.
        if self.drain.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this target is shutting down")
        if len(self.live) >= self.cfg.capacity:
            metrics.REQUESTS_REJECTED.labels(reason="queue_full").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this target is full ({self.cfg.max_batch_size} running, {self.cfg.max_waiting} waiting)",
            )
        try:
            # Tokenizing and chat templating a long prompt takes milliseconds: off the event loop that
            # delivers every stream's tokens.
            req = await asyncio.to_thread(self.to_request, request)
            if req.request_id in self.live:
                raise ValueError(f"request id {req.request_id!r} is already running")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = req.request_id
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        self.live.add(rid)
        self.loop.submit(req, lambda item: aloop.call_soon_threadsafe(queue.put_nowait, item))
        finished = False
        completion = 0
        try:
            yield target_pb2.GenerateResponse(prompt_tokens=len(req.prompt_ids))
            while True:
                item = await queue.get()
                if isinstance(item, ValueError):
                    finished = True
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                if isinstance(item, Exception):
                    finished = True
                    await context.abort(grpc.StatusCode.INTERNAL, "generation failed on the target")
                completion += len(item.token_ids)
                yield self.to_response(item, completion)
                if item.finished:
                    finished = True
                    return
        finally:
            self.live.discard(rid)
            if not finished:  # the caller went away (cancelled, disconnected, deadline): free it now
                self.loop.abort(rid)

    async def Health(self, request, context):
        healthy = 0
        stubs = self.draft_health()
        if stubs:
            replies = await asyncio.gather(
                # wait_for_ready: a channel in reconnect backoff (a draft just restarted) retries
                # within the timeout instead of failing at once.
                *(s.Health(common_pb2.HealthRequest(), timeout=1.0, wait_for_ready=True) for s in stubs),
                return_exceptions=True,
            )
            healthy = sum(isinstance(r, common_pb2.HealthResponse) and r.serving for r in replies)
        return common_pb2.HealthResponse(
            serving=self.loop.running and not self.drain.draining,
            draft_endpoints_healthy=healthy,
            draft_endpoints_total=len(stubs),
        )

    async def Info(self, request, context):
        return self.info

    async def Cancel(self, request, context):
        known = request.sequence_id in self.live
        if known:
            self.loop.abort(request.sequence_id)
        return common_pb2.ReleaseResponse(released=known)

    async def SetDrafts(self, request, context):
        if not self.cfg.draft_addresses:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this target was started without --draft-address")
        addresses = tuple(request.addresses)
        try:
            for a in addresses:
                split_host_port(a)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not addresses:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "at least one draft address is needed")
        endpoints = self.drafts.set_addresses(addresses)
        log.info("draft services set to %s", ",".join(endpoints))
        return target_pb2.DraftAddresses(addresses=endpoints)


def build_loop(cfg: TargetServerConfig, draft_endpoints: tuple[str, ...]) -> tuple[EngineLoop, common_pb2.InfoResponse]:
    """The engine loop over the target, speculating with the draft services at ``draft_endpoints``
    (``cfg.draft_addresses`` resolved)."""
    from specd.services.engine.builder import ModelSpec, load_target, load_tokenizer
    from specd.services.engine.engine import EngineConfig
    from specd.services.target.draft_client import DraftClientConfig, RemoteDrafter

    tokenizer = load_tokenizer(cfg.model)
    spec = ModelSpec(
        target=cfg.model,
        draft=None,
        target_dtype=cfg.dtype,
        device=cfg.device,
        backend=cfg.backend,
        tensor_parallel_size=cfg.tensor_parallel_size,
        target_quantize=cfg.quantize,
    )
    target = load_target(spec)
    drafter = None
    if draft_endpoints:
        drafter = RemoteDrafter(
            DraftClientConfig(
                draft_endpoints, round_timeout=cfg.draft_round_timeout, tls=cfg.tls, draft_ahead=cfg.draft_ahead
            ),
            target.info.vocab_size,
            target.device,
            on_failure=lambda address: metrics.DRAFT_FAILURES.labels(endpoint=address).inc(),
            on_round=metrics.record_draft_round,
        )
        for a in drafter.addresses:
            metrics.DRAFT_FAILURES.labels(endpoint=a)  # exported as 0 from the start
    ecfg = EngineConfig(
        cfg.max_batch_size,
        cfg.max_model_len,
        prefill_chunk=cfg.prefill_chunk,
        kv_cache_memory=cfg.kv_cache_memory,
    )
    engine = Engine(target, tokenizer, None, ecfg, drafter=drafter)
    methods = ["auto", "ngram", "none"] + (["draft", "hybrid"] if drafter else [])
    info = common_pb2.InfoResponse(
        model_name=cfg.model_name,
        vocab_size=target.info.vocab_size,
        max_context=engine.max_len,
        role="target",
        speculation_methods=methods,
        max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
    )
    return EngineLoop(engine, metrics.SpecExporter()), info


async def _check_drafts(draft_endpoints: tuple[str, ...], info: common_pb2.InfoResponse, tls: TLSConfig | None) -> None:
    """Refuse a draft whose vocabulary differs; a draft that is not up yet is only logged."""
    for a in draft_endpoints:
        async with aio_channel(a, tls) as ch:
            try:
                d = await draft_pb2_grpc.DraftServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=2.0)
            except grpc.RpcError:
                log.warning("draft %s is not reachable yet; generating without it until it is", a)
                continue
        if d.vocab_size != info.vocab_size:
            raise SystemExit(f"draft {a} ({d.model_name}) has vocab {d.vocab_size}, the target {info.vocab_size}")


def serve(cfg: TargetServerConfig) -> None:
    """Load the target and serve TargetService until SIGTERM; the engine loop runs on this thread."""
    # Resolved once here; the servicer's watcher re-resolves from then on.
    draft_endpoints = resolve_all(cfg.draft_addresses)
    loop, info = build_loop(cfg, draft_endpoints)
    asyncio.run(_check_drafts(draft_endpoints, info, cfg.tls))
    start_metrics_server(cfg.metrics_port)
    metrics.REQUESTS_RUNNING.set(0)
    metrics.KV_SLOTS_USED.set(0)
    metrics.REQUESTS_REJECTED.labels(reason="queue_full")  # exported as 0 from the start
    servicer = TargetServicer(loop, info, cfg, draft_endpoints)
    try:
        serve_with_main_thread(
            lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
            cfg.host,
            cfg.port,
            main=loop.run,
            stop_main=loop.stop,
            ready_message=f"specd target service ({info.model_name}) listening on port {{port}}",
            background=servicer.drafts.run if cfg.draft_addresses else None,
            tls=cfg.tls,
            drain=servicer.drain,
            idle=servicer.idle,
        )
    finally:
        drafter = loop.engine.drafters.get("draft")
        if drafter is not None and hasattr(drafter, "close"):
            drafter.close()
