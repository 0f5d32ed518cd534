"""``specd bench --serve``: the whole stack (gateway + target + draft processes), every speculation mode
side by side, against concurrency.

In one run, interleaved:

- **through the stack**: streaming requests at each concurrency, for each workload (``code``:
  ``/v1/completions`` on code prompts; ``prose``: ``/v1/chat/completions`` on questions) and each
  temperature (0 = greedy), in every mode: ``none`` (speculation off, the baseline), the draft model
  at each fixed k asked for, and ``auto`` (the controller picks k <= the largest k and the drafter
  per sequence and round). A request carries its own mode, so one stack serves them all. Every
  request generates exactly ``max_tokens`` tokens (EOS ignored); no seeds, so ``auto`` plans every
  row from the measured timings.
- **in-process**: the same code prompts through the :class:`Engine` in this process, batch 1,
  greedy, in every mode, once per pass, right after that pass's concurrency-1 greedy code runs (the
  stack is idle meanwhile). Within a cell the modes run in turn, ``none`` and ``auto`` back to back,
  in reverse order every other pass, so a drift over the cell's minutes favours no mode.
  Interleaving matters: this machine drifts by several percent over minutes, and a ratio of two
  speed-ups measured minutes apart inherits that drift.

The stack is started here, process by process (the commands of ``specd serve``, with the target's
``--max-batch-size``), so a batch can hold every concurrent stream.

**Drafting ahead and separate cores.** ``draft_ahead`` lists the ways the draft runs: drafting in
turn (off), drafting ahead (on: services/draft/ahead.py), or both; ``pin_cores`` the layouts:
unpinned (every process on every core) and pinned (``specd serve --pin-cores``: the draft and the
gateway on one core, the target on another, one thread each). Per layout one stack per way is up
at once and the passes alternate between them, so both see the same machine; ``none`` is measured
on the first. Pinned, the load generator runs on the draft's core and the in-process engine on the
target's (one thread: the same hardware as the target, doing the draft's work too).

Reported per (workload, temperature, concurrency, mode): time to first token, time between tokens
p50/p99 (a chunk of n tokens counts as n gaps of its interval / n, as the gateway's histogram does),
tokens/s (the median over passes of each pass's aggregate tokens/s, with every pass's figure beside
it: one pass disturbed by anything else on the machine moves a median of three little, a total a
lot), the speed-up over ``none``, acceptance and the mean k; per (workload,
temperature, concurrency) how ``auto`` compares with the best of ``none`` and every fixed k (the
issue's criterion: >= 0.95x the best, >= 0.97x none), also pass by pass: the median of the passes'
ratios with a 95% bootstrap interval, judged against each bar as *met* (the interval above it),
*within noise* (the interval reaches it) or *not met* (the interval below it); and at concurrency
1 the stack's overhead against the in-process engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from specd.benchmarks.engine_bench import CODE_PROMPTS, COMPARE_PREFIX_CACHING, PROSE_QUESTIONS
from specd.benchmarks.paired_bench import paired_interval
from specd.services.common.affinity import CorePlan
from specd.services.common.constants import DEFAULT_DTYPE, FIXED_NUM_TOKENS
from specd.services.common.ports import free_ports
from specd.services.common.process import stop_process_group
from specd.services.engine.engine import EngineConfig, Request, SpecConfig
from specd.services.engine.sampling import SamplingParams

WORKLOADS = ("code", "prose")
Mode = tuple[str, int]  # (method, k): ("none", 0), ("draft", k), ("auto", largest k)


@dataclass(frozen=True)
class ServeBenchConfig:
    target: str
    draft: str
    dtype: str = DEFAULT_DTYPE
    ks: tuple[int, ...] = (FIXED_NUM_TOKENS,)  # block sizes for "draft", each measured side by side
    auto: bool = True  # also measure "auto" (k up to max(ks))
    max_tokens: int = 96
    concurrencies: tuple[int, ...] = (1, 4, 16)
    workloads: tuple[str, ...] = ("code",)
    temperatures: tuple[float, ...] = (0.0,)
    max_batch_size: int | None = None  # the target's; None: at least the largest concurrency
    repeats: int = 3
    # Requests per cell and pass, at least (each stream runs at least two): at concurrency 4 one
    # request per stream made a pass of 0.3 s, where the start of each request dominates and a pass
    # moved 20-40%; the criteria compare cells to 3-5%.
    min_requests: int = 24
    out_dir: str = "benchmarks/results"
    quick: bool = False
    draft_ahead: tuple[bool, ...] = (False,)  # one stack per value, side by side
    pin_cores: tuple[bool, ...] = (False,)  # layouts, one after the other
    name: str = "serve_bench"  # of the output files: NAME.json, NAME.png
    # Every request carries a seed (its stream's and its own index): a seeded sampled request is
    # planned apart, from its own history (docs/how-it-works.md), and users send seeds.
    seeded: bool = False
    pin_seeded: bool = True  # the target's --seeded-plans (pinned or measured)

    def __post_init__(self) -> None:
        if not self.draft_ahead or len(set(self.draft_ahead)) != len(self.draft_ahead):
            raise ValueError(f"--draft-ahead for --serve: off, on or off,on, got {self.draft_ahead}")
        if not self.pin_cores or len(set(self.pin_cores)) != len(self.pin_cores):
            raise ValueError(f"--pin-cores for --serve: off, on or off,on, got {self.pin_cores}")
        if not self.ks or len(set(self.ks)) != len(self.ks) or not all(1 <= k <= 16 for k in self.ks):
            raise ValueError(f"--k for --serve: distinct block sizes from 1 to 16, got {self.ks}")
        if not self.workloads or any(w not in WORKLOADS for w in self.workloads):
            raise ValueError(f"--workloads: a list of {WORKLOADS}, got {self.workloads}")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"--temperatures: values >= 0, got {self.temperatures}")

    @property
    def modes(self) -> tuple[Mode, ...]:
        """Every mode measured: speculation off (the baseline) first, then each fixed k, then auto."""
        fixed = tuple(("draft", k) for k in self.ks)
        return (("none", 0), *fixed, *((("auto", max(self.ks)),) if self.auto else ()))

    def pass_order(self, rep: int) -> tuple[Mode, ...]:
        """The modes of pass ``rep`` in the order they run: ``none`` and ``auto`` back to back (the
        criterion compares them, and this machine drifts by several percent over the minutes a
        pass of every mode takes), then each fixed k; reversed every other pass so a steady drift
        favours no mode."""
        none, *rest = self.modes
        auto, fixed = (rest[-1:], rest[:-1]) if self.auto else ([], rest)
        order = (none, *auto, *fixed)
        return order if rep % 2 == 0 else order[::-1]

    @property
    def batch_size(self) -> int:
        return self.max_batch_size or max(16, *self.concurrencies)


def _mode(mode: Mode) -> str:
    """The label of a speculation mode: "none", "draft k=<k>" or "auto k<=<k>"."""
    method, k = mode
    return {"none": "none", "draft": f"draft k={k}", "auto": f"auto k<={k}"}[method]


def _paired(a: LoadResult, b: LoadResult) -> list[float]:
    """Each pass's tokens/s of ``a`` over the same pass's of ``b``."""
    return [round(x / y, 3) for x, y in zip(a.pass_rates, b.pass_rates)]


# The bars for auto: against the best of none and every fixed k, and against none.
BAR_VS_BEST = 0.95
BAR_VS_NONE = 0.97
BOOTSTRAP_DRAWS = 2000


def judged(ratios: list[float], bar: float, draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> dict:
    """Paired per-pass ratios against a bar: their median, a 95% bootstrap interval of it, and
    ``met`` (the interval lies above the bar), ``within noise`` (it reaches the bar) or ``not met``
    (it lies below). With few passes the interval is about their range."""
    med, low, high = paired_interval(ratios, draws, seed)
    verdict = "met" if low >= bar else "not met" if high < bar else "within noise"
    return {"median": round(med, 3), "low": round(low, 3), "high": round(high, 3), "bar": bar, "verdict": verdict}


def _judged_cell(j: dict | None) -> str:
    """A verdict for a table cell (older result files have none)."""
    return f"{j['median']:.3f} ({j['low']:.3f}-{j['high']:.3f}) {j['verdict']}" if j else ""


def _ratios(values: list[float] | None) -> str:
    """Per-pass ratios for a table cell (older result files have none)."""
    return " / ".join(f"{x:.2f}" for x in values) if values else ""


def _layout(pinned: bool) -> str:
    return "pinned" if pinned else "unpinned"


def _way(ahead: bool) -> str:
    return "ahead" if ahead else "in turn"


@dataclass
class LoadResult:
    workload: str
    temperature: float
    concurrency: int
    mode: Mode
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    passes: int = 0
    mean_k_sum: float = 0.0  # sum over requests of usage.speculation.mean_k times their passes
    pass_rates: list[float] = field(default_factory=list)  # each pass's aggregate tokens/s
    # The target's blocks of remote guesses during these requests, by source (fresh, prepared,
    # continued, offered), from its metrics before and after each load.
    blocks: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """The median over passes of each pass's aggregate tokens/s."""
        return statistics.median(self.pass_rates)


