"""``specd bench``: baselines and specd side by side, in one run, on a fixed prompt set.

Modes, each at temperature 0 (greedy) and 0.8, one request at a time (latency, batch 1):

- ``specd-target-only``: our engine with speculation off (the same code path); the baseline;
- ``hf-generate-<dtype>``: ``transformers`` ``generate()`` on the target alone;
- ``hf-assisted-<dtype>``: ``transformers`` assisted generation with the draft as ``assistant_model``
  (its default dynamic number of assistant tokens);

``transformers`` runs with the target in bf16 and in fp32 (the draft in fp32), and comparisons use
whichever is faster, so no baseline is handicapped by a dtype choice of ours.
- ``specd-draft`` / ``specd-ngram`` / ``specd-hybrid``: our engine with the draft model / n-gram
  lookup / n-gram first and the draft model where it finds nothing, for each k;
- ``specd-auto``: the controller's choice of k (up to the largest k swept) and drafter per round.

Every request generates exactly ``max_tokens`` tokens (EOS ignored) so all modes do the same work.
Reported per mode: tokens/s, speed-up against ``specd-target-only``, acceptance rate
(accepted/proposed), tokens per target forward, and the Leviathan prediction
``(1 - a^(k+1)) / ((1 - a)(k c + 1))`` from the measured per-token acceptance ``a`` and cost ratio
``c`` (draft step / target step, timed in this run). Two refinements explain the gaps:

- predicted tokens per forward weights the formula by the guess rate ``m`` (rounds that made any
  guess): ``(1 - m) + m (1 - a^(k+1)) / (1 - a)``; n-gram lookup misses in many rounds;
- ``predicted_speedup_measured_costs`` prices the round as measured, ``k`` draft steps plus one
  ``(k+1)``-token target pass, instead of assuming verification costs one step.

``a`` is estimated as S / (S + F): S accepted guesses, F rejections (rounds that stopped early). It
is the maximum-likelihood per-token acceptance if acceptances were i.i.d.; accepted/proposed is
lower because guesses after a rejection are never tested.

The **oracle bound** (``oracle_speedup``) asks what the run's own rounds would have cost had each
verified exactly the guesses that were accepted: a round that accepted ``j`` guesses then costs ``j``
draft steps of the same drafter (none for the n-gram) and one ``(j+1)``-token target pass, at the
costs measured in this run, and emits the same ``j + 1`` tokens. The gap between it and the measured
speed-up is the verify (and draft) work spent on rejected guesses. The rounds' accept counts come
from the per-position counters (rounds with at least ``j`` accepted = accepted at position ``j``).
For ``hybrid`` and ``auto`` every round is priced with draft-model steps, so their bound is a
lower bound.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specd.services.common.constants import DEFAULT_DTYPE, FIXED_NUM_TOKENS
from specd.services.engine.builder import DTYPES, ModelSpec, build_engine
from specd.services.engine.chat import encode_chat, encode_text
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.model import BatchLayout
from specd.services.engine.sampling import SamplingParams
from specd.services.engine.stats import SpecStats
from specd.services.engine.weight_pages import wait_for_engines

# The benchmarks that compare modes run the same prompts in every mode, one mode after another: with
# the prefix cache on, the first mode to meet a prompt would prefill it and the rest would not. So
# they run with it off; `long_context_bench prefix` measures what it is worth.
COMPARE_PREFIX_CACHING = False

CODE_PROMPTS = [
    'def binary_search(items, target):\n    """Return the index of target in the sorted list items, or -1."""\n',
    'class LRUCache:\n    """A least-recently-used cache with a fixed capacity."""\n\n'
    "    def __init__(self, capacity):\n",
    'import os\nimport sys\n\n\ndef main(argv=None):\n    """Parse the command line and run."""\n'
    "    if argv is None:\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    'def read_config(path):\n    """Read a configuration file and return a dict of its sections."""\n'
    "    with open(path",
    "        try:\n            result = self._sock.recv(bufsize)\n        except OSError as exc:\n",
]
PROSE_QUESTIONS = [
    "Explain `json.dumps`.",
    "What does `os.path.join` do?",
    "Describe the function `heapq.heappush` from the `heapq` module.",
    "How do I use `itertools.groupby`?",
]


@dataclass(frozen=True)
class BenchConfig:
    """What to run; defaults are the full benchmark on the demo pair."""

    target: str
    draft: str
    dtype: str = DEFAULT_DTYPE
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    max_tokens: int = 96
    temperatures: tuple[float, ...] = (0.0, 0.8)
    repeats: int = 1
    out_dir: str = "benchmarks/results"
    quick: bool = False
    include_hf: bool = True
    hf_dtypes: tuple[str, ...] = ("bfloat16", "float32")
    seed: int = 0


@dataclass
class ModeResult:
    """One mode at one temperature (and k), summed over the prompt set."""

    mode: str
    temperature: float
    k: int
    category: str  # "code" | "prose"
    tokens: int = 0
    seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _prompts(engine: Engine, quick: bool) -> dict[str, list[tuple[int, ...]]]:
    tok = engine.tokenizer
    code = [tuple(encode_text(tok, p)) for p in CODE_PROMPTS]
    prose = [tuple(encode_chat(tok, [{"role": "user", "content": q}])) for q in PROSE_QUESTIONS]
    if quick:
        return {"code": code[:1], "prose": prose[:1]}
    return {"code": code, "prose": prose}


def _params(temperature: float, max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True)


SPECD_MODES = {
    "none": "specd-target-only",
    "draft": "specd-draft",
    "ngram": "specd-ngram",
    "hybrid": "specd-hybrid",
    "auto": "specd-auto",
}


def run_specd(engine: Engine, prompts, method: str, k: int, temperature: float, cfg: BenchConfig, res: ModeResult):
    """Each prompt alone (batch 1), timed from submission to the last token; adds into ``res``."""
    for i, ids in enumerate(prompts):
        params = _params(temperature, cfg.max_tokens, cfg.seed + i)
        req = Request(f"{res.mode}-{k}-{i}", ids, params, SpecConfig(method, k))
        t0 = time.perf_counter()
        out = engine.generate([req])[req.request_id]
        res.seconds += time.perf_counter() - t0
        res.tokens += len(out.token_ids)
        res.stats.merge(out.stats)


def hf_mode(hf_target, assisted: bool) -> str:
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[hf_target.dtype]
    return f"hf-assisted-{dtype}" if assisted else f"hf-generate-{dtype}"


def run_hf(hf_target, hf_draft, prompts, temperature: float, cfg: BenchConfig, res: ModeResult):
    """transformers generate(), with assistant_model when hf_draft is given; adds into ``res``."""
    from transformers import GenerationConfig

    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    gen = GenerationConfig(
        max_new_tokens=cfg.max_tokens, min_new_tokens=cfg.max_tokens, pad_token_id=0, eos_token_id=None, **sampling
    )
    kw: dict = {"generation_config": gen}
    if hf_draft is not None:
        kw["assistant_model"] = hf_draft
    for i, ids in enumerate(prompts):
        torch.manual_seed(cfg.seed + i)
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf_target.generate(x, attention_mask=torch.ones_like(x), **kw)
        res.seconds += time.perf_counter() - t0
        res.tokens += out.shape[1] - len(ids)


def _median_forward_ms(model, T: int, context: int = 200, reps: int = 30) -> float:
    cache = model.new_cache(1, context + T + 1)
    slot = cache.allocate()
    ids = torch.randint(3, model.info.vocab_size, (1, T), device=model.device)
    times = []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        model.forward(ids, cache, BatchLayout([slot], [context], T, model.device), "all")
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def measure_costs(engine: Engine, ks: tuple[int, ...]) -> dict:
    """Per-forward latencies (ms) of the draft (1 token) and the target (1 and k+1 tokens)."""
    draft = engine.model_drafter.model
    out = {"draft_1": _median_forward_ms(draft, 1), "target_1": _median_forward_ms(engine.target, 1)}
    # Every block width up to the largest k (the oracle bound prices rounds of any accept count).
    for k in range(1, max(ks) + 1):
        out[f"target_{k + 1}"] = _median_forward_ms(engine.target, k + 1)
    out["c"] = out["draft_1"] / out["target_1"]
    return out


def alpha_hat(stats: SpecStats) -> float:
    """Per-token acceptance S / (S + F): S accepted guesses, F rounds that ended on a rejected guess."""
    tested = stats.accepted_tokens + stats.rejections
    return stats.accepted_tokens / tested if tested else 0.0


def leviathan(a: float, k: int, c: float) -> tuple[float, float]:
    """(expected tokens per target forward, wall-clock speed-up) for acceptance a, block k, cost c."""
    tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    return tokens, tokens / (k * c + 1)


def rounds_by_accepted(stats: SpecStats) -> list[int]:
    """[j] = rounds that accepted exactly j guesses, from the per-position accept counters."""
    at_least = [stats.target_forward_passes, *stats.accepted_per_position, 0]
    return [at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)]


def oracle_speedup(stats: SpecStats, costs: dict, draft_step_ms: float) -> float | None:
    """Speed-up over target-only had every round verified exactly its accepted guesses (same
    drafter: ``draft_step_ms`` per guess, 0 for the n-gram), at this run's measured costs."""
    n = rounds_by_accepted(stats)
    if not stats.target_forward_passes or any(f"target_{j + 1}" not in costs for j, c in enumerate(n) if c):
        return None
    ms = sum(c * (j * draft_step_ms + costs[f"target_{j + 1}"]) for j, c in enumerate(n))
    emitted = sum(c * (j + 1) for j, c in enumerate(n))
    return emitted * costs["target_1"] / ms if ms else None


