"""Overload and shutdown on one real ``specd serve --max-batch-size 4 --max-waiting 8``.

1. 64 concurrent streams: each completes or gets a 429 with Retry-After, nothing else; then nothing
   is left running and the next request succeeds (the counts match on both sides).
2. SIGTERM with 4 streams running: all 4 finish normally, a request sent meanwhile gets a 503 (or a
   refused connection), never a hang, and every process exits 0 within 60 s.

One start-up for both (the second ends the server).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from specd.services.common.ports import free_ports
from specd.services.common.process import specd_command
from tests.e2e.processes import REPO, alive, children, http_get, metric_sum, metric_value

pytestmark = pytest.mark.demo

MAX_BATCH, MAX_WAITING = 4, 8


@dataclass
class Serve:
    proc: subprocess.Popen
    port: int
    target_metrics: int
    draft_metrics: int
    log: Path
    kids: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self, port: int) -> str:
        return http_get(f"http://127.0.0.1:{port}/metrics")[1]


@pytest.fixture(scope="module")
def serve(tmp_path_factory) -> Iterator[Serve]:
    port, draft_port, target_port, draft_metrics, target_metrics = free_ports(5)
    log = tmp_path_factory.mktemp("overload") / "serve.log"
    args = specd_command("serve", "--host", "127.0.0.1", "--port", str(port),
            "--draft-port", str(draft_port), "--target-port", str(target_port),
            "--draft-metrics-port", str(draft_metrics), "--target-metrics-port", str(target_metrics),
            "--dtype", "float32", "--max-batch-size", str(MAX_BATCH), "--max-waiting", str(MAX_WAITING),
            "--drain-timeout", "30")  # fmt: skip
    with open(log, "wb") as f:
        p = subprocess.Popen(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, process_group=0)
    s = Serve(p, port, target_metrics, draft_metrics, log)
    try:
        deadline = time.monotonic() + 180
        while "specd is ready" not in log.read_text():
            assert p.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        s.kids = children(p.pid)
        yield s
    finally:
        for pid in [p.pid, *s.kids]:  # only what this fixture started, by process group
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


@dataclass
class StreamResult:
    status: int
    headers: dict
    events: list = field(default_factory=list)  # parsed SSE data objects
    done: bool = False  # saw [DONE]
    body: dict | None = None  # the JSON body of a refusal
    ended_at: float = 0.0
    first_at: float | None = None


async def _stream(client: httpx.AsyncClient, body: dict, first: asyncio.Event | None = None) -> StreamResult:
    async with client.stream("POST", "/v1/completions", json=body) as r:
        res = StreamResult(r.status_code, dict(r.headers))
        if r.status_code != 200:
            res.body = json.loads(await r.aread())
            res.ended_at = time.monotonic()
            return res
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                res.done = True
            elif line.startswith("data: "):
                res.events.append(json.loads(line[6:]))
                if res.first_at is None and res.events[-1].get("choices"):
                    res.first_at = time.monotonic()
                    if first is not None:
                        first.set()
        res.ended_at = time.monotonic()
        return res


def _completed(res: StreamResult, max_tokens: int | None = None) -> bool:
    """A normal end: finish_reason, usage, [DONE], and no error event."""
    if res.status != 200 or not res.done or any("error" in e for e in res.events):
        return False
    finishes = [c["finish_reason"] for e in res.events for c in e.get("choices", []) if c["finish_reason"]]
    usage = res.events[-1].get("usage")
    if len(finishes) != 1 or usage is None:
        return False
    return max_tokens is None or usage["completion_tokens"] == max_tokens


def _wait_idle(s: Serve, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        running = metric_value(s.metrics(s.target_metrics), "specd_requests_running")
        sequences = metric_value(s.metrics(s.draft_metrics), "specd_draft_sequences")
        if running == 0 and sequences == 0:
            return
        assert time.monotonic() < deadline, f"still running: {running} requests, {sequences} draft sequences"
        time.sleep(0.1)


def test_overload_is_429_with_retry_after_and_loses_nothing(serve) -> None:
    s = serve
    body = {"prompt": "def f(x):", "max_tokens": 48, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    async def run() -> list[StreamResult]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=s.url, timeout=120, limits=limits) as client:
            bodies = [{**body, "temperature": 0.0 if i % 2 else 0.8, "seed": i} for i in range(64)]
            return await asyncio.gather(*(_stream(client, b) for b in bodies))

    results = asyncio.run(run())
    done = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    assert len(done) + len(refused) == 64, sorted({r.status for r in results})
    assert all(_completed(r, 48) for r in done)
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.body["error"]["type"] == "rate_limit_exceeded", r.body
        assert r.body["error"]["code"] == "rate_limit_exceeded"
    # 64 at once cannot all fit in 4 running + 8 waiting, and at least that many are served.
    assert refused and len(done) >= MAX_BATCH + MAX_WAITING, (len(done), len(refused))
    _wait_idle(s)
    target = s.metrics(s.target_metrics)
    assert metric_value(target, "specd_requests_rejected_total", 'reason="queue_full"') == len(refused)
    gateway = s.metrics(s.port)
    assert metric_value(gateway, "specd_requests_total", 'status="429"') == len(refused)
    assert metric_value(gateway, "specd_requests_total", 'status="200"') == len(done)
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert metric_sum(s.metrics(s.port), "specd_requests_total") == 65


def test_sigterm_drains_running_streams_and_exits(serve) -> None:
    s = serve
    max_tokens = 200
    body = {"prompt": "import os\n", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip

    async def run() -> tuple[list[StreamResult], float, str]:
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            firsts = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(_stream(client, body, f)) for f in firsts]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
            sent_at = time.monotonic()
            os.kill(s.proc.pid, signal.SIGTERM)
            # Once the gateway drains, /health is 503; a request sent then must be refused at once.
            async with httpx.AsyncClient(base_url=s.url, timeout=10) as other:
                while True:
                    try:
                        if (await other.get("/health")).status_code == 503:
                            break
                    except httpx.TransportError:
                        break
                    assert time.monotonic() - sent_at < 10, "the gateway never started draining"
                    await asyncio.sleep(0.05)
                try:
                    r = await other.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
                    outcome = f"{r.status_code} {r.json()['error']['code']}"
                except httpx.ConnectError:
                    outcome = "refused"
            refused_at = time.monotonic()
            return await asyncio.gather(*streams), refused_at, outcome

    results, refused_at, outcome = asyncio.run(run())
    assert outcome in ("503 service_unavailable", "refused"), outcome
    assert all(_completed(r, max_tokens) for r in results), [(r.status, r.events[-1:]) for r in results]
    # The drain really overlapped the streams: they were still running when the new request was refused.
    assert all(r.ended_at > refused_at for r in results)
    assert s.proc.wait(timeout=60) == 0, s.log.read_text()[-3000:]
    deadline = time.monotonic() + 5
    while any(alive(k) for k in s.kids):
        assert time.monotonic() < deadline, s.log.read_text()[-3000:]
        time.sleep(0.1)
    log = s.log.read_text()
    assert "killing it" not in log and "Traceback" not in log, log[-3000:]
