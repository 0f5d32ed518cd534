"""``specd bench --soak``: hours-of-traffic behaviour in minutes, against a real ``specd serve``.

``concurrency`` clients (default 64) send mixed requests back to back for ``duration`` seconds:
streaming and not, chat and completions, greedy and sampled (seeded), 4 to 64 tokens, and one in
ten hangs up midway (a stream after its first chunk, a non-streamed request after a short wait).
Then it waits for the server to settle and reports, against the goals of issue 15:

- **5xx**: responses with a 5xx status, or a stream ending in a 5xx error event (goal 0);
- **lost / hung**: a response that ends without its finish reason and ``[DONE]`` (or a transport
  error) though the client did not hang up, or that takes longer than ``request_timeout`` (goal 0);
- **resident memory growth** of gateway, target and draft from the end of the warm-up to the end
  (goal under 5% each), from ``/proc/PID/status``;
- **back to 0** once idle: the target's requests and KV cache slots, the draft's sequences;
- **Prometheus counts equal to what was sent**: the gateway's ``specd_requests_total`` summed
  over statuses equals the requests sent; its 429s equal the target's rejections.

A benchmark, not a test: it prints a table and writes ``soak_bench.json``; the verdicts are
printed, and the exit status is 1 when a goal is missed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from specd.benchmarks.engine_bench import CODE_PROMPTS
from specd.services.common.ports import free_ports
from specd.services.common.process import die_with_parent, specd_command

CHAT_QUESTIONS = [
    "Explain what a Python generator is.",
    "Write a function that reverses a string.",
    "What does `os.path.join` do?",
    "How do I read a file line by line?",
]


@dataclass(frozen=True)
class SoakConfig:
    target: str
    draft: str
    dtype: str = "bfloat16"
    duration: float = 300.0  # seconds of traffic
    warmup: float | None = None  # seconds before the memory baseline; default 10% of the duration (>= 10 s)
    concurrency: int = 64
    min_tokens: int = 4
    max_tokens: int = 64
    disconnect_share: float = 0.1
    request_timeout: float = 120.0  # a response slower than this counts as hung
    seed: int = 0
    out_dir: str = "benchmarks/results"

    @property
    def warmup_seconds(self) -> float:
        return self.warmup if self.warmup is not None else max(10.0, 0.1 * self.duration)


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0  # normal ends
    hung_up: int = 0  # the client left on purpose
    rejected_429: int = 0
    client_errors: int = 0  # other 4xx
    server_errors: int = 0  # 5xx, as a status or as a stream's error event
    lost: int = 0
    hung: int = 0
    tokens: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # the first few failures, for the log

    def failure(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _children(pid: int) -> dict[str, int]:
    """The supervisor's children by role (from their command lines)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != pid:
                continue
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for role in ("draft", "target", "gateway"):
            if role.encode() in argv:
                out[role] = int(d)
    return out


def _metric(text: str, name: str, labels: str = "") -> float | None:
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            if key == want:
                return float(value)
    return None


def _metric_sum(text: str, name: str) -> float:
    return sum(
        float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith((name + "{", name + " "))
    )


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


