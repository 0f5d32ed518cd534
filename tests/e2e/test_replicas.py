"""Independent replicas: 2 drafts and 2 targets as real processes behind one gateway.

Under load, one draft and one target are SIGKILLed. Every request must complete (greedy output still
token-identical to the target alone) or end with a clean retryable error (a 503, before or during
the stream); none may hang. Non-streaming requests never reach the client half-done, so they must
all complete (retried on the surviving target). The killed replicas are then restarted on the same
ports and must be taken back into service.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from specd.services.common.ports import free_ports
from tests.e2e.conftest import PROMPTS, reference
from tests.e2e.processes import (
    http_get,
    kill_process,
    metric_sum,
    metric_value,
    spawn,
    stop_process,
    wait_grpc,
    wait_http_ok,
)

pytestmark = pytest.mark.demo

MAX_TOKENS = 40
REQUEST_TIMEOUT = 60.0  # a request still open after this counts as hung


@dataclass
class Replicas:
    draft_model: Path
    target_model: Path
    logdir: Path
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = ["d0", "d0m", "d1", "d1m", "t0", "t0m", "t1", "t1m", "gw"]
        self.ports = dict(zip(names, free_ports(len(names))))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gw']}"

    def start_draft(self, name: str) -> None:
        log = self.logdir / f"{name}.log"
        args = ["draft", "--model", str(self.draft_model), "--host", "127.0.0.1", "--dtype", "float32"]
        args += ["--port", str(self.ports[name]), "--metrics-port", str(self.ports[name + "m"]), "--threads", "1"]
        self.procs[name] = p = spawn(args, log)
        wait_grpc(self.ports[name], p, log)

    def start_target(self, name: str) -> None:
        log = self.logdir / f"{name}.log"
        drafts = f"127.0.0.1:{self.ports['d0']},127.0.0.1:{self.ports['d1']}"
        args = ["target", "--model", str(self.target_model), "--host", "127.0.0.1", "--dtype", "float32"]
        args += ["--port", str(self.ports[name]), "--metrics-port", str(self.ports[name + "m"])]
        args += ["--draft-address", drafts, "--draft-timeout", "1.0"]
        self.procs[name] = p = spawn(args, log)
        wait_grpc(self.ports[name], p, log)

    def start(self) -> Replicas:
        self.logdir.mkdir(parents=True, exist_ok=True)
        try:
            for name in ("d0", "d1"):
                self.start_draft(name)
            for name in ("t0", "t1"):
                self.start_target(name)
            log = self.logdir / "gateway.log"
            targets = f"127.0.0.1:{self.ports['t0']},127.0.0.1:{self.ports['t1']}"
            args = ["gateway", "--target-address", targets, "--host", "127.0.0.1", "--port", str(self.ports["gw"])]
            self.procs["gw"] = p = spawn(args, log)
            wait_http_ok(self.url + "/health", p, log)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in ("gw", "t0", "t1", "d0", "d1"):
            if name in self.procs:
                stop_process(self.procs[name])

    def metrics(self, name: str) -> str:
        return http_get(f"http://127.0.0.1:{self.ports[name + 'm']}/metrics")[1]


@pytest.fixture(scope="module")
def replicas(demo_pair, tmp_path_factory) -> Iterator[Replicas]:
    target, draft = demo_pair
    r = Replicas(draft, target, tmp_path_factory.mktemp("replicas")).start()
    try:
        yield r
    finally:
        r.stop()


@dataclass
class Outcome:
    prompt: int
    stream: bool
    started: float
    kind: str  # "ok", "retryable" or "bad: <why>"
    token_ids: list[int] = field(default_factory=list)


async def _one(client: httpx.AsyncClient, url: str, prompt: int, stream: bool) -> Outcome:
    started = time.monotonic()
    body = {
        "prompt": PROMPTS[prompt],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": stream,
        "return_token_ids": True,
    }
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT):
            if not stream:
                r = await client.post(url + "/v1/completions", json=body)
                data = r.json()
                if r.status_code == 200:
                    return Outcome(prompt, stream, started, "ok", data["choices"][0]["token_ids"])
                retryable = r.status_code == 503 and data["error"]["code"] == "service_unavailable"
                return Outcome(prompt, stream, started, "retryable" if retryable else f"bad: {r.status_code} {data}")
            ids: list[int] = []
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    data = json.loads(await r.aread())
                    retryable = r.status_code == 503 and data["error"]["code"] == "service_unavailable"
                    return Outcome(prompt, stream, started, "retryable" if retryable else f"bad: {data}")
                done = False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            if event["error"]["code"] == "service_unavailable":
                                return Outcome(prompt, stream, started, "retryable", ids)
                            return Outcome(prompt, stream, started, f"bad: {event}")
                        ids.extend(event["choices"][0].get("token_ids", []))
                if not done:
                    return Outcome(prompt, stream, started, "bad: stream ended without [DONE]")
                return Outcome(prompt, stream, started, "ok", ids)
    except TimeoutError:
        return Outcome(prompt, stream, started, "bad: hung")
    except httpx.HTTPError as e:
        return Outcome(prompt, stream, started, f"bad: {type(e).__name__} {e}")


async def _load(
    url: str, workers: int, seconds: float, act_after: float, action: Callable[[], None]
) -> tuple[list[Outcome], float]:
    """``workers`` clients send requests back to back for ``seconds``; ``action`` runs (in a
    thread) ``act_after`` seconds in. Returns the outcomes and when the action finished."""
    deadline = time.monotonic() + seconds
    outcomes: list[Outcome] = []

    async def worker(w: int) -> None:
        i = w
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT + 5) as client:
            while time.monotonic() < deadline:
                outcomes.append(await _one(client, url, i % len(PROMPTS), stream=(i // workers + w) % 2 == 0))
                i += workers

    async def act() -> float:
        await asyncio.sleep(act_after)
        await asyncio.to_thread(action)
        return time.monotonic()

    acted_at, *_ = await asyncio.gather(act(), *(worker(w) for w in range(workers)))
    return outcomes, acted_at


def test_kill_one_draft_and_one_target_under_load(replicas: Replicas, reference_engine) -> None:
    r = replicas
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        ids = reference_engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        expected[i] = reference(reference_engine, ids, MAX_TOKENS)[0]

    def kill() -> None:
        kill_process(r.procs["d0"])
        kill_process(r.procs["t0"])

    outcomes, killed_at = asyncio.run(_load(r.url, workers=6, seconds=14.0, act_after=4.0, action=kill))

    bad = [o for o in outcomes if o.kind.startswith("bad")]
    assert not bad, bad[:5]
    for o in outcomes:
        if o.kind == "ok":
            assert o.token_ids == expected[o.prompt], f"prompt {o.prompt} differs from the target alone"
    # Nothing the client had not seen yet may be lost: non-streaming requests all complete.
    assert all(o.kind == "ok" for o in outcomes if not o.stream)
    # Requests that started well after the kill (once the gateway has seen the target go) complete.
    late = [o for o in outcomes if o.started > killed_at + 3.0]
    assert late and all(o.kind == "ok" for o in late)
    assert sum(o.started < killed_at for o in outcomes) >= 6  # the kill really happened under load
    # The surviving target counted the dead draft's failures.
    assert metric_sum(r.metrics("t1"), "specd_draft_failures_total") >= 1

    # Put them back: same ports, fresh processes. Both must be taken into service again.
    r.start_draft("d0")
    r.start_target("t0")

    def back_in_service() -> bool:
        asyncio.run(_burst(r.url))
        verified = metric_value(r.metrics("t0"), "specd_spec_verifications_total") or 0.0
        drafted = metric_value(r.metrics("d0"), "specd_draft_block_seconds_count") or 0.0
        return verified > 0 and drafted > 0

    deadline = time.monotonic() + 60
    while not back_in_service():
        assert time.monotonic() < deadline, "the restarted replicas were not taken back into service"


async def _burst(url: str) -> None:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
        outs = await asyncio.gather(*(_one(client, url, i, stream=False) for i in range(6)))
    assert all(o.kind == "ok" for o in outs), outs