def run_engine_bench(cfg: BenchConfig) -> dict:
    """Run everything, print a table, write JSON and a PNG; returns the JSON document."""
    torch.manual_seed(cfg.seed)
    engine = build_engine(
        ModelSpec(target=cfg.target, draft=cfg.draft, target_dtype=cfg.dtype, draft_dtype=cfg.dtype),
        EngineConfig(max_batch_size=2, max_model_len=1024, prefix_caching=COMPARE_PREFIX_CACHING),
    )
    wait_for_engines([engine])  # timed with the weights settled in huge pages (weight_pages.py)
    prompt_sets = _prompts(engine, cfg.quick)
    hf_targets, hf_draft = [], None
    if cfg.include_hf:
        from transformers import AutoModelForCausalLM

        hf_targets = [AutoModelForCausalLM.from_pretrained(cfg.target, dtype=DTYPES[d]).eval() for d in cfg.hf_dtypes]
        hf_draft = AutoModelForCausalLM.from_pretrained(cfg.draft, dtype=torch.float32).eval()

    # Warm-up: first calls pay for kernel selection and allocation.
    warm = prompt_sets["code"][0]
    for method in ("none", "draft", "ngram"):
        for t in cfg.temperatures:
            spec = SpecConfig(method, FIXED_NUM_TOKENS)
            engine.generate([Request(f"warm-{method}-{t}", warm, _params(t, 8, 0), spec)])
    costs = measure_costs(engine, cfg.ks)

    # Every configuration runs once per repeat, interleaved, so slow drifts of this noisy machine
    # spread over all modes instead of landing on one.
    results: dict[tuple, ModeResult] = {}
    for rep in range(cfg.repeats):
        for category, prompts in prompt_sets.items():
            for t in cfg.temperatures:
                group: list[ModeResult] = []

                def get(mode: str, k: int, category=category, t=t, group=group) -> ModeResult:
                    key = (category, t, mode, k)
                    if key not in results:
                        results[key] = ModeResult(mode, t, k, category)
                    group.append(results[key])
                    return results[key]

                run_specd(engine, prompts, "none", 0, t, cfg, get(SPECD_MODES["none"], 0))
                for hf_target in hf_targets:
                    for assist in (None, hf_draft):
                        run_hf(hf_target, assist, prompts, t, cfg, get(hf_mode(hf_target, assist is not None), 0))
                for k in cfg.ks:
                    for method in ("draft", "ngram", "hybrid"):
                        run_specd(engine, prompts, method, k, t, cfg, get(SPECD_MODES[method], k))
                kmax = max(cfg.ks)  # auto may choose any k up to the largest one swept
                run_specd(engine, prompts, "auto", kmax, t, cfg, get(SPECD_MODES["auto"], kmax))
                if rep == cfg.repeats - 1:
                    for r in group:
                        print(_row(r, group[0], costs), flush=True)
    doc = _document(cfg, costs, list(results.values()))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    _plot(doc, out / "engine_bench.png")
    print(f"wrote {out / 'engine_bench.json'} and {out / 'engine_bench.png'}")
    return doc