class _Serve:
    def __init__(self, cfg: SoakConfig, log: Path) -> None:
        self.port, draft_port, target_port, self.draft_metrics, self.target_metrics = free_ports(5)
        args = specd_command("serve", "--target", cfg.target, "--draft", cfg.draft,
                "--dtype", cfg.dtype, "--host", "127.0.0.1", "--port", str(self.port),
                "--draft-port", str(draft_port), "--target-port", str(target_port),
                "--draft-metrics-port", str(self.draft_metrics),
                "--target-metrics-port", str(self.target_metrics))  # fmt: skip
        self.log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, process_group=0, preexec_fn=die_with_parent
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specd serve exited during start-up; see {log}")
            try:
                if "ok" in _get(self.url + "/health"):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("specd serve did not become healthy")
            time.sleep(0.3)
        self.pids = _children(self.proc.pid)

    def metrics(self, which: str) -> str:
        port = {"gateway": self.port, "target": self.target_metrics, "draft": self.draft_metrics}[which]
        return _get(f"http://127.0.0.1:{port}/metrics")

    def stop(self) -> int | None:
        """SIGTERM (the drain), SIGKILL after a minute; the supervisor's exit status."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def _body(rng: random.Random, cfg: SoakConfig) -> tuple[str, dict, str]:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    sampled = rng.random() < 0.5
    body: dict = {
        "max_tokens": rng.randint(cfg.min_tokens, cfg.max_tokens),
        "temperature": 0.8 if sampled else 0.0,
        "stream": stream,
    }
    if sampled:
        body |= {"top_p": 0.95, "seed": rng.randrange(2**31)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(CHAT_QUESTIONS)}]
    else:
        body["prompt"] = rng.choice(CODE_PROMPTS)
    kind = f"{'chat' if chat else 'completion'}/{'stream' if stream else 'full'}/{'sampled' if sampled else 'greedy'}"
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, kind


async def _stream(client: httpx.AsyncClient, path: str, body: dict, hang_up: bool, t: Tally) -> None:
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            _count_status(r.status_code, t, path)
            return
        finish, done, error = None, False, None
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                for c in event.get("choices", []):
                    finish = c.get("finish_reason") or finish
                    if c.get("delta", {}).get("content") or c.get("text"):
                        if hang_up:
                            t.hung_up += 1
                            return  # leaving the block closes the connection: the client is gone
                if event.get("usage"):
                    t.tokens += event["usage"]["completion_tokens"]
        if error is not None:
            if error.get("type") in ("server_error", "service_unavailable", "timeout"):
                t.server_errors += 1
            else:
                t.lost += 1
            t.failure(f"stream error event {error}")
        elif finish and done:
            t.completed += 1  # also a hang-up that came too late: the whole answer had arrived
        else:
            t.lost += 1
            t.failure(f"stream ended without finish/[DONE] ({finish}, {done})")


def _count_status(status: int, t: Tally, path: str) -> None:
    if status == 429:
        t.rejected_429 += 1
    elif status >= 500:
        t.server_errors += 1
        t.failure(f"{status} on {path}")
    else:
        t.client_errors += 1
        t.failure(f"{status} on {path}")


async def _full(client: httpx.AsyncClient, path: str, body: dict, hang_up: bool, t: Tally, rng: random.Random):
    call = client.post(path, json=body)
    if hang_up:
        try:
            # Late enough that the request has reached the gateway (so it is counted there).
            r = await asyncio.wait_for(call, rng.uniform(0.2, 1.0))
        except TimeoutError:
            t.hung_up += 1  # cancelled mid-request: httpx closes the connection
            return
    else:
        r = await call
    if r.status_code != 200:
        _count_status(r.status_code, t, path)
        return
    data = r.json()
    if data.get("choices") and data["choices"][0].get("finish_reason"):
        t.completed += 1
        t.tokens += data["usage"]["completion_tokens"]
    else:
        t.lost += 1
        t.failure(f"full response without finish_reason: {str(data)[:200]}")


async def _traffic(cfg: SoakConfig, url: str, t: Tally, rss_at_warmup, serve: _Serve) -> None:
    end = time.monotonic() + cfg.duration
    warm_end = time.monotonic() + cfg.warmup_seconds
    limits = httpx.Limits(max_connections=cfg.concurrency + 8, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=cfg.request_timeout + 30, limits=limits) as client:

        async def worker(w: int) -> None:
            rng = random.Random(cfg.seed * 1000 + w)
            while time.monotonic() < end:
                path, body, kind = _body(rng, cfg)
                hang_up = rng.random() < cfg.disconnect_share
                t.sent += 1
                t.by_kind[kind] = t.by_kind.get(kind, 0) + 1
                try:
                    call = (
                        _stream(client, path, body, hang_up, t)
                        if body["stream"]
                        else _full(client, path, body, hang_up, t, rng)
                    )
                    await asyncio.wait_for(call, cfg.request_timeout)
                except TimeoutError:
                    t.hung += 1
                    t.failure(f"hung past {cfg.request_timeout} s: {kind}")
                except httpx.HTTPError as e:
                    t.lost += 1
                    t.failure(f"transport error {type(e).__name__}: {e}")

        async def sampler() -> None:
            await asyncio.sleep(max(0.0, warm_end - time.monotonic()))
            rss_at_warmup.update({role: _rss_kib(pid) for role, pid in serve.pids.items()})

        await asyncio.gather(sampler(), *(worker(w) for w in range(cfg.concurrency)))


def run_soak(cfg: SoakConfig) -> int:
    """Run the soak; prints the report, writes ``soak_bench.json``; 0 when every goal is met."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"soak: {cfg.concurrency} clients for {cfg.duration:.0f} s (warm-up {cfg.warmup_seconds:.0f} s)", flush=True)
    serve = _Serve(cfg, out / "soak_bench.log.tmp")
    t = Tally()
    rss_warm: dict[str, int | None] = {}
    try:
        t0 = time.monotonic()
        asyncio.run(_traffic(cfg, serve.url, t, rss_warm, serve))
        traffic_seconds = time.monotonic() - t0
        rss_end = {role: _rss_kib(pid) for role, pid in serve.pids.items()}
        # Settle: cancelled requests are freed at the next round; give it a few seconds.
        deadline = time.monotonic() + 15
        while True:
            target, draft = serve.metrics("target"), serve.metrics("draft")
            left = {
                "target_requests_running": _metric(target, "specd_requests_running"),
                "target_kv_slots_used": _metric(target, "specd_kv_slots_used"),
                "draft_sequences": _metric(draft, "specd_draft_sequences"),
            }
            if all(v == 0 for v in left.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        gateway = serve.metrics("gateway")
        counted = {
            "gateway_requests_total": _metric_sum(gateway, "specd_requests_total"),
            "gateway_429": _metric(gateway, "specd_requests_total", 'status="429"') or 0.0,
            "target_rejected": _metric(target, "specd_requests_rejected_total", 'reason="queue_full"') or 0.0,
        }
    finally:
        exit_status = serve.stop()
    growth = {
        role: (rss_end[role] - rss_warm[role]) / rss_warm[role]
        for role in rss_end
        if rss_end.get(role) and rss_warm.get(role)
    }
    goals = {
        "no 5xx": t.server_errors == 0,
        "no lost or hung streams": t.lost == 0 and t.hung == 0,
        "RSS growth under 5% after warm-up": bool(growth) and all(g < 0.05 for g in growth.values()),
        "back to 0 when idle": all(v == 0 for v in left.values()),
        "Prometheus counts equal what was sent": counted["gateway_requests_total"] == t.sent
        and counted["gateway_429"] == t.rejected_429 == counted["target_rejected"],
        "drained and exited 0": exit_status == 0,
    }
    result = {
        "config": asdict(cfg),
        "traffic_seconds": round(traffic_seconds, 1),
        "tally": asdict(t),
        "requests_per_second": round(t.sent / traffic_seconds, 2),
        "tokens_per_second": round(t.tokens / traffic_seconds, 1),
        "rss_kib_after_warmup": rss_warm,
        "rss_kib_end": rss_end,
        "rss_growth": {k: round(v, 4) for k, v in growth.items()},
        "left_when_idle": left,
        "prometheus": counted,
        "serve_exit_status": exit_status,
        "goals": goals,
        "load_average": os.getloadavg(),
    }
    (out / "soak_bench.json").write_text(json.dumps(result, indent=2))
    _print(result)
    return 0 if all(goals.values()) else 1


def _print(r: dict) -> None:
    t = r["tally"]
    print(f"\n{r['traffic_seconds']} s, {t['sent']} requests ({r['requests_per_second']}/s), {t['tokens']} tokens "
          f"({r['tokens_per_second']}/s), load average {', '.join(f'{x:.1f}' for x in r['load_average'])}")  # fmt: skip
    print(f"completed {t['completed']}, hung up on purpose {t['hung_up']}, 429 {t['rejected_429']}, "
          f"other 4xx {t['client_errors']}, 5xx {t['server_errors']}, lost {t['lost']}, hung {t['hung']}")  # fmt: skip
    print("by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(t["by_kind"].items())))
    for role in ("gateway", "target", "draft"):
        if role in r["rss_growth"]:
            before, after = r["rss_kib_after_warmup"][role] / 1024, r["rss_kib_end"][role] / 1024
            growth = 100 * r["rss_growth"][role]
            print(f"RSS {role}: {before:.0f} MiB after warm-up -> {after:.0f} MiB ({growth:+.1f}%)")
    print("when idle: " + ", ".join(f"{k} {v:g}" for k, v in r["left_when_idle"].items() if v is not None))
    p = r["prometheus"]
    print(f"prometheus: gateway requests {p['gateway_requests_total']:g} (sent {t['sent']}), "
          f"429 {p['gateway_429']:g}, target rejections {p['target_rejected']:g}")  # fmt: skip
    for goal, ok in r["goals"].items():
        print(f"  [{'ok' if ok else 'MISSED'}] {goal}")
    for e in t["examples"]:
        print(f"  failure: {e}")
