"""The engine's loop: an asyncio task that owns the :class:`Engine` and steps it while there is work.

It runs on the same (main-thread) event loop as the gRPC server. A step blocks the loop for one
round, which costs nothing here: requests that arrive meanwhile could only join at the next round
anyway, and outputs are handed to their handlers right after it. What it saves is measured:

- oneDNN kernels ran ~1.6x slower from any thread but the main one (the demo target: ~183 vs ~110
  tok/s), so model work must stay on the main thread;
- with gRPC on a second thread, every round paid thread hand-offs and GIL contention between the
  two; one thread has neither.

Handlers call :meth:`submit` / :meth:`abort`; each request's ``sink`` queue gets its outputs in
order, and the handler marks each one done (``task_done``) once it has been sent. Before the next
step the loop waits for those sends: otherwise a round's messages would leave only after the next
round, and the client would see tokens in bunches of two rounds.
"""

from __future__ import annotations

import asyncio
import logging

from services.engine.engine import Engine, Request
from services.target.metrics import SpecExporter

log = logging.getLogger(__name__)

Sink = asyncio.Queue  # of StepOutput | Exception
SEND_WAIT_SECONDS = 0.05  # a client whose HTTP/2 window is full must not stall everyone else


class EngineLoop:
    """Steps the engine on the event loop and routes outputs to their sinks."""

    def __init__(self, engine: Engine, exporter: SpecExporter) -> None:
        self.engine = engine
        self.exporter = exporter
        self.sinks: dict[str, Sink] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self.running = False

    def submit(self, req: Request, sink: Sink) -> None:
        """Queue a request; raises ValueError for one the engine refuses."""
        self.engine.add_request(req)
        self.sinks[req.request_id] = sink
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Stop a request (its caches are freed at the start of the next step); False if unknown."""
        known = self.sinks.pop(request_id, None) is not None
        self.engine.abort(request_id)
        self._wake.set()
        return known

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        """Step until :meth:`stop`."""
        self.running = True
        try:
            while not self._stopping:
                if not self.engine.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                sinks = self._round()
                if sinks:
                    await asyncio.wait([asyncio.ensure_future(q.join()) for q in sinks], timeout=SEND_WAIT_SECONDS)
                else:
                    await asyncio.sleep(0)  # let handlers in
        finally:
            self.running = False

    def _round(self) -> list[Sink]:
        """One engine step; returns the sinks it delivered to."""
        rounds = self.engine.rounds
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug or an OOM must not take the service down
            log.exception("engine step failed; failing its requests")
            self._fail_all(e)
            return []
        if self.engine.rounds != rounds:
            r = self.engine.last_round
            self.exporter.record_round(outputs, r.batch_size, r.draft_seconds, r.verify_seconds)
        self.exporter.set_running(len(self.engine.running) + len(self.engine.waiting))
        delivered = []
        for out in outputs:
            sink = self.sinks.pop(out.request_id, None) if out.finished else self.sinks.get(out.request_id)
            if sink is not None:
                sink.put_nowait(out)
                delivered.append(sink)
        return delivered

    def _fail_all(self, error: Exception) -> None:
        for rid, sink in list(self.sinks.items()):
            sink.put_nowait(error)
            self.engine.abort(rid)
        self.sinks.clear()
        try:
            self.engine.step()  # evicts the aborted requests and frees their caches
        except Exception:
            log.exception("could not evict after a failed step")
        self.exporter.set_running(len(self.engine.running) + len(self.engine.waiting))
