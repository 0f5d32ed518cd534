"""The target service: configuration, assembly and serving.

:func:`build` loads the target and wires the pieces: the engine (with a
:class:`~specd.services.target.draft_client.RemoteDrafter` when there are draft addresses), the
engine loop that owns it, the draft pool, and the thin servicer (servicer.py; its messages:
convert.py). :func:`serve` runs it until SIGTERM, the engine loop on the main thread.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from specd.services.common.config import ServiceConfig
from specd.services.common.constants import DEFAULT_SPECULATION_METHOD, DRAFT_AHEAD_DEFAULT, MAX_SPECULATIVE_TOKENS
from specd.services.common.discovery import resolve_all
from specd.services.common.drain import DEFAULT_DRAIN_TIMEOUT, Drain
from specd.services.common.grpc_server import start_metrics_server
from specd.services.common.main_thread import serve_with_main_thread
from specd.services.common.runtime import freeze_startup_heap
from specd.services.common.tls import TLSConfig, aio_channel
from specd.services.engine.engine import Engine
from specd.services.target import convert, metrics
from specd.services.target.convert import RequestDefaults
from specd.services.target.draft_client import DraftClientConfig, RemoteDrafter, StreamStates
from specd.services.target.draft_pool import DraftPool
from specd.services.target.loop import EngineLoop
from specd.services.target.servicer import Admission, TargetServicer
from specd.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

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
    default_num_tokens: int | None = None  # None: default_num_tokens(method) (services/common/constants.py)
    draft_round_timeout: float = 2.0
    tensor_parallel_size: int = 1  # shard the target over this many processes (services/engine/tensor_parallel.py)
    quantize: str | None = None  # "int8" | "int4": serve the target quantized at load
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    tls: TLSConfig | None = None  # mutual TLS for this server and for its channels to the drafts
    draft_ahead: bool = DRAFT_AHEAD_DEFAULT  # the drafts prepare each sequence's next block while this target verifies
    prefix_caching: bool = True  # reuse the K/V of earlier prompts' common prefixes (EngineConfig.prefix_caching)
    pin_seeded: bool = True  # seeded sampled requests repeat whatever shares their batch (EngineConfig.pin_seeded)

    @property
    def admission(self) -> Admission:
        return Admission(self.max_batch_size, self.max_waiting)

    @property
    def defaults(self) -> RequestDefaults:
        return RequestDefaults(self.default_method or DEFAULT_SPECULATION_METHOD, self.default_num_tokens)


@dataclass
class TargetService:
    """Everything :func:`serve` runs: the loop (main thread) and the servicer (gRPC thread)."""

    engine: Engine
    loop: EngineLoop
    servicer: TargetServicer


def build(cfg: TargetServerConfig, engine: Engine, draft_endpoints: tuple[str, ...] = (), states=None) -> TargetService:
    """The loop, the draft pool and the servicer around ``engine`` (whose remote drafter, if any,
    speculates with ``draft_endpoints``, ``cfg.draft_addresses`` resolved, and reports to ``states``)."""
    loop = EngineLoop(engine, metrics.SpecExporter())
    drafts = None
    if cfg.draft_addresses:
        drafter = engine.model_drafter
        assert isinstance(drafter, RemoteDrafter), "draft addresses need a remote drafter"
        drafts = DraftPool(
            cfg.draft_addresses,
            draft_endpoints,
            lambda endpoints: loop.call(lambda: drafter.set_addresses(endpoints)),
            drafter.states,
            cfg.discovery_interval,
        )
    limits = engine.limits
    info = convert.info_pb(cfg.model_name, limits, MAX_SPECULATIVE_TOKENS)
    servicer = TargetServicer(
        loop, limits, engine.tokenizer, info, cfg.admission, cfg.defaults, drafts, Drain(cfg.drain_timeout)
    )
    return TargetService(engine, loop, servicer)


def load_engine(cfg: TargetServerConfig, draft_endpoints: tuple[str, ...]) -> Engine:
    """The target model (and tokenizer), speculating with the draft services at ``draft_endpoints``."""
    from specd.services.engine.builder import ModelSpec, load_target, load_tokenizer
    from specd.services.engine.engine import EngineConfig

    tokenizer = load_tokenizer(cfg.model, for_chat=True)
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
            states=StreamStates(),
            on_round=metrics.record_draft_round,
        )
        for a in drafter.addresses:
            metrics.DRAFT_FAILURES.labels(endpoint=a)  # exported as 0 from the start
    ecfg = EngineConfig(
        cfg.max_batch_size,
        cfg.max_model_len,
        prefill_chunk=cfg.prefill_chunk,
        kv_cache_memory=cfg.kv_cache_memory,
        prefix_caching=cfg.prefix_caching,
        pin_seeded=cfg.pin_seeded,
    )
    return Engine(target, tokenizer, None, ecfg, drafter=drafter)


async def _check_drafts(draft_endpoints: tuple[str, ...], vocab_size: int, tls: TLSConfig | None) -> None:
    """Refuse a draft whose vocabulary differs; a draft that is not up yet is only logged."""
    for a in draft_endpoints:
        async with aio_channel(a, tls) as ch:
            try:
                d = await draft_pb2_grpc.DraftServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=2.0)
            except grpc.RpcError:
                log.warning("draft %s is not reachable yet; generating without it until it is", a)
                continue
        if d.vocab_size != vocab_size:
            raise SystemExit(f"draft {a} ({d.model_name}) has vocab {d.vocab_size}, the target {vocab_size}")


def serve(cfg: TargetServerConfig) -> None:
    """Load the target and serve TargetService until SIGTERM; the engine loop runs on this thread."""
    # Resolved once here; the draft pool re-resolves from then on.
    draft_endpoints = resolve_all(cfg.draft_addresses)
    engine = load_engine(cfg, draft_endpoints)
    try:
        asyncio.run(_check_drafts(draft_endpoints, engine.limits.vocab_size, cfg.tls))
        start_metrics_server(cfg.metrics_port)
        metrics.REQUESTS_RUNNING.set(0)
        metrics.KV_SLOTS_USED.set(0)
        metrics.REQUESTS_REJECTED.labels(reason="queue_full")  # exported as 0 from the start
        svc = build(cfg, engine, draft_endpoints)
        servicer = svc.servicer
        freeze_startup_heap()
        serve_with_main_thread(
            lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
            cfg.host,
            cfg.port,
            main=svc.loop.run,
            stop_main=svc.loop.stop,
            ready_message=f"specd target service ({cfg.model_name}) listening on port {{port}}",
            background=servicer.drafts.run if servicer.drafts is not None else None,
            tls=cfg.tls,
            drain=servicer.drain,
            idle=servicer.idle,
        )
    finally:
        engine.close()
