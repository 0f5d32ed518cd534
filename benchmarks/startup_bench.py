"""``specd bench --startup``: how long a cold ``specd generate`` takes to show its first token.

Each run is a new process, ``specd generate --pair NAME --prompt ... --max-tokens 8`` streaming text,
timed from the moment it is spawned to the first byte it prints (the first token). The page cache
is warm after the first run, as it is for anyone who starts the server twice; the first run is
reported apart. Beside it, in the same run, the floor no code of ours can go below: a process that
only imports torch.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specd.services.common.process import specd_command

PROMPT = "def fibonacci(n):\n"


@dataclass(frozen=True)
class StartupConfig:
    pair: str
    runs: int = 5
    out_dir: str = "benchmarks/results"


@dataclass
class StartupResult:
    pair: str
    first_run_seconds: float = 0.0
    seconds: list[float] = field(default_factory=list)  # later runs: spawn to first printed byte
    import_torch_seconds: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "first_run": round(self.first_run_seconds, 2),
            "min": round(min(self.seconds), 2),
            "median": round(statistics.median(self.seconds), 2),
            "max": round(max(self.seconds), 2),
            "import_torch_median": round(statistics.median(self.import_torch_seconds), 2),
        }


def time_to_first_byte(cmd: list[str]) -> float:
    """Seconds from spawning ``cmd`` to the first byte on its stdout (then it is left to finish)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        first = proc.stdout.read(1)
        elapsed = time.perf_counter() - t0
        proc.stdout.read()
        if proc.wait() != 0 or not first:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode})")
        return elapsed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_startup_bench(cfg: StartupConfig) -> StartupResult:
    """Cold starts of ``specd generate`` interleaved with bare ``import torch`` processes."""
    generate = specd_command("generate", "--pair", cfg.pair, "--prompt", PROMPT)
    generate += ["--max-tokens", "8", "--temperature", "0"]
    torch_only = [sys.executable, "-c", "import torch, sys; sys.stdout.write('x')"]
    result = StartupResult(cfg.pair)
    result.first_run_seconds = time_to_first_byte(generate)
    for i in range(cfg.runs):
        result.seconds.append(time_to_first_byte(generate))
        result.import_torch_seconds.append(time_to_first_byte(torch_only))
        first, torch_s = result.seconds[-1], result.import_torch_seconds[-1]
        print(f"run {i + 1}: first token {first:.2f} s, import torch {torch_s:.2f} s")
    summary = result.summary()
    print(
        f"specd generate --pair {cfg.pair}: first token after {summary['median']} s median "
        f"({summary['min']}-{summary['max']}, first run {summary['first_run']} s); "
        f"a process that only imports torch: {summary['import_torch_median']} s"
    )
    out = Path(cfg.out_dir) / f"startup_bench_{cfg.pair}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**asdict(result), "summary": summary, "cpus": os.cpu_count()}, indent=1))
    print(f"wrote {out}")
    return result