class _Stack:
    """Draft, target and gateway (``specd serve``'s commands), each in its own process group."""

    def __init__(self, cfg: ServeBenchConfig, draft_ahead: bool = False, cores: CorePlan | None = None) -> None:
        from specd.services.serve import ServeConfig, _commands, child_options

        self.port, draft_port, target_port, draft_metrics, target_metrics = free_ports(5)
        self.target_metrics_url = f"http://127.0.0.1:{target_metrics}/metrics"
        serve_cfg = ServeConfig(
            target=cfg.target,
            draft=cfg.draft,
            host="127.0.0.1",
            port=self.port,
            draft_port=draft_port,
            target_port=target_port,
            draft_metrics_port=draft_metrics,
            target_metrics_port=target_metrics,
            dtype=cfg.dtype,
            draft_ahead=draft_ahead,
            pin_cores=cores,
            max_batch_size=cfg.batch_size,  # every concurrent stream in one batch
            prefix_caching=COMPARE_PREFIX_CACHING,
            pin_seeded=cfg.pin_seeded,
        )
        tag = f"{_layout(cores is not None)}-{'ahead' if draft_ahead else 'in-turn'}"
        self.log = open(Path(cfg.out_dir) / f"{cfg.name}.{tag}.log.tmp", "wb")  # noqa: SIM115
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ)  # GOMP_SPINCOUNT included: each child is the CLI, which sets it (runtime.py)
        try:
            for name, cmd in _commands(serve_cfg):
                # die_with_parent (in child_options): a bench killed outright (a test's timeout, say)
                # takes its stack with it.
                self.procs.append(
                    subprocess.Popen(
                        cmd, stdout=self.log, stderr=subprocess.STDOUT, **child_options(serve_cfg, name, env)
                    )
                )
            self.url = f"http://127.0.0.1:{self.port}"
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 300
        while True:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a service exited during start-up; see serve_bench.log.tmp")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the stack did not become healthy")
            time.sleep(0.3)

    def stop(self) -> None:
        for p in reversed(self.procs):  # gateway first, then target, then draft
            stop_process_group(p, grace=30)
        self.log.close()

    def block_counts(self) -> dict[str, float]:
        """The target's blocks of remote guesses since it started, by source (its counter)."""
        with urllib.request.urlopen(self.target_metrics_url, timeout=5) as r:
            text = r.read().decode()
        counts = {}
        for line in text.splitlines():
            if line.startswith("specd_spec_draft_blocks_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                counts[source] = float(line.rpartition(" ")[2])
        return counts

    def load(self, w: str, t: float, c: int, mode: Mode, cfg: ServeBenchConfig, prompts) -> LoadResult:
        """One load (see _load), with the target's blocks by source counted over it alone: not
        over the warm-up, whose two streams are never offered blocks (OFFER_MAX_ROWS), nor over
        another cell's."""
        before = self.block_counts()
        r = asyncio.run(_load(self.url, w, t, c, mode, cfg, prompts))
        r.blocks = {k: v - before.get(k, 0.0) for k, v in self.block_counts().items()}
        return r


def block_shares(counts: dict[str, float]) -> dict[str, float] | None:
    """Shares of a target's blocks of remote guesses: "prepared", drafted ahead (whole, in part,
    or offered), and "offered", of those the ones verified without waiting."""
    total = sum(counts.values())
    if not total:
        return None
    ahead = counts.get("prepared", 0) + counts.get("continued", 0) + counts.get("offered", 0)
    return {"prepared": ahead / total, "offered": counts.get("offered", 0) / total}


@contextmanager
def _on_cores(cores: frozenset[int] | None, threads: int | None = None) -> Iterator[None]:
    """Run this process on ``cores`` (and torch on ``threads``) for a while; None: leave it be."""
    if cores is None:
        yield
        return
    import torch

    before, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(before_threads)


def _body(
    workload: str, prompt: str, mode: Mode, temperature: float, cfg: ServeBenchConfig, seed: int = 0
) -> tuple[str, dict]:
    method, k = mode
    body = {
        **({"seed": seed} if cfg.seeded else {}),
        "max_tokens": cfg.max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        "speculation": {"method": method, "num_tokens": k},
    }
    if workload == "prose":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def _one_stream(client: httpx.AsyncClient, path: str, body: dict, res: LoadResult) -> None:
    t0 = time.perf_counter()
    last = None
    async with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                sp = event["usage"]["speculation"]
                res.proposed += sp["proposed_tokens"]
                res.accepted += sp["accepted_tokens"]
                res.passes += sp["target_forward_passes"]
                res.mean_k_sum += sp.get("mean_k", 0.0) * sp["target_forward_passes"]
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


def requests_per_stream(cfg: ServeBenchConfig, concurrency: int, prompts: int) -> int:
    """Requests each of ``concurrency`` streams runs one after the other in a pass: at least two,
    and together at least ``cfg.min_requests`` (--quick: the prompts once over, a smoke test)."""
    if cfg.quick:
        return max(1, prompts // concurrency) if concurrency <= prompts else 2
    return max(2, -(-cfg.min_requests // concurrency))


async def _load(
    url: str, workload: str, temperature: float, concurrency: int, mode: Mode, cfg: ServeBenchConfig, prompts
) -> LoadResult:
    res = LoadResult(workload, temperature, concurrency, mode)
    per_worker = requests_per_stream(cfg, concurrency, len(prompts))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker(w: int) -> None:
            for j in range(per_worker):
                prompt = prompts[(w + j * concurrency) % len(prompts)]
                path, body = _body(workload, prompt, mode, temperature, cfg, seed=w * per_worker + j)
                await _one_stream(client, path, body, res)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    res.pass_rates = [res.tokens / wall]
    return res


def _merge(into: LoadResult, other: LoadResult) -> None:
    into.tokens += other.tokens
    into.ttft += other.ttft
    into.gaps += other.gaps
    into.proposed += other.proposed
    into.accepted += other.accepted
    into.passes += other.passes
    into.mean_k_sum += other.mean_k_sum
    _add_blocks(into.blocks, other.blocks)
    into.pass_rates += other.pass_rates


def _add_blocks(into: dict[str, float], counts: dict[str, float]) -> None:
    """Add ``counts`` of blocks by source into ``into``."""
    for source, n in counts.items():
        into[source] = into.get(source, 0.0) + n


class _InProcess:
    """The engine in this process at batch 1, every mode, greedy code; passes add into the totals
    of their layout."""

    def __init__(self, cfg: ServeBenchConfig, prompts: list[str]) -> None:
        from specd.services.engine.builder import ModelSpec, build_engine
        from specd.services.engine.chat import encode_text
        from specd.services.engine.weight_pages import wait_for_engines

        self.cfg = cfg
        self.engine = build_engine(
            ModelSpec(cfg.target, cfg.draft, cfg.dtype, cfg.dtype),
            EngineConfig(max_batch_size=1, prefix_caching=COMPARE_PREFIX_CACHING),
        )
        wait_for_engines([self.engine])  # timed with the weights settled in huge pages (weight_pages.py)
        self.ids = [tuple(encode_text(self.engine.tokenizer, p)) for p in prompts]
        self.tokens: dict[tuple[str, Mode], int] = {}
        self.seconds: dict[tuple[str, Mode], float] = {}
        self.run_pass(None)  # warm-up

    def run_pass(self, layout: str | None) -> dict[Mode, float]:
        """One pass over the prompts in every mode; returns this pass's tokens/s per mode (counted
        into ``layout``'s totals unless None)."""
        params = SamplingParams(temperature=0.0, max_tokens=self.cfg.max_tokens, ignore_eos=True)
        this = {}
        for mode in self.cfg.modes:
            tokens, seconds = 0, 0.0
            for i, p in enumerate(self.ids):
                req = Request(f"{_mode(mode)}-{time.monotonic_ns()}-{i}", p, params, SpecConfig(*mode))
                t0 = time.perf_counter()
                out = self.engine.generate([req])[req.request_id]
                seconds += time.perf_counter() - t0
                tokens += len(out.token_ids)
            this[mode] = tokens / seconds
            if layout is not None:
                self.tokens[(layout, mode)] = self.tokens.get((layout, mode), 0) + tokens
                self.seconds[(layout, mode)] = self.seconds.get((layout, mode), 0.0) + seconds
        return this

    def totals(self) -> dict[tuple[str, Mode], float]:
        return {key: self.tokens[key] / self.seconds[key] for key in self.tokens}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# A result's key: (layout, draft_ahead, workload, temperature, concurrency, mode).
Key = tuple[str, bool, str, float, int, Mode]


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompt_sets = {"code": CODE_PROMPTS, "prose": PROSE_QUESTIONS}
    if cfg.quick:
        prompt_sets = {w: p[:2] for w, p in prompt_sets.items()}
    concurrencies = cfg.concurrencies
    repeats = 1 if cfg.quick else cfg.repeats
    groups = [(w, t) for w in cfg.workloads for t in cfg.temperatures]
    in_process = ("code", 0.0) in groups and 1 in concurrencies
    first_way = cfg.draft_ahead[0]  # "none" is measured on this stack
    inproc = None
    if in_process:
        print("loading the in-process engine ...", flush=True)
        inproc = _InProcess(cfg, prompt_sets["code"])
    results: dict[Key, LoadResult] = {}
    pass_shares: dict[tuple[str, bool, Mode], list[float]] = {}
    for pinned in cfg.pin_cores:
        layout = _layout(pinned)
        cores = CorePlan.parse("auto") if pinned else None
        client = cores.draft if cores else None  # the load generator shares the gateway's core
        print(
            f"{layout}: starting draft, target (--max-batch-size {cfg.batch_size}) and gateway ({cfg.dtype}), "
            f"drafting {' and '.join(_way(a) for a in cfg.draft_ahead)} ...",
            flush=True,
        )
        stacks: dict[bool, _Stack] = {}
        try:
            for ahead in cfg.draft_ahead:
                stacks[ahead] = _Stack(cfg, ahead, cores)
            with _on_cores(client):
                for stack in stacks.values():  # warm-up, not counted
                    for w, t in groups:
                        for mode in cfg.modes:
                            asyncio.run(_load(stack.url, w, t, 2, mode, cfg, prompt_sets[w][:2]))
            for rep in range(repeats):
                for w, t in groups:
                    c1: dict[tuple[bool, Mode], float] = {}
                    # Concurrency 1 first and the in-process pass right after it: the speed-ups that
                    # are compared are then measured within a minute of each other.
                    order = sorted(concurrencies, key=lambda c: c != 1)
                    for n, c in enumerate(order):
                        for mode in cfg.pass_order(rep):
                            for ahead, stack in stacks.items():
                                if mode == cfg.modes[0] and ahead != first_way:
                                    continue
                                with _on_cores(client):
                                    r = stack.load(w, t, c, mode, cfg, prompt_sets[w])
                                key = (layout, ahead, w, t, c, mode)
                                if key in results:
                                    _merge(results[key], r)
                                else:
                                    results[key] = r
                                if c == 1:
                                    c1[(ahead, mode)] = r.tokens_per_second
                                way = f" {_way(ahead):7s}" if len(stacks) > 1 and mode != cfg.modes[0] else " " * 8
                                print(
                                    f"  {layout} pass {rep + 1}: {w:5s} T={t:<4} concurrency {c:2d} {_mode(mode):11s}"
                                    f"{way} {r.tokens_per_second:7.1f} tok/s",
                                    flush=True,
                                )
                        if n == 0 and inproc is not None and (w, t) == ("code", 0.0):
                            with _on_cores(cores.target if cores else None, len(cores.target) if cores else None):
                                ip = inproc.run_pass(layout)
                            print(
                                f"  {layout} pass {rep + 1}: in-process     "
                                + "  ".join(f"{_mode(m)} {v:7.1f}" for m, v in ip.items())
                                + " tok/s",
                                flush=True,
                            )
                            base = c1[(first_way, cfg.modes[0])] / ip[cfg.modes[0]]
                            for (ahead, m), v in c1.items():
                                if m != cfg.modes[0]:
                                    share = round((v / ip[m]) / base, 3)
                                    pass_shares.setdefault((layout, ahead, m), []).append(share)
        finally:
            for stack in stacks.values():
                stack.stop()
    doc = _document(cfg, results, inproc.totals() if inproc else {}, groups, concurrencies)
    for (layout, ahead, m), shares in pass_shares.items():
        doc["concurrency_1"][_c1_label(cfg, layout, ahead, m)]["share_kept_per_pass"] = shares
    (out / f"{cfg.name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    _plot(doc, out / f"{cfg.name}.png")
    print(render(doc))
    print(f"wrote {out / (cfg.name + '.json')} and {out / (cfg.name + '.png')}")
    return doc


def _c1_label(cfg: ServeBenchConfig, layout: str, ahead: bool, mode: Mode) -> str:
    """The concurrency-1 table's key: the mode alone when only one layout and one way were run."""
    if len(cfg.pin_cores) == 1 and len(cfg.draft_ahead) == 1:
        return _mode(mode)
    if mode == cfg.modes[0]:
        return f"{_mode(mode)}, {layout}"
    return f"{_mode(mode)}, {_way(ahead)}, {layout}"


def _document(cfg: ServeBenchConfig, results: dict[Key, LoadResult], inproc, groups, concurrencies) -> dict:
    rows = []
    verdicts = []
    ahead_rows = []
    first_way = cfg.draft_ahead[0]
    combos = [(_layout(p), a) for p in cfg.pin_cores for a in cfg.draft_ahead]
    for layout, ahead in combos:
        for w, t in groups:
            for c in concurrencies:
                base = results[(layout, first_way, w, t, c, cfg.modes[0])]
                for mode in cfg.modes:
                    if mode == cfg.modes[0] and ahead != first_way:
                        continue
                    r = results[(layout, ahead, w, t, c, mode)]
                    rows.append(
                        {
                            "workload": w,
                            "temperature": t,
                            "concurrency": c,
                            "method": mode[0],
                            "k": mode[1],
                            "mode": _mode(mode),
                            "layout": layout,
                            "draft_ahead": ahead if mode != cfg.modes[0] else None,
                            "requests": len(r.ttft),
                            "tokens": r.tokens,
                            "tokens_per_second": round(r.tokens_per_second, 1),
                            "tokens_per_second_per_pass": [round(x, 1) for x in r.pass_rates],
                            "speedup": round(r.tokens_per_second / base.tokens_per_second, 3),
                            "ttft_ms_p50": round(1000 * statistics.median(r.ttft), 2),
                            "tbt_ms_p50": round(1000 * _pct(r.gaps, 0.5), 2),
                            "tbt_ms_p99": round(1000 * _pct(r.gaps, 0.99), 2),
                            "acceptance_rate": round(r.accepted / r.proposed, 3) if r.proposed else None,
                            "mean_k": round(r.mean_k_sum / r.passes, 3) if r.passes else 0.0,
                        }
                    )
                if cfg.auto:
                    auto_r = results[(layout, ahead, w, t, c, cfg.modes[-1])]
                    auto = auto_r.tokens_per_second
                    runs = {_mode(m): results[(layout, ahead, w, t, c, m)] for m in cfg.modes[1:-1]}
                    runs["none"] = base
                    others = {m: r.tokens_per_second for m, r in runs.items()}
                    best = max(others, key=others.get)
                    vs_best, vs_none = _paired(auto_r, runs[best]), _paired(auto_r, base)
                    verdicts.append(
                        {
                            "workload": w,
                            "temperature": t,
                            "concurrency": c,
                            "layout": layout,
                            "draft_ahead": ahead,
                            "best_other": best,
                            "auto_vs_best": round(auto / others[best], 3),
                            "auto_vs_none": round(auto / others["none"], 3),
                            # Pass by pass: the modes of one pass ran back to back, so a slow
                            # stretch of the machine moves both sides of each ratio.
                            "auto_vs_best_per_pass": vs_best,
                            "auto_vs_none_per_pass": vs_none,
                            "auto_vs_best_judged": judged(vs_best, BAR_VS_BEST),
                            "auto_vs_none_judged": judged(vs_none, BAR_VS_NONE),
                            "fixed_k_losing_to_none": [
                                m for m, v in others.items() if m != "none" and v < others["none"]
                            ],
                        }
                    )
    # Drafting ahead against drafting in turn, on the same layout, pass for pass the same machine.
    if set(cfg.draft_ahead) == {False, True}:
        for pinned in cfg.pin_cores:
            layout = _layout(pinned)
            for w, t in groups:
                for c in concurrencies:
                    base = results[(layout, first_way, w, t, c, cfg.modes[0])].tokens_per_second
                    for mode in cfg.modes[1:]:
                        ahead_r = results[(layout, True, w, t, c, mode)]
                        on = ahead_r.tokens_per_second
                        shares = block_shares(ahead_r.blocks)
                        off = results[(layout, False, w, t, c, mode)].tokens_per_second
                        ahead_rows.append(
                            {
                                "workload": w,
                                "temperature": t,
                                "concurrency": c,
                                "layout": layout,
                                "mode": _mode(mode),
                                "speedup_in_turn": round(off / base, 3),
                                "speedup_ahead": round(on / base, 3),
                                "ahead_vs_in_turn": round(on / off, 3),
                                "prepared_share": _share(shares, "prepared"),
                                "offered_share": _share(shares, "offered"),
                            }
                        )
    per_mode = {}
    if inproc:
        for layout, ahead in combos:
            if (layout, cfg.modes[0]) not in inproc:
                continue
            base_ip = inproc[(layout, cfg.modes[0])]
            base_st = results[(layout, first_way, "code", 0.0, 1, cfg.modes[0])].tokens_per_second
            for m in cfg.modes:
                if m == cfg.modes[0] and ahead != first_way:
                    continue
                ip = inproc[(layout, m)]
                st = results[(layout, ahead, "code", 0.0, 1, m)].tokens_per_second
                entry = {
                    "layout": layout,
                    "draft_ahead": ahead if m != cfg.modes[0] else None,
                    "in_process_tokens_per_second": round(ip, 1),
                    "stack_tokens_per_second": round(st, 1),
                    "overhead_ms_per_token": round(1000 * (1 / st - 1 / ip), 3),
                }
                if m != cfg.modes[0]:
                    e2e, local = st / base_st, ip / base_ip
                    entry |= {
                        "in_process_speedup": round(local, 3),
                        "stack_speedup": round(e2e, 3),
                        "share_of_in_process_speedup_kept": round(e2e / local, 3),
                    }
                per_mode[_c1_label(cfg, layout, ahead, m)] = entry
    return {
        "config": asdict(cfg),
        "host": {"cpu_cores": os.cpu_count(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        "rows": rows,
        "auto_vs_others": verdicts,
        "ahead_vs_in_turn": ahead_rows,
        "block_shares": {f"{layout}, {_way(a)}": block_shares(_blocks(results, layout, a)) for layout, a in combos},
        "concurrency_1": per_mode,
    }


def _blocks(results: dict[Key, LoadResult], layout: str, ahead: bool) -> dict[str, float]:
    """The target's blocks by source over every measured load of one layout and way."""
    total: dict[str, float] = {}
    for (lay, a, *_), r in results.items():
        if (lay, a) == (layout, ahead):
            _add_blocks(total, r.blocks)
    return total


def _share(shares: dict[str, float] | None, name: str) -> float | None:
    return None if shares is None else round(shares[name], 3)


def render(doc: dict) -> str:
    """Markdown tables (the README's)."""
    several = len({(r["layout"], r["draft_ahead"]) for r in doc["rows"] if r["draft_ahead"] is not None}) > 1
    extra_head = " layout | draft |" if several else ""
    lines = [
        "| workload | T | concurrency | speculation | tokens/s | per pass | speed-up | mean k | acceptance "
        "| TTFT p50 (ms) | TBT p50 (ms) | TBT p99 (ms) |" + extra_head,
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if several else ""),
    ]
    for r in doc["rows"]:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        extra = ""
        if several:
            extra = f" {r['layout']} | {'' if r['draft_ahead'] is None else _way(r['draft_ahead'])} |"
        lines.append(
            f"| {r['workload']} | {r['temperature']:g} | {r['concurrency']} | {r['mode']} | "
            f"{r['tokens_per_second']:.1f} | {' / '.join(f'{x:.0f}' for x in r['tokens_per_second_per_pass'])} | "
            f"{r['speedup']:.2f}x | {r['mean_k']:.2f} | {acc} | "
            f"{r['ttft_ms_p50']:.1f} | {r['tbt_ms_p50']:.2f} | {r['tbt_ms_p99']:.2f} |" + extra
        )
    if doc.get("ahead_vs_in_turn"):
        lines += [
            "",
            "| layout | workload | T | concurrency | speculation | speed-up in turn | speed-up ahead "
            "| ahead / in turn | share of rounds from a prepared block | offered (not waited for) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in doc["ahead_vs_in_turn"]:
            share = "" if v["prepared_share"] is None else f"{100 * v['prepared_share']:.0f}%"
            offered = "" if v.get("offered_share") is None else f"{100 * v['offered_share']:.0f}%"
            lines.append(
                f"| {v['layout']} | {v['workload']} | {v['temperature']:g} | {v['concurrency']} | {v['mode']} | "
                f"{v['speedup_in_turn']:.2f}x | {v['speedup_ahead']:.2f}x | **{v['ahead_vs_in_turn']:.2f}x** | "
                f"{share} | {offered} |"
            )
    if doc.get("auto_vs_others"):
        lines += [
            "",
            "| workload | T | concurrency | best of none / fixed k | auto / best | per pass "
            f"| paired, >= {BAR_VS_BEST} | auto / none | per pass | paired, >= {BAR_VS_NONE} "
            "| fixed k slower than none |" + extra_head,
            "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if several else ""),
        ]
        for v in doc["auto_vs_others"]:
            extra = f" {v['layout']} | {_way(v['draft_ahead'])} |" if several else ""
            lines.append(
                f"| {v['workload']} | {v['temperature']:g} | {v['concurrency']} | {v['best_other']} | "
                f"**{v['auto_vs_best']:.2f}x** | {_ratios(v.get('auto_vs_best_per_pass'))} | "
                f"{_judged_cell(v.get('auto_vs_best_judged'))} | "
                f"{v['auto_vs_none']:.2f}x | {_ratios(v.get('auto_vs_none_per_pass'))} | "
                f"{_judged_cell(v.get('auto_vs_none_judged'))} | "
                f"{', '.join(v['fixed_k_losing_to_none']) or '-'} |" + extra
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


def _plot(doc: dict, path: Path) -> None:
    """Tokens/s against concurrency, one line per mode (and way of drafting), one panel per
    (workload, temperature, layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["workload"], r["temperature"], r["layout"]) for r in doc["rows"]))
    layouts = {g[2] for g in groups}
    ways = {r["draft_ahead"] for r in doc["rows"] if r["draft_ahead"] is not None}
    cols = min(3, len(groups))
    nrows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False)
    for ax, (w, t, layout) in zip(axes.flat, groups):
        rows = [r for r in doc["rows"] if (r["workload"], r["temperature"], r["layout"]) == (w, t, layout)]
        for mode, ahead in dict.fromkeys((r["mode"], r["draft_ahead"]) for r in rows):
            pts = sorted(
                (r["concurrency"], r["tokens_per_second"])
                for r in rows
                if (r["mode"], r["draft_ahead"]) == (mode, ahead)
            )
            style = {"lw": 2.6, "color": "black"} if mode.startswith("auto") else {"lw": 1.2}
            if mode == "none":
                style = {"lw": 2.0, "ls": "--", "color": "grey"}
            if ahead:
                style = {**style, "ls": "-."}
                style.pop("color", None)
            label = mode if len(ways) < 2 or ahead is None else f"{mode}, {_way(ahead)}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("tokens/s (all streams)")
        title = f"{w}, {'greedy' if t == 0 else f'T = {t:g}'}"
        ax.set_title(title if len(layouts) < 2 else f"{title}, {layout}")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
