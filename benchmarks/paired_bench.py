"""``specd bench --paired``: ``auto`` against each fixed k, request by request, with a noise floor.

Issue 12's criterion 2 asks whether ``auto`` is at least as fast as the best fixed k at batch 1
"within noise". A sum of tokens over a sum of seconds per mode cannot say what the noise is, and on
a shared 2-core machine the speed of the whole run drifts by 10-30% between minutes. So here:

- one engine, one request at a time (batch 1, in-process: the controller's own cost and choices,
  without the network's noise);
- per round, every prompt runs once in every mode, the modes in a shuffled order (seeded), so each
  (prompt, round) gives one request per mode within a few hundred milliseconds of each other;
- per (prompt, round) the speed ratio ``auto / mode`` (tokens per second); over all of them the
  median and a 95% bootstrap interval of the median;
- an **A/A control**: the first fixed k runs twice under two names; its interval is what identical
  modes look like on this machine in this run;
- with ``ablations`` (greedy only), two more modes split ``auto``'s loss or gain against the middle
  fixed k, K: ``auto`` doing all its work but with every choice replaced by the draft at K (its
  own work's cost), and the ``auto`` path at K with the controller's planning and observing
  skipped (the rest of the path's cost). ``auto`` against the first is what its choices are worth.

Sampled requests carry a seed (one per prompt), so at a temperature ``auto`` is planned as a seeded
request is: from its own history and a fixed reference cost, not from the measured timings (see
docs/how-it-works.md, "Seeded requests repeat exactly"); the serving benchmark sends no seeds.

The verdict against the best fixed k (the most tokens per second over the run): ``as fast`` when the
interval reaches 1, ``slower`` when it lies below, ``faster`` when above.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specd.benchmarks.engine_bench import COMPARE_PREFIX_CACHING, _params, _prompts
from specd.services.common.constants import AUTO_NUM_TOKENS, DEFAULT_DTYPE
from specd.services.engine.builder import ModelSpec, build_engine
from specd.services.engine.controller import (
    MODEL,
    Choice,
    ControllerConfig,
    RowPlan,
    SeqAcceptance,
    SpeculationController,
    solo_choice,
)
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.weight_pages import wait_for_engines

CONTROL = "again"  # the A/A control's suffix


@dataclass(frozen=True)
class PairedBenchConfig:
    """What to run (defaults: the demo pair, greedy code prompts)."""

    target: str
    draft: str
    dtype: str = DEFAULT_DTYPE
    ks: tuple[int, ...] = (2, 3, 4)
    auto_k: int = AUTO_NUM_TOKENS  # auto's largest k: the default a user gets
    max_tokens: int = 96
    temperature: float = 0.0
    workload: str = "code"  # code | prose
    rounds: int = 8
    out_dir: str = "benchmarks/results"
    seed: int = 0
    bootstrap: int = 2000
    ablations: bool = False

    def __post_init__(self) -> None:
        if self.workload not in ("code", "prose"):
            raise ValueError(f"--paired: --workloads code or prose, not {self.workload!r}")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"--paired: fixed k must be 1 or more, got {self.ks}")
        if self.rounds < 1:
            raise ValueError("--paired: --repeats must be 1 or more")
        if self.ablations and self.temperature != 0:
            raise ValueError("--paired --ablations: greedy only (--temperatures 0)")

    @property
    def ablation_k(self) -> int:
        """The fixed k the ablations force: the middle of ``ks``."""
        return sorted(self.ks)[len(self.ks) // 2]


@dataclass(frozen=True)
class Mode:
    label: str
    method: str
    k: int
    controller: str = "engine"  # "engine": the engine's own; "forced" / "skipped": the ablations'


class ForcedChoiceController(SpeculationController):
    """Ablation: every plan made in full, then replaced by the draft model at ``k`` (batch 1)."""

    def __init__(self, k: int, config: ControllerConfig = ControllerConfig()) -> None:
        super().__init__(config)
        self.k = k

    def forced(self, cap: int) -> Choice:
        """The draft model at k, within the row's cap."""
        return solo_choice(min(self.k, cap), MODEL)

    # The rest of plan_one's arguments pass through as they come: an ablation that spelled them out
    # broke when the controller took one more (a row's catch-up).
    def plan_one(self, seq: SeqAcceptance, greedy: bool, cap: int, *rest: Any, **named: Any) -> Choice:
        super().plan_one(seq, greedy, cap, *rest, **named)
        return self.forced(cap)

    def plan(self, rows: list[RowPlan], kmax: int) -> Choice:
        super().plan(rows, kmax)
        return self.forced(rows[0].cap)


class SkippedController(ForcedChoiceController):
    """Ablation: no planning and no observing, the draft model at ``k`` (batch 1)."""

    def plan_one(self, seq: SeqAcceptance, greedy: bool, cap: int, *rest: Any, **named: Any) -> Choice:
        return self.forced(cap)

    def plan(self, rows: list[RowPlan], kmax: int) -> Choice:
        return self.forced(rows[0].cap)

    def observe_rows(self, rows: Sequence[tuple[SeqAcceptance, bool, int, int, int]]) -> None:
        pass

    def observe_costs(self, *args: float, **kwargs: float) -> None:
        pass