def _summary(r: ModeResult, base: ModeResult, costs: dict) -> dict:
    s = r.stats
    row = {
        "mode": r.mode,
        "category": r.category,
        "temperature": r.temperature,
        "k": r.k,
        "tokens": r.tokens,
        "seconds": round(r.seconds, 4),
        "tokens_per_second": round(r.tokens_per_second, 2),
        "speedup_vs_specd_target_only": round(r.tokens_per_second / base.tokens_per_second, 3),
    }
    if r.mode.startswith("specd") and s.target_forward_passes:
        a = alpha_hat(s)
        row.update(
            acceptance_rate=round(s.acceptance_rate, 4),
            alpha_hat=round(a, 4),
            tokens_per_target_forward=round(s.tokens_per_forward, 3),
            accepted_per_position=s.accepted_per_position,
            proposed_per_position=s.proposed_per_position,
        )
        if r.k:
            # n-gram lookup costs ~nothing; for hybrid the draft's c is an upper bound.
            c = 0.0 if r.mode == "specd-ngram" else costs["c"]
            tokens, speedup = leviathan(a, r.k, c)
            # Rounds that made no guess (an n-gram miss, or the last token of a request) emit one token.
            m = s.proposed_per_position[0] / s.target_forward_passes if s.proposed_per_position else 0.0
            oracle = oracle_speedup(s, costs, 0.0 if r.mode == "specd-ngram" else costs["draft_1"])
            row.update(
                guess_rate=round(m, 4),
                predicted_tokens_per_forward=round((1 - m) + m * tokens, 3),
                predicted_speedup=round(speedup, 3),
                oracle_speedup=round(oracle, 3) if oracle else None,
                mean_k=round(s.mean_block_size, 3),
            )
            if r.mode == "specd-draft":
                # The same formula with the verification pass priced as measured (k+1 tokens cost more
                # than 1): round = k draft steps + one (k+1)-token target pass, against one 1-token pass.
                round_cost = (r.k * costs["draft_1"] + costs[f"target_{r.k + 1}"]) / costs["target_1"]
                row["predicted_speedup_measured_costs"] = round(((1 - m) + m * tokens) / round_cost, 3)
    return row


