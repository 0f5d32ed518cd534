"""``specd serve``: the draft service, the target service and the gateway as three local processes.

A supervisor, not a cluster manager: it starts the three ``specd`` subcommands, waits until the
gateway's /health says the whole chain is ready, prints the URL, and on Ctrl-C or SIGTERM stops
them (gateway, target, draft), each draining its in-flight work first. Each child runs in its own
process group (so a terminal's Ctrl-C reaches only the supervisor, which then stops them) and is
asked by the kernel to exit if the supervisor dies (PR_SET_PDEATHSIG), so no orphan outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from specd.services.common.affinity import CorePlan, pin_then
from specd.services.common.constants import DEFAULT_DTYPE, DRAFT_AHEAD_DEFAULT
from specd.services.common.drain import DEFAULT_DRAIN_TIMEOUT
from specd.services.common.process import die_with_parent, specd_command


@dataclass(frozen=True)
class ServeConfig:
    target: str
    draft: str | None
    host: str = "127.0.0.1"
    port: int = 8000
    draft_port: int = 50051
    target_port: int = 50052
    draft_metrics_port: int = 9101
    target_metrics_port: int = 9102
    dtype: str = DEFAULT_DTYPE
    draft_dtype: str | None = None  # default: dtype
    draft_threads: int | None = None  # default: 1 on CPU (see _commands), torch's default elsewhere
    draft_quantize: str | None = None
    quantize: str | None = None  # the target's: "int8" | "int4"
    device: str = "cpu"
    api_key: str | None = None
    num_speculative_tokens: int | None = None  # None: the target's default
    max_batch_size: int = 16
    max_waiting: int = 64
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    max_model_len: int | None = None  # None: each model's own context
    kv_cache_memory: int | None = None  # bytes of each model's KV pool; None: the services' default
    prefill_chunk: int | None = None  # None: the services' default
    startup_timeout: float = 300.0
    draft_ahead: bool = DRAFT_AHEAD_DEFAULT  # the draft prepares each sequence's next block while the target verifies
    prefix_caching: bool = True  # target and draft reuse the K/V of earlier prompts' common prefixes
    pin_cores: CorePlan | None = None  # draft + gateway and the target on disjoint cores (None: unpinned)
    pin_seeded: bool = True  # the target's --seeded-plans: pinned (True) or measured


def _commands(cfg: ServeConfig) -> list[tuple[str, list[str]]]:

    def model_service(role: str, model: str, port: int, metrics_port: int, dtype: str) -> list[str]:
        cmd = [*specd_command(role), "--model", model, "--port", str(port), "--metrics-port", str(metrics_port),
               "--dtype", dtype, "--device", cfg.device, "--host", "127.0.0.1",
               "--drain-timeout", str(cfg.drain_timeout)]  # fmt: skip
        for flag, value in (
            ("--max-model-len", cfg.max_model_len),
            ("--kv-cache-memory", cfg.kv_cache_memory),
            ("--prefill-chunk", cfg.prefill_chunk),
        ):
            if value is not None:
                cmd += [flag, str(value)]
        return cmd

    cmds = []
    if cfg.draft:
        draft = model_service("draft", cfg.draft, cfg.draft_port, cfg.draft_metrics_port, cfg.draft_dtype or cfg.dtype)
        if cfg.pin_cores is not None:
            draft += ["--threads", str(cfg.draft_threads or cfg.pin_cores.threads_of("draft"))]
        elif cfg.device == "cpu":
            # Sharing the cores with the target, a one-thread draft measured faster (its steps on a
            # 2.5M model gain nothing from a second thread, and its idle OpenMP threads get in the
            # target's way): direct gRPC 308-330 vs 298-309 tok/s with the draft, 174 vs 157-165 without;
            # through the whole stack (interleaved A/B, 5 passes at concurrency 1) 238 vs 219 tok/s.
            draft += ["--threads", str(cfg.draft_threads or 1)]
        elif cfg.draft_threads:
            draft += ["--threads", str(cfg.draft_threads)]
        if cfg.draft_quantize:
            draft += ["--quantize", cfg.draft_quantize]
        draft += ["--prefix-caching", "on" if cfg.prefix_caching else "off"]
        cmds.append(("draft", draft))
    target = model_service("target", cfg.target, cfg.target_port, cfg.target_metrics_port, cfg.dtype)
    if cfg.num_speculative_tokens is not None:
        target += ["--num-speculative-tokens", str(cfg.num_speculative_tokens)]
    if cfg.quantize:
        target += ["--quantize", cfg.quantize]
    target += ["--max-batch-size", str(cfg.max_batch_size), "--max-waiting", str(cfg.max_waiting)]
    target += ["--prefix-caching", "on" if cfg.prefix_caching else "off"]
    target += ["--seeded-plans", "pinned" if cfg.pin_seeded else "measured"]
    if cfg.draft:
        target += [
            "--draft-address",
            f"127.0.0.1:{cfg.draft_port}",
            "--draft-ahead",
            "on" if cfg.draft_ahead else "off",
        ]
    if cfg.pin_cores is not None:
        target += ["--threads", str(cfg.pin_cores.threads_of("target"))]
    cmds.append(("target", target))
    gw = [
        *specd_command("gateway"),
        "--target-address",
        f"127.0.0.1:{cfg.target_port}",
        "--port",
        str(cfg.port),
        "--host",
        cfg.host,
        "--drain-timeout",
        str(cfg.drain_timeout),
    ]
    if cfg.api_key:
        gw += ["--api-key", cfg.api_key]
    cmds.append(("gateway", gw))
    return cmds


def child_options(cfg: ServeConfig, name: str, env: dict[str, str]) -> dict:
    """``subprocess.Popen`` options of one child: its own process group, gone with its parent, and
    with ``--pin-cores`` restricted to its side's cores with as many OpenMP threads."""
    if cfg.pin_cores is None:
        return {"env": env, "process_group": 0, "preexec_fn": die_with_parent}
    threads = str(cfg.pin_cores.threads_of(name))
    return {
        "env": {**env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
        "process_group": 0,
        "preexec_fn": pin_then(cfg.pin_cores.cores_of(name), die_with_parent),
    }


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(procs: list[tuple[str, subprocess.Popen]], drain_timeout: float) -> bool:
    """SIGTERM to all at once: each drains (refuses new work, finishes what it has) and exits; the
    gateway goes first so nothing new reaches the others. Anything left after the drain is killed.

    True when every child that was still running exited 0 by itself."""
    running = [(name, p) for name, p in reversed(procs) if p.poll() is None]
    for _, p in running:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + drain_timeout + 10
    clean = True
    for name, p in running:
        try:
            code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"specd serve: {name} did not stop; killing it", file=sys.stderr)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            clean = False
            continue
        if code != 0:
            print(f"specd serve: {name} exited with status {code} while stopping", file=sys.stderr)
            clean = False
    return clean


