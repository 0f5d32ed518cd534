"""``specd ray`` on a local Ray instance: up, stream, scale drafts 1 -> 2 -> 1 (and targets 1 -> 2 -> 1)
with a stream in flight across each change, stream again, down.

The Ray instance is started by this test (``ray.init`` in the test process) and stopped by it; the
``specd ray`` commands are separate processes that connect to it, as a user's would.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from specd.services.common.ports import free_ports
from specd.services.common.process import specd_command
from specd.v1 import common_pb2, target_pb2_grpc
from tests.e2e.conftest import PROMPTS, reference
from tests.e2e.processes import alive

pytestmark = pytest.mark.demo

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    import ray

    # Logical CPUs: the actors' reservations, not a promise of cores (this machine has two).
    ctx = ray.init(num_cpus=8, include_dashboard=False, namespace="specd-test", log_to_driver=False)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


def specd_ray(address: str, *args: str, timeout: float = 600) -> str:
    cmd = specd_command("ray", *args, "--address", address)
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    )
    assert r.returncode == 0, f"{' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r.stdout


def status(address: str) -> dict:
    return json.loads(specd_ray(address, "status"))


def complete(url: str, prompt: int) -> list[int]:
    body = {"prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
    body["return_token_ids"] = True
    ids, done = [], False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                ids.extend(event["choices"][0].get("token_ids", []))
    assert done
    return ids


def draft_endpoints(target_address: str) -> int:
    with grpc.insecure_channel(target_address) as ch:
        h = target_pb2_grpc.TargetServiceStub(ch).Health(common_pb2.HealthRequest(), timeout=10)
    return h.draft_endpoints_total


class Background:
    """Streams completions back to back in a thread for as long as the ``with`` block runs (a scale
    command), so requests are in flight while replicas come and go."""

    def __init__(self, url: str, prompts: list[int]) -> None:
        self.results: list[tuple[int, list[int] | BaseException]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, prompts), daemon=True)

    def _run(self, url: str, prompts: list[int]) -> None:
        i = 0
        while not self.stop.is_set():
            p = prompts[i % len(prompts)]
            i += 1
            try:
                self.results.append((p, complete(url, p)))
            except BaseException as e:  # reported by the test, not lost in the thread
                self.results.append((p, e))

    def __enter__(self) -> Background:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=300)
        assert not self.thread.is_alive(), "a stream hung across the scale change"
        assert len(self.results) >= 2, "too little traffic during the change to mean anything"


def test_ray_up_stream_scale_down(ray_address: str, reference_engine, tmp_path: Path) -> None:
    expected = {}
    for i in range(4):
        ids = reference_engine.tokenizer(PROMPTS[i], add_special_tokens=False)["input_ids"]
        expected[i] = reference(reference_engine, ids, MAX_TOKENS)[0]
    (port,) = free_ports(1)
    up_args = ["up", "--draft-replicas", "1", "--target-replicas", "1", "--dtype", "float32"]
    up_args += ["--host", "127.0.0.1", "--port", str(port), "--log-dir", str(tmp_path / "logs")]
    pids: list[int] = []
    try:
        out = specd_ray(ray_address, *up_args)
        assert f":{port}/v1" in out
        st = status(ray_address)
        url = f"http://127.0.0.1:{port}"
        pids += [r["pid"] for r in st["drafts"] + st["targets"]]
        assert len(st["drafts"]) == 1 and len(st["targets"]) == 1
        assert complete(url, 0) == expected[0]

        # Drafts 1 -> 2 with streams in flight: every stream completes, identical to the target alone.
        with Background(url, [1, 2, 3]) as bg:
            st = json.loads(specd_ray(ray_address, "scale", "--draft-replicas", "2"))
        assert [p for p, ids in bg.results if ids != expected[p]] == [], bg.results
        pids += [r["pid"] for r in st["drafts"]]
        assert len(st["drafts"]) == 2
        assert draft_endpoints(st["targets"][0]["address"]) == 2
        assert complete(url, 1) == expected[1]

        # 2 -> 1, again under traffic.
        with Background(url, [2, 3, 0]) as bg:
            st = json.loads(specd_ray(ray_address, "scale", "--draft-replicas", "1"))
        assert [p for p, ids in bg.results if ids != expected[p]] == [], bg.results
        assert len(st["drafts"]) == 1
        assert draft_endpoints(st["targets"][0]["address"]) == 1

        # Targets 1 -> 2 -> 1 the same way (the gateway's list changes; the removed one drains).
        with Background(url, [0, 1]) as bg:
            st = json.loads(specd_ray(ray_address, "scale", "--target-replicas", "2"))
        assert len(st["targets"]) == 2
        pids += [r["pid"] for r in st["targets"]]
        with Background(url, [2, 3]) as bg2:
            st = json.loads(specd_ray(ray_address, "scale", "--target-replicas", "1"))
        assert len(st["targets"]) == 1
        for p, ids in bg.results + bg2.results:
            assert ids == expected[p], (p, ids)

        assert complete(url, 2) == expected[2]
    finally:
        specd_ray(ray_address, "down", timeout=300)
    assert pids and not any(alive(pid) for pid in set(pids)), "a service process outlived `specd ray down`"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


def test_a_service_whose_port_was_taken_meanwhile_starts_on_new_ports(demo_pair, tmp_path, monkeypatch) -> None:
    """ServiceHost (the body of a service actor) chooses a service's ports, and the service binds
    them seconds later; when one was taken meanwhile the service exits, and the host starts it again
    on new ports (one CI run lost a draft's port to Ray's own workers this way)."""
    import socket

    from specd.services.ray_cluster import actors

    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    chosen: list[list[int]] = []
    first = [taken.getsockname()[1], free_ports(1)[0]]

    def ports(n: int) -> list[int]:
        chosen.append(first if not chosen else free_ports(n))
        return chosen[-1]

    monkeypatch.setattr(actors, "free_ports", ports)
    host = actors.ServiceHost("draft-x", str(tmp_path))
    try:
        info = host.start(["draft", "--model", str(demo_pair[1]), "--dtype", "float32"], timeout=120)
        assert len(chosen) == 2 and info["address"].endswith(f":{chosen[1][0]}")
        assert host.alive()
        assert "already in use" in host.log_path.read_text()  # the first try's error, in the service's log
    finally:
        host.stop()
        taken.close()