def _row(r: ModeResult, base: ModeResult, costs: dict) -> str:
    d = _summary(r, base, costs)
    extra = ""
    if "acceptance_rate" in d and r.k:
        extra = (
            f" acc={d['acceptance_rate']:.2f} a={d['alpha_hat']:.2f} tok/fwd={d['tokens_per_target_forward']:.2f}"
            f" (pred {d['predicted_tokens_per_forward']:.2f}) pred_speedup={d['predicted_speedup']:.2f}"
            f" oracle={d['oracle_speedup'] or 0:.2f} mean_k={d['mean_k']:.2f}"
        )
        if "predicted_speedup_measured_costs" in d:
            extra += f" (with measured verify cost {d['predicted_speedup_measured_costs']:.2f})"
    return (
        f"{r.category:5s} T={r.temperature:<3} {r.mode:18s} k={r.k} {d['tokens_per_second']:7.1f} tok/s "
        f"x{d['speedup_vs_specd_target_only']:.2f}{extra}"
    )


def _document(cfg: BenchConfig, costs: dict, results: list[ModeResult]) -> dict:
    rows = []
    for category in ("code", "prose"):
        for t in cfg.temperatures:
            group = [r for r in results if r.category == category and r.temperature == t]
            if not group:
                continue
            base = next(r for r in group if r.mode == "specd-target-only")
            rows += [_summary(r, base, costs) for r in group]
    best = {}
    for category in ("code", "prose"):
        for t in cfg.temperatures:
            cands = [
                r for r in rows if r["category"] == category and r["temperature"] == t and r["mode"] == "specd-draft"
            ]
            if not cands:
                continue
            top = max(cands, key=lambda r: r["tokens_per_second"])
            hf_rows = [
                r
                for r in rows
                if r["category"] == category and r["temperature"] == t and r["mode"].startswith("hf-assisted")
            ]
            hf = max(hf_rows, key=lambda r: r["tokens_per_second"], default=None)  # the faster dtype
            best[f"{category}/T={t}"] = {
                "best_k": top["k"],
                "speedup_vs_specd_target_only": top["speedup_vs_specd_target_only"],
                "tokens_per_second": top["tokens_per_second"],
                "vs_hf_assisted": round(top["tokens_per_second"] / hf["tokens_per_second"], 3) if hf else None,
                "hf_assisted_mode": hf["mode"] if hf else None,
            }
    return {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "costs_ms": {k: round(v, 4) for k, v in costs.items()},
        "best_draft": best,
        "rows": rows,
    }