def serve(cfg: ServeConfig) -> int:
    """Run until Ctrl-C / SIGTERM or until a child dies; returns an exit status."""
    env = dict(os.environ)  # GOMP_SPINCOUNT included: the CLI set it (services/common/runtime.py)
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    procs: list[tuple[str, subprocess.Popen]] = []
    status = 1
    try:
        status = _run(cfg, procs, env, lambda: stopping)
    finally:
        if not _stop(procs, cfg.drain_timeout):
            status = 1
    return status


def _run(
    cfg: ServeConfig, procs: list[tuple[str, subprocess.Popen]], env: dict, is_stopping: Callable[[], bool]
) -> int:
    """Start the children into ``procs`` and watch them until a signal; the exit status so far."""
    for name, cmd in _commands(cfg):
        procs.append((name, subprocess.Popen(cmd, **child_options(cfg, name, env))))
    health = f"http://127.0.0.1:{cfg.port}/health"
    deadline = time.monotonic() + cfg.startup_timeout
    while not is_stopping() and not _healthy(health):
        dead = [n for n, p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            print(f"specd serve: {', '.join(dead) or 'start-up'} failed; stopping", file=sys.stderr)
            return 1
        time.sleep(0.3)
    if is_stopping():
        return 0
    host = "localhost" if cfg.host in ("0.0.0.0", "127.0.0.1") else cfg.host
    if cfg.pin_cores is not None:
        d, t = (",".join(map(str, sorted(c))) for c in (cfg.pin_cores.draft, cfg.pin_cores.target))
        print(f"specd serve: draft and gateway on cores {d}, target on cores {t}", flush=True)
    print(
        f"specd is ready: http://{host}:{cfg.port}/v1 (OpenAI API)  |  metrics: gateway :{cfg.port}/metrics, "
        f"target :{cfg.target_metrics_port}/metrics"
        + (f", draft :{cfg.draft_metrics_port}/metrics" if cfg.draft else ""),
        flush=True,
    )
    while not is_stopping():
        dead = [n for n, p in procs if p.poll() is not None]
        if dead:
            print(f"specd serve: {', '.join(dead)} exited; stopping", file=sys.stderr)
            return 1
        time.sleep(0.2)
    return 0
