"""The real servicers, engine loop and gateway in this process, over loopback gRPC and ASGI.

The same objects ``specd draft``, ``specd target`` and ``specd gateway`` run, assembled as their
``serve`` functions assemble them, minus the process around them: a test starts in a fraction of
a second and can reach inside (a servicer's rounds, an engine's messages) where the subprocess
tests can only watch from outside. gRPC servers run on one asyncio loop on a daemon thread (as in
the services, where it is not the main thread either); the engine loop runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specd.services.draft.server import DraftServerConfig, DraftServicer, build_worker
from specd.services.engine.builder import load_tokenizer
from specd.services.engine.engine import Engine, EngineConfig
from specd.services.engine.model import load_model
from specd.services.target.draft_client import DraftClientConfig, RemoteDrafter
from specd.services.target.server import TargetServerConfig, TargetService, build
from specd.v1 import draft_pb2_grpc, target_pb2_grpc


class GrpcThread:
    """An asyncio loop on a daemon thread, serving grpc.aio servers started from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="grpc-aio")
        self.thread.start()
        self.servers: list[grpc.aio.Server] = []

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def serve(self, add: Callable[[grpc.aio.Server], None]) -> tuple[grpc.aio.Server, int]:
        """A server with ``add``'s servicers on a free loopback port: (server, port)."""

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server()
            add(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        server, port = self.run(start())
        self.servers.append(server)
        return server, port

    def stop_server(self, server: grpc.aio.Server) -> None:
        self.run(server.stop(0))
        self.servers.remove(server)

    def close(self) -> None:
        for s in list(self.servers):
            self.stop_server(s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@dataclass
class InProcessDraft:
    servicer: DraftServicer
    server: grpc.aio.Server
    address: str
    rounds: list = field(default_factory=list)  # every DraftRound it served, with its reply

    def spy(self) -> None:
        """Record each round and its reply in ``rounds``."""
        inner = self.servicer._round

        def recorded(stream, rnd):
            reply = inner(stream, rnd)
            self.rounds.append((rnd, reply))
            return reply

        self.servicer._round = recorded


def start_draft(grpc_thread: GrpcThread, model: Path, **cfg) -> InProcessDraft:
    """The draft service on ``model`` (float32), as ``specd draft`` builds it."""
    config = DraftServerConfig(model=str(model), port=0, dtype="float32", **cfg)
    worker, info = build_worker(config)
    servicer = DraftServicer(worker, info)
    server, port = grpc_thread.serve(lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s))
    return InProcessDraft(servicer, server, f"127.0.0.1:{port}")


def target_engine(model: Path, draft_addresses: tuple[str, ...] = (), **engine_cfg) -> Engine:
    """A float32 target engine, speculating with the draft services at ``draft_addresses``."""
    target = load_model(str(model), _float32(), "cpu")
    drafter = None
    if draft_addresses:
        drafter = RemoteDrafter(DraftClientConfig(draft_addresses, round_timeout=30.0), target.info.vocab_size)
    return Engine(target, load_tokenizer(str(model)), None, EngineConfig(**engine_cfg), drafter=drafter)


def _float32():
    import torch

    return torch.float32


@dataclass
class InProcessTarget:
    service: TargetService
    server: grpc.aio.Server
    address: str
    loop_thread: threading.Thread

    def stop(self, grpc_thread: GrpcThread) -> None:
        grpc_thread.stop_server(self.server)
        self.service.loop.stop()
        self.loop_thread.join(timeout=30)
        self.service.engine.close()


def start_target(grpc_thread: GrpcThread, model: Path, draft_addresses: tuple[str, ...] = ()) -> InProcessTarget:
    """The target service as ``specd target`` builds it: engine loop on its own thread, servicer
    on the gRPC thread."""
    cfg = TargetServerConfig(model=str(model), port=0, dtype="float32", draft_addresses=draft_addresses)
    engine = target_engine(model, draft_addresses, max_batch_size=4)
    svc = build(cfg, engine, draft_addresses)
    loop_thread = threading.Thread(target=svc.loop.run, daemon=True, name="engine-loop")
    loop_thread.start()
    server, port = grpc_thread.serve(lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(svc.servicer, s))
    return InProcessTarget(svc, server, f"127.0.0.1:{port}", loop_thread)


@contextmanager
def gateway_client(target_address: str) -> Iterator:
    """A client of the gateway app (its lifespan run: target pool, probes) over ASGI."""
    from fastapi.testclient import TestClient

    from specd.gateway.app import create_app
    from specd.gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(target_addresses=(target_address,), health_interval=0.2))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
