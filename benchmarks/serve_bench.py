"""``specd bench --serve``: the whole stack (gateway + target + draft processes) against the engine.

In one run, interleaved:

- **through the stack**: streaming ``/v1/completions`` requests at concurrency 1, 4 and 16, with
  speculation off (``none``) and on (``draft`` at each block size k asked for; a request carries
  its own k, so one stack serves them all), greedy, exactly ``max_tokens`` tokens each;
- **in-process**: the same prompts through the :class:`Engine` in this process, batch 1, ``none``
  and ``draft`` at each k, once per pass, right after that pass's concurrency-1 runs (the stack is
  idle meanwhile).
  Interleaving matters: this machine drifts by several percent over minutes, and a ratio of two
  speed-ups measured minutes apart inherits that drift.

Reported per (concurrency, method): time to first token, time between tokens p50/p99 (a chunk of n
tokens counts as n gaps of its interval / n, as the gateway's histogram does), aggregate tokens/s,
the speed-up of ``draft`` over ``none``, and at concurrency 1 the stack's overhead against the
in-process engine: per token, and as the share of the in-process speed-up the stack keeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.engine_bench import CODE_PROMPTS
from services.common.ports import free_ports
from services.common.process import die_with_parent
from services.engine.engine import EngineConfig, Request, SpecConfig
from services.engine.sampling import SamplingParams


@dataclass(frozen=True)
class ServeBenchConfig:
    target: str
    draft: str
    dtype: str = "bfloat16"
    ks: tuple[int, ...] = (3,)  # block sizes for "draft", each measured side by side
    max_tokens: int = 96
    concurrencies: tuple[int, ...] = (1, 4, 16)
    repeats: int = 3
    out_dir: str = "benchmarks/results"
    quick: bool = False

    def __post_init__(self) -> None:
        if not self.ks or len(set(self.ks)) != len(self.ks) or not all(1 <= k <= 16 for k in self.ks):
            raise ValueError(f"--k for --serve: distinct block sizes from 1 to 16, got {self.ks}")

    @property
    def modes(self) -> tuple[int, ...]:
        """Every mode measured, as k: 0 (speculation off, the baseline) first, then each k."""
        return (0, *self.ks)


def _mode(k: int) -> str:
    """The label of a speculation mode: "none" for k = 0, else "draft k=<k>"."""
    return "none" if k == 0 else f"draft k={k}"


@dataclass
class LoadResult:
    concurrency: int
    k: int  # 0: speculation off
    tokens: int = 0
    wall_seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds else 0.0


class _Stack:
    """``specd serve`` in its own process group, on free ports."""

    def __init__(self, cfg: ServeBenchConfig) -> None:
        self.port, *others = free_ports(5)
        args = [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--target",
            cfg.target,
            "--draft",
            cfg.draft,
            "--dtype",
            cfg.dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--num-speculative-tokens",
            str(cfg.ks[0]),  # every request names its own k; this is only the server's default
        ]
        for flag in ("--draft-port", "--target-port", "--draft-metrics-port", "--target-metrics-port"):
            args += [flag, str(others.pop())]
        self.log = open(Path(cfg.out_dir) / "serve_bench.log.tmp", "wb")  # noqa: SIM115
        # die_with_parent: a bench killed outright (a test's timeout, say) takes its stack with it.
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, process_group=0, preexec_fn=die_with_parent
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("specd serve exited during start-up; see serve_bench.log.tmp")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("specd serve did not become healthy")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the supervisor stops its three children
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


async def _one_stream(client: httpx.AsyncClient, prompt: str, k: int, cfg: ServeBenchConfig, res: LoadResult):
    body = {
        "prompt": prompt,
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        "speculation": {"method": "draft" if k else "none", "num_tokens": k},
    }
    t0 = time.perf_counter()
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                res.proposed += event["usage"]["speculation"]["proposed_tokens"]
                res.accepted += event["usage"]["speculation"]["accepted_tokens"]
            if not event["choices"]:
                continue
            n = len(event["choices"][0].get("token_ids", []))
            if n == 0:
                continue
            now = time.perf_counter()
            if last is None:
                res.ttft.append(now - t0)
                res.gaps += [(now - t0) / n] * (n - 1)
            else:
                res.gaps += [(now - last) / n] * n
            last = now
            res.tokens += n


async def _load(url: str, concurrency: int, k: int, cfg: ServeBenchConfig, prompts: list[str]) -> LoadResult:
    res = LoadResult(concurrency, k)
    per_worker = max(1, len(prompts) // concurrency) if concurrency <= len(prompts) else 2
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker(w: int) -> None:
            for j in range(per_worker):
                await _one_stream(client, prompts[(w + j * concurrency) % len(prompts)], k, cfg, res)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        res.wall_seconds = time.perf_counter() - t0
    return res


def _merge(into: LoadResult, other: LoadResult) -> None:
    into.tokens += other.tokens
    into.wall_seconds += other.wall_seconds
    into.ttft += other.ttft
    into.gaps += other.gaps
    into.proposed += other.proposed
    into.accepted += other.accepted


class _InProcess:
    """The engine in this process at batch 1, ``none`` and ``draft`` at each k; passes add into the totals."""

    def __init__(self, cfg: ServeBenchConfig, prompts: list[str]) -> None:
        from services.engine.builder import ModelSpec, build_engine
        from services.engine.chat import encode_text

        self.cfg = cfg
        self.engine = build_engine(
            ModelSpec(cfg.target, cfg.draft, cfg.dtype, cfg.dtype), EngineConfig(max_batch_size=1)
        )
        self.ids = [tuple(encode_text(self.engine.tokenizer, p)) for p in prompts]
        self.tokens = {k: 0 for k in cfg.modes}
        self.seconds = {k: 0.0 for k in cfg.modes}
        self.run_pass(count=False)  # warm-up

    def run_pass(self, count: bool = True) -> dict[int, float]:
        """One pass over the prompts in every mode; returns this pass's tokens/s per k (0: none)."""
        params = SamplingParams(temperature=0.0, max_tokens=self.cfg.max_tokens, ignore_eos=True)
        this = {}
        for k in self.tokens:
            tokens, seconds = 0, 0.0
            for i, p in enumerate(self.ids):
                spec = SpecConfig("draft" if k else "none", k)
                req = Request(f"{k}-{time.monotonic_ns()}-{i}", p, params, spec)
                t0 = time.perf_counter()
                out = self.engine.generate([req])[req.request_id]
                seconds += time.perf_counter() - t0
                tokens += len(out.token_ids)
            this[k] = tokens / seconds
            if count:
                self.tokens[k] += tokens
                self.seconds[k] += seconds
        return this

    def totals(self) -> dict[int, float]:
        return {k: self.tokens[k] / self.seconds[k] for k in self.tokens}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = CODE_PROMPTS[:2] if cfg.quick else CODE_PROMPTS
    concurrencies = (1, 4) if cfg.quick else cfg.concurrencies
    repeats = 1 if cfg.quick else cfg.repeats
    print("loading the in-process engine ...", flush=True)
    inproc = _InProcess(cfg, prompts)
    print(f"starting specd serve ({cfg.dtype}) ...", flush=True)
    stack = _Stack(cfg)
    results: dict[tuple[int, int], LoadResult] = {}
    pass_shares: dict[int, list[float]] = {k: [] for k in cfg.ks}
    try:
        for k in cfg.modes:  # warm-up, not counted
            asyncio.run(_load(stack.url, 2, k, cfg, prompts[:2]))
        for rep in range(repeats):
            c1 = {}
            # Concurrency 1 first and the in-process pass right after it: the two speed-ups that
            # are compared are then measured within a minute of each other.
            order = sorted(concurrencies, key=lambda c: c != 1)
            for n, c in enumerate(order):
                for k in cfg.modes:
                    r = asyncio.run(_load(stack.url, c, k, cfg, prompts))
                    if (c, k) in results:
                        _merge(results[(c, k)], r)
                    else:
                        results[(c, k)] = r
                    if c == 1:
                        c1[k] = r.tokens_per_second
                    print(
                        f"  pass {rep + 1}: concurrency {c:2d} {_mode(k):10s} {r.tokens_per_second:7.1f} tok/s",
                        flush=True,
                    )
                if n == 0:
                    ip = inproc.run_pass()
                    print(
                        f"  pass {rep + 1}: in-process     "
                        + "  ".join(f"{_mode(k)} {v:7.1f}" for k, v in ip.items())
                        + " tok/s",
                        flush=True,
                    )
            if 1 in concurrencies:
                for k in cfg.ks:
                    pass_shares[k].append(round((c1[k] / c1[0]) / (ip[k] / ip[0]), 3))
    finally:
        stack.stop()
    doc = _document(cfg, results, inproc.totals(), concurrencies)
    for k, shares in pass_shares.items():
        doc["concurrency_1"][_mode(k)]["share_kept_per_pass"] = shares
    (out / "serve_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    return doc


def _document(cfg: ServeBenchConfig, results, inproc: dict[int, float], concurrencies) -> dict:
    rows = []
    for c in concurrencies:
        base = results[(c, 0)]
        for k in cfg.modes:
            r = results[(c, k)]
            rows.append(
                {
                    "concurrency": c,
                    "method": "draft" if k else "none",
                    "k": k,
                    "requests": len(r.ttft),
                    "tokens": r.tokens,
                    "tokens_per_second": round(r.tokens_per_second, 1),
                    "speedup": round(r.tokens_per_second / base.tokens_per_second, 3),
                    "ttft_ms_p50": round(1000 * statistics.median(r.ttft), 2),
                    "tbt_ms_p50": round(1000 * _pct(r.gaps, 0.5), 2),
                    "tbt_ms_p99": round(1000 * _pct(r.gaps, 0.99), 2),
                    "acceptance_rate": round(r.accepted / r.proposed, 3) if r.proposed else None,
                }
            )
    c1 = {k: results[(1, k)].tokens_per_second for k in cfg.modes} if 1 in concurrencies else {}
    per_mode = {}
    for k in c1:
        entry = {
            "in_process_tokens_per_second": round(inproc[k], 1),
            "stack_tokens_per_second": round(c1[k], 1),
            "overhead_ms_per_token": round(1000 * (1 / c1[k] - 1 / inproc[k]), 3),
        }
        if k:
            e2e, local = c1[k] / c1[0], inproc[k] / inproc[0]
            entry |= {
                "in_process_speedup": round(local, 3),
                "stack_speedup": round(e2e, 3),
                "share_of_in_process_speedup_kept": round(e2e / local, 3),
            }
        per_mode[_mode(k)] = entry
    return {"config": asdict(cfg), "rows": rows, "concurrency_1": per_mode}


def render(doc: dict) -> str:
    """Markdown tables (the README's)."""
    lines = [
        "| concurrency | speculation | tokens/s | speed-up | TTFT p50 (ms) | TBT p50 (ms) | TBT p99 (ms) "
        "| acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        lines.append(
            f"| {r['concurrency']} | {_mode(r['k'])} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | "
            f"{r['ttft_ms_p50']:.1f} | {r['tbt_ms_p50']:.2f} | {r['tbt_ms_p99']:.2f} | {acc} |"
        )
    c1 = doc["concurrency_1"]
    if not c1:
        return "\n".join(lines)
    lines += [
        "",
        "| concurrency 1 | in-process tok/s | through the stack tok/s | overhead per token (ms) "
        "| in-process speed-up | stack speed-up | share kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, v in c1.items():
        extra = (
            f"{v['in_process_speedup']:.2f}x | {v['stack_speedup']:.2f}x | "
            f"**{100 * v['share_of_in_process_speedup_kept']:.0f}%**"
            if "stack_speedup" in v
            else " | | "
        )
        lines.append(
            f"| {mode} | {v['in_process_tokens_per_second']:.1f} | {v['stack_tokens_per_second']:.1f} | "
            f"{v['overhead_ms_per_token']:.2f} | {extra} |"
        )
    for mode, v in c1.items():
        if v.get("share_kept_per_pass"):
            lines.append(
                f"\n{mode}, share kept per pass: {', '.join(f'{100 * x:.0f}%' for x in v['share_kept_per_pass'])}."
            )
    return "\n".join(lines)