def _modes(cfg: PairedBenchConfig) -> list[Mode]:
    fixed = [Mode(f"draft k={k}", "draft", k) for k in cfg.ks]
    control = Mode(f"{fixed[0].label} {CONTROL}", "draft", cfg.ks[0])
    modes = [*fixed, control, Mode(f"auto k<={cfg.auto_k}", "auto", cfg.auto_k)]
    if cfg.ablations:
        k = cfg.ablation_k
        modes.append(Mode(f"auto, choices = k={k}", "auto", cfg.auto_k, "forced"))
        modes.append(Mode(f"auto path, no controller, k={k}", "auto", cfg.auto_k, "skipped"))
    return modes


def paired_interval(ratios: list[float], draws: int, seed: int) -> tuple[float, float, float]:
    """Median of the paired ratios and a 95% bootstrap interval of it."""
    r = np.asarray(ratios)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(r, (draws, len(r))), axis=1)
    return float(np.median(r)), float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def verdict(low: float, high: float) -> str:
    """Where a speed ratio's interval lies against 1."""
    return "faster" if low > 1.0 else "slower" if high < 1.0 else "as fast"


def _interval(r: dict) -> str:
    return f"median paired ratio {r['median']:.3f}, 95% interval {r['low']:.3f}-{r['high']:.3f} ({r['verdict']})"


def _run_one(
    engine: Engine,
    mode: Mode,
    ids,
    i: int,
    cfg: PairedBenchConfig,
    tag: str,
    controllers: dict[str, SpeculationController],
) -> tuple[float, int]:
    engine.controller = controllers[mode.controller]
    req = Request(
        f"{mode.label}-{tag}",
        ids,
        _params(cfg.temperature, cfg.max_tokens, cfg.seed + i),
        SpecConfig(mode.method, mode.k),
    )
    t0 = time.perf_counter()
    out = engine.generate([req])[req.request_id]
    return time.perf_counter() - t0, len(out.token_ids)


def run_paired_bench(cfg: PairedBenchConfig) -> dict:
    """Run, print the comparison, write ``paired_bench.json``; returns the document."""
    torch.manual_seed(cfg.seed)
    engine = build_engine(
        ModelSpec(target=cfg.target, draft=cfg.draft, target_dtype=cfg.dtype, draft_dtype=cfg.dtype),
        EngineConfig(max_batch_size=2, max_model_len=1024, prefix_caching=COMPARE_PREFIX_CACHING),
    )
    wait_for_engines([engine])  # timed with the weights settled in huge pages (weight_pages.py)
    prompts = _prompts(engine, False)[cfg.workload]
    modes = _modes(cfg)
    # Each ablation keeps statistics of its own (the engine's controller learns only from auto's
    # rounds), under the engine's controller settings.
    own = engine.controller
    controllers = {
        "engine": own,
        "forced": ForcedChoiceController(cfg.ablation_k, own.cfg),
        "skipped": SkippedController(cfg.ablation_k, own.cfg),
    }
    for mode in modes:  # the first request of a mode pays for its first allocations
        _run_one(engine, mode, prompts[0], 0, cfg, "warm", controllers)
    order = random.Random(cfg.seed)
    speed: dict[str, dict[tuple[int, int], float]] = {m.label: {} for m in modes}
    totals = {m.label: [0, 0.0] for m in modes}
    for rnd in range(cfg.rounds):
        for i, ids in enumerate(prompts):
            for mode in order.sample(modes, len(modes)):
                seconds, tokens = _run_one(engine, mode, ids, i, cfg, f"{i}-{rnd}", controllers)
                speed[mode.label][(i, rnd)] = tokens / seconds
                totals[mode.label][0] += tokens
                totals[mode.label][1] += seconds
    engine.controller = own
    engine.close()

    tps = {label: t / s for label, (t, s) in totals.items()}
    auto = f"auto k<={cfg.auto_k}"
    fixed = [f"draft k={k}" for k in cfg.ks]
    best = max(fixed, key=tps.__getitem__)

    def compare(a: str, b: str) -> dict:
        ratios = [speed[a][key] / speed[b][key] for key in speed[b]]
        med, low, high = paired_interval(ratios, cfg.bootstrap, cfg.seed)
        return {
            "a": a,
            "b": b,
            "median": med,
            "low": low,
            "high": high,
            "n": len(ratios),
            "verdict": verdict(low, high),
        }

    rows = [compare(auto, f) for f in fixed]
    control = compare(f"{fixed[0]} {CONTROL}", fixed[0])
    ablations = []
    if cfg.ablations:
        k = cfg.ablation_k
        forced, skipped = f"auto, choices = k={k}", f"auto path, no controller, k={k}"
        ablations = [compare(forced, f"draft k={k}"), compare(skipped, f"draft k={k}"), compare(auto, forced)]
    doc = {
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "tokens_per_second": tps,
        "best_fixed": best,
        "auto_vs_fixed": rows,
        "auto_vs_best": next(r for r in rows if r["b"] == best),
        "control": control,
        "ablations": ablations,
        "per_request_speed": {label: [v for _, v in sorted(s.items())] for label, s in speed.items()},
    }
    print(f"{cfg.workload}, T = {cfg.temperature}, batch 1, {cfg.rounds} rounds x {len(prompts)} prompts, shuffled")
    for label, v in tps.items():
        print(f"  {label:22s} {v:7.1f} tok/s (median request {statistics.median(speed[label].values()):.1f})")
    for r in [*rows, control, *ablations]:
        print(f"  {r['a']} / {r['b']}: {_interval(r)}, n = {r['n']}")
    print(
        f"auto against the best fixed k ({best}): {_interval(doc['auto_vs_best'])}; A/A control: {_interval(control)}"
    )
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paired_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out / 'paired_bench.json'}")
    return doc
