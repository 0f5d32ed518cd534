"""The engine's loop: it owns the :class:`Engine` and steps it while there is work.

It runs on the process's main thread (:meth:`EngineLoop.run`; services/common/main_thread.py says
why).

gRPC handlers (on the asyncio loop) talk to it only through :meth:`EngineLoop.submit`,
:meth:`EngineLoop.abort` and :meth:`EngineLoop.call`, which enqueue commands; what comes back goes
through each request's ``sink`` (a thread-safe callback): :data:`ACCEPTED` once the engine has
validated and queued the request (or the :class:`RequestError` that refused it), then its outputs.
Nothing else touches the engine, so it needs no locks.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from specd.services.engine.engine import Engine, Request, StepOutput
from specd.services.engine.errors import RequestError
from specd.services.target.metrics import SpecExporter

log = logging.getLogger(__name__)


class _Accepted:
    def __repr__(self) -> str:
        return "ACCEPTED"


ACCEPTED = _Accepted()  # first on a request's sink when the engine took it
Sink = Callable[[StepOutput | Exception | _Accepted], None]


class EngineLoop:
    """Runs ``engine.step()`` rounds on the thread that calls :meth:`run`; routes outputs to sinks."""

    def __init__(self, engine: Engine, exporter: SpecExporter) -> None:
        self.engine = engine
        self.exporter = exporter
        self.inbox: queue.Queue = queue.Queue()
        self.sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        self.running = False

    def stop(self) -> None:
        """Ask the loop to return (safe from a signal handler or another thread)."""
        self._stop.set()
        self.inbox.put(("wake",))

    def submit(self, req: Request, sink: Sink) -> None:
        """Validate and queue ``req`` on the engine thread; ``sink`` hears ACCEPTED or the
        RequestError first."""
        self.inbox.put(("add", req, sink))

    def abort(self, request_id: str, sink: Sink) -> None:
        """Stop the request ``sink`` was submitted with (not another one that has its id)."""
        self.inbox.put(("abort", request_id, sink))

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread before the next round (e.g. new draft endpoints)."""
        self.inbox.put(("call", fn))

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, req, sink = cmd
            try:
                self.engine.add_request(req)
            except RequestError as e:
                sink(e)
                return
            self.sinks[req.request_id] = sink
            sink(ACCEPTED)
        elif cmd[0] == "abort":
            _, rid, sink = cmd
            if self.sinks.get(rid) == sink:
                self.engine.abort(rid)
                del self.sinks[rid]
        elif cmd[0] == "call":
            try:
                cmd[1]()
            except Exception:  # a bug there must not take the engine down
                log.exception("engine-thread call failed")

    def _drain(self) -> None:
        idle = not self.engine.has_work()
        while True:
            try:
                cmd = self.inbox.get(timeout=0.5) if idle else self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(cmd)
            idle = False  # after the first command, take whatever else is queued without waiting

    def run(self) -> None:
        """Step until :meth:`stop`; blocks the calling thread."""
        self.running = True
        try:
            self._loop()
        finally:
            self.running = False

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain()
            rounds = self.engine.rounds
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug or an OOM must not take the service down
                log.exception("engine step failed; failing its requests")
                self._fail_all(e)
                continue
            if self.engine.rounds != rounds:
                r = self.engine.last_round
                self.exporter.record_round(outputs, r.batch_size, r.draft_seconds, r.verify_seconds)
            self.exporter.record_prompts(self.engine.prompt_tokens, self.engine.cached_prompt_tokens)
            self.exporter.set_running(len(self.engine.running) + len(self.engine.waiting))
            self.exporter.set_kv_slots(self.engine.active_slots)
            for out in outputs:
                sink = self.sinks.get(out.request_id)
                if out.finished:
                    self.sinks.pop(out.request_id, None)
                if sink is not None:
                    sink(out)

    def _fail_all(self, error: Exception) -> None:
        for rid, sink in list(self.sinks.items()):
            sink(error)
            self.engine.abort(rid)
        self.sinks.clear()
        try:
            self.engine.step()  # evicts the aborted requests and frees their caches
        except Exception:
            log.exception("could not evict after a failed step")