def _plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    rows = doc["rows"]
    panels = {"code": axes[0], "prose": axes[1]}
    for (category, t, mode), series in _series(rows).items():
        ax = panels[category]
        pts = sorted((r["k"], r["speedup_vs_specd_target_only"]) for r in series)
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode[6:]} T={t}")[0]
        if mode == "specd-draft":
            pred = sorted((r["k"], r["predicted_speedup"]) for r in series)
            ax.plot([p[0] for p in pred], [p[1] for p in pred], ls=":", color=line.get_color())
    for category, ax in panels.items():
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("k (guesses per round)")
        ax.set_ylabel("speed-up vs specd target-only")
        ax.set_title(f"{category} prompts (dotted: Leviathan prediction, draft)")
        ax.legend(fontsize=8)
    ax2 = axes[2]
    for key, best in doc["best_draft"].items():
        category, t = key.split("/T=")
        row = next(
            r
            for r in rows
            if r["mode"] == "specd-draft"
            and r["category"] == category
            and str(r["temperature"]) == t
            and r["k"] == best["best_k"]
        )
        prop, acc = row["proposed_per_position"], row["accepted_per_position"]
        # Guess j is tested only if guess j-1 was accepted (and it was made: blocks shrink near max_tokens).
        reached = [prop[0]] + [min(a, p) for a, p in zip(acc[:-1], prop[1:])]
        rate = [a / n if n else 0 for a, n in zip(acc, reached)]
        ax2.plot(range(1, len(rate) + 1), rate, marker="o", label=f"{key} (k={best['best_k']})")
    ax2.set_xlabel("guess position")
    ax2.set_ylabel("P(accepted | reached)")
    ax2.set_ylim(0, 1)
    ax2.set_title("Acceptance by position (draft model, best k)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        if r["mode"] in ("specd-draft", "specd-ngram", "specd-hybrid"):
            out.setdefault((r["category"], r["temperature"], r["mode"]), []).append(r)
    return out
