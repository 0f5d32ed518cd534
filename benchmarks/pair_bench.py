"""``specd bench --pair NAME``: a real pair, against the tools people would otherwise use, in one run.

Systems, each on the same prompts (the same token ids), one request at a time, exactly
``max_tokens`` tokens (EOS ignored), greedy and T = 0.8:

- **specd** (bf16): target-only; the draft model at k = 1..6; n-gram and hybrid at k = 3; ``auto``
  (k up to 6, the default configuration: what ``specd serve --pair`` does);
- **transformers**: ``generate()`` on the target, and assisted generation with the draft as
  ``assistant_model``, in bf16 everywhere and in fp32 on the greedy code prompts (where the goals
  are judged; fp32 is slower here, as the table shows);
- **llama.cpp** ``llama-server``: target alone and with ``--model-draft``, on our weights converted
  to f16 GGUF and on the original Q4_K_M files; skipped with a note when it is not built
  (``scripts/build_llama_cpp.sh``);
- **the physical limit**: weight bytes read per token over the read bandwidth measured in this run.
- **quantized** (on the greedy code prompts, where the goals are judged): the bf16 target with a
  bf16 and an int4 draft beside the default int8 one; int8 and int4 targets (``--quantize``) alone
  and with int8 and int4 drafts at a few k, each with its own bandwidth bound, and how often its
  greedy text is the bf16 target's.

Modes run interleaved, one group (prompt set, temperature) at a time, and ``--repeats`` passes,
so this machine's slow drifts spread over all of them. tokens/s is wall time from submission to the
last token (prefill included, ~1% here) for every system; specd's decode-only rate (after the first
token, as llama.cpp reports) is recorded beside it and is what the bandwidth bound is compared to.
"""

from __future__ import annotations

import gc
import json
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specd.benchmarks import engine_bench
from specd.benchmarks.bandwidth import (
    gguf_bytes_per_token,
    measure_read_bandwidth,
    read_buffer,
    safetensors_bytes_per_token,
)
from specd.benchmarks.engine_bench import CODE_PROMPTS, COMPARE_PREFIX_CACHING, alpha_hat
from specd.services.common.constants import AUTO_NUM_TOKENS, DEFAULT_DTYPE, FIXED_NUM_TOKENS
from specd.services.engine.builder import DTYPES, ModelSpec, build_engine
from specd.services.engine.chat import encode_chat, encode_text
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.sampling import SamplingParams
from specd.services.engine.stats import SpecStats
from specd.services.engine.weight_pages import wait_for_engines

PROSE_QUESTIONS = [
    "Explain in plain English how a hash table works.",
    "Describe what happens, step by step, when you type a URL into a browser.",
    "What are the trade-offs between threads and processes?",
]
CHAT_REQUESTS = [
    "Write a Python function that parses an ISO 8601 date string into a datetime.",
    "Write a Python class for a thread-safe bounded queue.",
    "Write a function that merges two sorted lists into one sorted list.",
]


@dataclass(frozen=True)
class PairBenchConfig:
    """What to run; defaults are the full real-pair benchmark."""

    pair: str
    target: str
    draft: str
    target_gguf: str | None = None  # the original quantized files, for llama.cpp
    draft_gguf: str | None = None
    dtype: str = DEFAULT_DTYPE
    draft_quantize: str | None = None
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    default_method: str = "auto"  # what `specd serve --pair` does: auto, k up to auto_k
    default_k: int = FIXED_NUM_TOKENS  # n-gram and hybrid (and a fixed default method) run at this k
    auto_k: int = AUTO_NUM_TOKENS
    max_tokens: int = 96
    temperatures: tuple[float, ...] = (0.0, 0.8)
    prompts_per_category: int = 1
    repeats: int = 1
    include_hf: bool = True
    include_llama_cpp: bool = True
    llama_threads: int = 2
    quantized_targets: tuple[str, ...] = ("int8", "int4")  # () skips the quantized modes
    quantized_drafts: tuple[str, ...] = ("int8", "int4")
    quantized_ks: tuple[int, ...] = (2, 3, 4)
    out_dir: str = "benchmarks/results"
    quick: bool = False
    seed: int = 0


@dataclass
class Run:
    """One mode on one group (prompt set, temperature), summed over prompts and passes."""

    system: str  # "specd" | "transformers" | "llama.cpp"
    mode: str
    category: str
    temperature: float
    k: int = 0
    target: str = "bf16"  # specd: the target's weights, "bf16" | "int8" | "int4"
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0  # after each request's first output
    decode_seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)
    llama_draft_n: int = 0
    llama_draft_accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # first pass's tokens per prompt (specd)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def _prompt_sets(tokenizer, n: int) -> dict[str, list[tuple[int, ...]]]:
    return {
        "code": [tuple(encode_text(tokenizer, p)) for p in CODE_PROMPTS[:n]],
        "prose": [tuple(encode_chat(tokenizer, [{"role": "user", "content": q}])) for q in PROSE_QUESTIONS[:n]],
        "chat": [tuple(encode_chat(tokenizer, [{"role": "user", "content": q}])) for q in CHAT_REQUESTS[:n]],
    }


def _params(temperature: float, max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True)


@dataclass(frozen=True)
class _Streamed:
    """One request run alone: its tokens, its wall time, and its decoding (after the first token)."""

    tokens: list[int]
    seconds: float
    decode_tokens: int
    decode_seconds: float  # 0 where nothing was decoded
    stats: SpecStats | None


def _stream_alone(engine: Engine, req: Request) -> _Streamed:
    """Submit ``req`` and stream it to the end, timing it from submission and from its first token."""
    t0 = time.perf_counter()
    engine.add_request(req)
    first_at, first_n, tokens, stats = None, 0, [], None
    for out in engine.stream():
        if out.token_ids and first_at is None:
            first_at, first_n = time.perf_counter(), len(out.token_ids)
        tokens += out.token_ids
        if out.finished:
            stats = out.stats
    t1 = time.perf_counter()
    if first_at is None:
        return _Streamed(tokens, t1 - t0, 0, 0.0, stats)
    return _Streamed(tokens, t1 - t0, len(tokens) - first_n, t1 - first_at, stats)


def run_specd(engine: Engine, prompts, method: str, k: int, cfg: PairBenchConfig, run: Run) -> None:
    """Each prompt alone (batch 1); wall time from submission to the last token, and decode-only."""
    for i, ids in enumerate(prompts):
        params = _params(run.temperature, cfg.max_tokens, cfg.seed + i)
        r = _stream_alone(engine, Request(f"{run.mode}-{i}-{time.monotonic_ns()}", ids, params, SpecConfig(method, k)))
        if len(run.outputs) < len(prompts):
            run.outputs.append(r.tokens)
        run.seconds += r.seconds
        run.tokens += len(r.tokens)
        run.decode_tokens += r.decode_tokens
        run.decode_seconds += r.decode_seconds
        if r.stats is not None:
            run.stats.merge(r.stats)


def run_hf(hf_target, hf_draft, prompts, cfg: PairBenchConfig, run: Run) -> None:
    """transformers ``generate()``, with ``assistant_model`` when ``hf_draft`` is given (the engine
    benchmark's runner: it reads ``max_tokens`` and ``seed`` from the config, adds into ``run``)."""
    engine_bench.run_hf(hf_target, hf_draft, prompts, run.temperature, cfg, run)


def run_llama(server, prompts, cfg: PairBenchConfig, run: Run) -> None:
    """llama-server's native /completion on the same token ids; wall time, and its own timings."""
    from specd.benchmarks.llama_cpp import complete

    for i, ids in enumerate(prompts):
        r = complete(server, list(ids), cfg.max_tokens, run.temperature, cfg.seed + i)
        run.seconds += r.wall_s
        run.tokens += r.predicted_n
        run.decode_tokens += r.predicted_n
        run.decode_seconds += r.predicted_ms / 1000
        run.llama_draft_n += r.draft_n or 0
        run.llama_draft_accepted += r.draft_n_accepted or 0


# llama.cpp's own draft lengths: our default k, and the 8 that did best for it in the trial.
LLAMA_DRAFT_MAX = (3, 8)


@dataclass
class LlamaSetup:
    """The llama-server configurations of this run: name -> (model file, draft file or None, draft max)."""

    binary: Path | None
    note: str
    configs: dict[str, tuple[Path, Path | None, int]] = field(default_factory=dict)


def _llama_setup(cfg: PairBenchConfig) -> LlamaSetup:
    if not cfg.include_llama_cpp:
        return LlamaSetup(None, "llama.cpp skipped (--no-llama-cpp)")
    from specd.benchmarks.llama_cpp import convert_to_f16_gguf, find_llama_server

    binary = find_llama_server()
    if binary is None:
        return LlamaSetup(None, "llama.cpp skipped: llama-server is not built (run scripts/build_llama_cpp.sh)")
    from specd.services.model_store.fetch import cache_root

    gguf_dir = cache_root() / "gguf"
    t16 = convert_to_f16_gguf(Path(cfg.target), gguf_dir / f"{Path(cfg.target).name}-f16.gguf")
    d16 = convert_to_f16_gguf(Path(cfg.draft), gguf_dir / f"{Path(cfg.draft).name}-f16.gguf")
    files = {"f16": (t16, d16)}
    if cfg.target_gguf and cfg.draft_gguf:
        files["q4_k_m"] = (Path(cfg.target_gguf), Path(cfg.draft_gguf))
    setup = LlamaSetup(binary, "")
    for name, (target, draft) in files.items():
        setup.configs[name] = (target, None, 0)
        for n_max in LLAMA_DRAFT_MAX:
            setup.configs[f"{name}+draft k={n_max}"] = (target, draft, n_max)
    return setup


@dataclass
class QuantizedMode:
    """A specd mode on an engine of its own (a quantized target, or another draft for the bf16 one)."""

    mode: str
    engine: Engine
    method: str
    k: int
    target: str


def _quantized_modes(cfg: PairBenchConfig, main: Engine) -> tuple[list[QuantizedMode], dict[str, int]]:
    """The quantized modes, sharing loaded models between engines (each engine has its own KV cache),
    and the weight bytes per decoded token of each quantized target."""
    from specd.benchmarks.bandwidth import model_bytes_per_token
    from specd.services.engine.model import load_model

    if not cfg.quantized_targets:
        return [], {}
    dtype = DTYPES[cfg.dtype]
    ec = EngineConfig(max_batch_size=1, max_model_len=1024, prefix_caching=COMPARE_PREFIX_CACHING)
    drafts = {q: load_model(cfg.draft, dtype, quantize=q) for q in dict.fromkeys([None, *cfg.quantized_drafts])}
    modes = []
    for q in (None, "int4"):  # the bf16 target with other drafts than the default one
        if q != cfg.draft_quantize and q in drafts:
            e = Engine(main.target, main.tokenizer, drafts[q], ec)
            modes.append(QuantizedMode(f"{q or 'bf16'} draft k={cfg.default_k}", e, "draft", cfg.default_k, "bf16"))
    bytes_per_token = {}
    for tq in cfg.quantized_targets:
        target = load_model(cfg.target, dtype, quantize=tq)
        bytes_per_token[tq] = model_bytes_per_token(target)
        for i, dq in enumerate(cfg.quantized_drafts):
            e = Engine(target, main.tokenizer, drafts[dq], ec)
            if i == 0:
                modes.append(QuantizedMode(f"{tq} target-only", e, "none", 0, tq))
            modes += [QuantizedMode(f"{tq} + {dq} draft k={k}", e, "draft", k, tq) for k in cfg.quantized_ks]
            modes.append(QuantizedMode(f"{tq} + {dq} auto k<={cfg.auto_k}", e, "auto", cfg.auto_k, tq))
    return modes, bytes_per_token


def run_pair_bench(cfg: PairBenchConfig) -> dict:
    """Run everything, print each group's rows, write JSON and a PNG; returns the JSON document."""
    # SIGTERM unwinds like Ctrl-C, so every llama-server this run started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.manual_seed(cfg.seed)
    engine = build_engine(
        ModelSpec(
            target=cfg.target,
            draft=cfg.draft,
            target_dtype=cfg.dtype,
            draft_dtype=cfg.dtype,
            draft_quantize=cfg.draft_quantize,
        ),
        EngineConfig(max_batch_size=1, max_model_len=1024, prefix_caching=COMPARE_PREFIX_CACHING),
    )
    n = 1 if cfg.quick else cfg.prompts_per_category
    prompt_sets = _prompt_sets(engine.tokenizer, n)
    if cfg.quick:
        prompt_sets = {"code": prompt_sets["code"]}
    hf = {}
    hf_draft = None
    if cfg.include_hf:
        from transformers import AutoModelForCausalLM

        hf = {"bfloat16": AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.bfloat16).eval()}
        hf_draft = {"bfloat16": AutoModelForCausalLM.from_pretrained(cfg.draft, dtype=torch.bfloat16).eval()}
    llama = _llama_setup(cfg)
    print(llama.note or f"llama.cpp: {llama.binary}", flush=True)

    bw = measure_read_bandwidth()  # measured in this run, on the threads the engine decodes with
    bound = {
        "bandwidth_gb_s": bw.best_gb_s,  # raised to the best reading of the run (_raise_bound)
        "bandwidth_start_gb_s": bw.best_gb_s,
        "bandwidth_median_gb_s": bw.median_gb_s,
        "specd_bf16_bytes_per_token": safetensors_bytes_per_token(cfg.target, torch.finfo(DTYPES[cfg.dtype]).bits // 8),
    }
    if cfg.target_gguf:
        bound["q4_k_m_bytes_per_token"] = gguf_bytes_per_token(cfg.target_gguf)
    quantized, quantized_bytes = _quantized_modes(cfg, engine)
    for tq, nbytes in quantized_bytes.items():
        bound[f"specd_{tq}_bytes_per_token"] = nbytes
    _derive_bounds(bound)
    # Timed as the services run once settled: with the weights they stream in huge pages
    # (services/engine/weight_pages.py moves them in the background after a load).
    t0 = time.perf_counter()
    moved = wait_for_engines([engine, *(q.engine for q in quantized)])
    print(f"weights moved into huge pages: {moved / 2**20:.0f} MB, waited {time.perf_counter() - t0:.1f} s", flush=True)
    bound["weights_moved_to_huge_pages_bytes"] = moved
    warm = prompt_sets["code"][0]
    for method in ("none", "draft", "ngram"):
        for t in cfg.temperatures:
            engine.generate([Request(f"warm-{method}-{t}", warm, _params(t, 8, 0), SpecConfig(method, cfg.default_k))])
    for qm in quantized:
        qm.engine.generate([Request(f"warm-{qm.mode}", warm, _params(0.0, 8, 0), SpecConfig(qm.method, qm.k))])

    specd_modes = [("target-only", "none", 0)] + [(f"draft k={k}", "draft", k) for k in cfg.ks]
    specd_modes += [
        (f"ngram k={cfg.default_k}", "ngram", cfg.default_k),
        (f"hybrid k={cfg.default_k}", "hybrid", cfg.default_k),
        (f"auto k<={cfg.auto_k}", "auto", cfg.auto_k),
    ]
    runs: dict[tuple, Run] = {}

    def get(system: str, mode: str, category: str, t: float, k: int = 0, target: str = "bf16") -> Run:
        key = (system, mode, category, t)
        if key not in runs:
            runs[key] = Run(system, mode, category, t, k, target)
        return runs[key]

    # The goals are judged on code prompts, greedy: that group runs first, with --repeats passes of
    # every mode (interleaved), and settles which draft length llama.cpp gets elsewhere; the other
    # groups run one pass (this machine needs ~10 min per group).
    groups = [(c, t) for c in prompt_sets for t in cfg.temperatures]
    groups.sort(key=lambda g: g != ("code", 0.0))
    read_buf = read_buffer(1.0)  # the readings around target-only passes and rounds
    out = Path(cfg.out_dir)
    for category, t in groups:
        prompts = prompt_sets[category]
        goal = (category, t) == ("code", 0.0)
        passes = cfg.repeats if goal else 1
        for rep in range(passes):
            for mode, method, k in specd_modes:
                run = get("specd", mode, category, t, k)
                if goal and method == "none":
                    _paired_target_only(engine, prompts, cfg, run, bound, read_buf)
                    _bound_rounds(engine, prompts[0], bound, read_buf)
                else:
                    run_specd(engine, prompts, method, k, cfg, run)
            for qm in quantized if goal else ():
                run_specd(qm.engine, prompts, qm.method, qm.k, cfg, get("specd", qm.mode, category, t, qm.k, qm.target))
            for dtype, model in hf.items():
                run_hf(model, None, prompts, cfg, get("transformers", "generate bf16", category, t))
                run_hf(model, hf_draft[dtype], prompts, cfg, get("transformers", "assisted bf16", category, t))
            if hf and goal:
                # fp32 on the workload the goals are judged on only (and loaded only for it: ~8 GB)
                from transformers import AutoModelForCausalLM

                t32 = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval()
                d32 = AutoModelForCausalLM.from_pretrained(cfg.draft, dtype=torch.float32).eval()
                run_hf(t32, None, prompts, cfg, get("transformers", "generate fp32", category, t))
                run_hf(t32, d32, prompts, cfg, get("transformers", "assisted fp32", category, t))
                del t32, d32
                gc.collect()
            if llama.binary is not None:
                from specd.benchmarks.llama_cpp import LlamaServer, ServerConfig

                for name, (model_file, draft_file, n_max) in llama.configs.items():
                    sc = ServerConfig(model_file, draft_file, threads=cfg.llama_threads, draft_max=max(n_max, 1))
                    with LlamaServer(sc, llama.binary) as srv:
                        if srv.repack_off and "repacking off" not in llama.note:
                            llama.note = f"{llama.note or 'built'}; weight repacking off (it crashed loading with it)"
                        run_llama(srv, prompts[:1], cfg, Run("warm", "", "", t))  # first request pays set-up
                        run_llama(srv, prompts, cfg, get("llama.cpp", name, category, t, n_max))
            print(f"pass {rep + 1}/{passes}: {category} T={t} done", flush=True)
        for r in runs.values():
            if r.category == category and r.temperature == t:
                print("  " + _line(r, runs), flush=True)
        if goal and llama.binary is not None:
            llama.configs = _keep_best_llama_draft(llama.configs, runs)
        # Partial results after every group, so an interrupted run still leaves what it measured.
        _write(cfg, runs, bound, llama.note, out)
    del hf, hf_draft, quantized, read_buf
    gc.collect()
    doc = _write(cfg, runs, bound, llama.note, out)
    print(json.dumps(doc["goals"], indent=2))
    return doc


def _paired_target_only(
    engine: Engine, prompts, cfg: PairBenchConfig, run: Run, bound: dict, buffer: torch.Tensor
) -> None:
    """One pass of bf16 target-only decoding with the read bandwidth measured just before and just
    after it: this machine's bandwidth swings between passes (32-70 GB/s within minutes on the VMs it
    ran on), so the share of the bound is judged pass by pass against the bandwidth of the same moment,
    the higher of the two readings (a pass that straddles a swing is judged against its faster side),
    beside the strict figure against the run's best."""
    before = measure_read_bandwidth(reps=3, buffer=buffer)
    tokens, seconds = run.decode_tokens, run.decode_seconds
    run_specd(engine, prompts, "none", 0, cfg, run)
    rate = (run.decode_tokens - tokens) / (run.decode_seconds - seconds)
    after = measure_read_bandwidth(reps=3, buffer=buffer)
    bandwidth = max(before.best_gb_s, after.best_gb_s)
    _raise_bound(bound, bandwidth)
    bytes_per_token = bound["specd_bf16_bytes_per_token"]
    bound.setdefault("target_only_passes", []).append(
        {
            "bandwidth_gb_s": bandwidth,
            "bandwidth_before_gb_s": before.best_gb_s,
            "bandwidth_after_gb_s": after.best_gb_s,
            "decode_tokens_per_second": round(rate, 2),
            "decode_gb_s": round(rate * bytes_per_token / 1e9, 2),
            "share_of_bound": round(rate * bytes_per_token / (bandwidth * 1e9), 3),
        }
    )


# A round whose two readings (before and after it) differ by more than this share straddled a swing of
# the machine's bandwidth, and no reading says what it ran at.
STEADY_READ_SPREAD = 0.10
# Tokens a bound round decodes: short enough that most rounds fall between two swings of a VM whose
# read doubles and halves within seconds, long enough to time (2-3 s on the real pair's target).
BOUND_ROUND_TOKENS = 32
BOUND_ROUNDS_PER_PASS = 4
# Steady rounds whose reading is within this share of the run's best count as its fast minutes.
FAST_READ_SHARE = 0.85


def bound_round(before_gb_s: float, after_gb_s: float, tokens_per_second: float, bytes_per_token: int) -> dict:
    """One bound round: its share of the bound against the faster of the readings around it, and
    whether those agree (``STEADY_READ_SPREAD``), i.e. whether the round ran at that bandwidth."""
    bandwidth = max(before_gb_s, after_gb_s)
    return {
        "bandwidth_before_gb_s": before_gb_s,
        "bandwidth_after_gb_s": after_gb_s,
        "decode_tokens_per_second": round(tokens_per_second, 2),
        "share_of_bound": round(tokens_per_second * bytes_per_token / (bandwidth * 1e9), 3),
        "steady": abs(before_gb_s - after_gb_s) <= STEADY_READ_SPREAD * bandwidth,
    }


def summarize_bound_rounds(rounds: list[dict], best_gb_s: float) -> dict:
    """The steady rounds' shares of the bound (median, range), all of them and those in the run's
    fast minutes (read within ``FAST_READ_SHARE`` of ``best_gb_s``, the run's best reading)."""

    def stats(shares: list[float]) -> dict:
        if not shares:
            return {"rounds": 0, "median": None, "min": None, "max": None}
        median = round(statistics.median(shares), 3)
        return {"rounds": len(shares), "median": median, "min": min(shares), "max": max(shares)}

    steady = [r for r in rounds if r["steady"]]
    fast_read = FAST_READ_SHARE * best_gb_s
    fast = [r for r in steady if max(r["bandwidth_before_gb_s"], r["bandwidth_after_gb_s"]) >= fast_read]
    return {
        "rounds": len(rounds),
        "steady": stats([r["share_of_bound"] for r in steady]),
        "steady_fast": stats([r["share_of_bound"] for r in fast]),
    }


def _bound_rounds(engine: Engine, ids, bound: dict, buffer: torch.Tensor) -> None:
    """``BOUND_ROUNDS_PER_PASS`` short target-only rounds (``BOUND_ROUND_TOKENS`` greedy tokens of one
    prompt), each between two readings of the bandwidth: a whole pass often straddles a swing of a VM
    whose read doubles and halves within seconds (a pass then reads 0.5 or 1.5 of the bound), a short
    round between two agreeing readings ran at that bandwidth."""

    def read() -> float:
        return measure_read_bandwidth(reps=3, buffer=buffer).best_gb_s

    before = read()
    for _ in range(BOUND_ROUNDS_PER_PASS):
        req = Request(f"bound-{time.monotonic_ns()}", ids, _params(0.0, BOUND_ROUND_TOKENS, 0), SpecConfig("none", 0))
        r = _stream_alone(engine, req)
        rate = r.decode_tokens / r.decode_seconds if r.decode_seconds > 0 else 0.0
        after = read()
        _raise_bound(bound, max(before, after))
        bound.setdefault("target_only_rounds", []).append(
            bound_round(before, after, rate, bound["specd_bf16_bytes_per_token"])
        )
        before = after


def _raise_bound(bound: dict, gb_s: float) -> None:
    """Raise the run's bandwidth to ``gb_s`` where that reading is higher, and every bound derived
    from it (``X_bound_tokens_per_second`` from ``X_bytes_per_token``): the run-wide bound is the
    most a read reached at any moment of the run, so a run that started in the VM's slow minutes is
    not judged against them (a share of the bound above 1 was reported so)."""
    if gb_s <= bound["bandwidth_gb_s"]:
        return
    bound["bandwidth_gb_s"] = gb_s
    _derive_bounds(bound)


def _derive_bounds(bound: dict) -> None:
    """Every ``X_bound_tokens_per_second``: the run's bandwidth over ``X_bytes_per_token``."""
    gb_s = bound["bandwidth_gb_s"]
    for key in [k for k in bound if k.endswith("_bytes_per_token")]:
        bound[key.removesuffix("_bytes_per_token") + "_bound_tokens_per_second"] = round(gb_s * 1e9 / bound[key], 2)


def _write(cfg: PairBenchConfig, runs: dict, bound: dict, llama_note: str, out: Path) -> dict:
    doc = _document(cfg, runs, bound, llama_note)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"pair_bench_{cfg.pair}" + ("_quick" if cfg.quick else "")
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    _plot(doc, out / f"{stem}.png")
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}", flush=True)
    return doc


def _keep_best_llama_draft(configs: dict, runs: dict) -> dict:
    """After the goal group: per GGUF, llama.cpp's target alone and its fastest draft length only."""
    kept = {}
    for name, conf in configs.items():
        base = name.split("+")[0]
        if name == base:
            kept[name] = conf
            continue
        rivals = [n for n in configs if n.startswith(base + "+")]
        best = max(rivals, key=lambda n: runs[("llama.cpp", n, "code", 0.0)].tokens_per_second)
        if name == best:
            kept[name] = conf
    return kept


def _base(r: Run, runs: dict) -> Run | None:
    """Each system's own target-only run of the same group."""
    own = {"specd": "target-only", "transformers": "generate bf16", "llama.cpp": r.mode.split("+")[0]}[r.system]
    if r.system == "transformers" and r.mode.endswith("fp32"):
        own = "generate fp32"
    return runs.get((r.system, own, r.category, r.temperature))


def _line(r: Run, runs: dict) -> str:
    base = _base(r, runs)
    x = r.tokens_per_second / base.tokens_per_second if base and base.tokens_per_second else 0.0
    extra = ""
    if r.system == "specd" and r.stats.proposed_tokens:
        extra = f" acc={r.stats.acceptance_rate:.2f} tok/fwd={r.stats.tokens_per_forward:.2f}"
    if r.llama_draft_n:
        extra = f" acc={r.llama_draft_accepted / r.llama_draft_n:.2f}"
    base_name = "bf16 target-only" if r.target != "bf16" else "own target-only"
    return f"{r.system:12s} {r.mode:16s} {r.tokens_per_second:7.2f} tok/s (x{x:.2f} {base_name}){extra}"


def _draft_weights(quantize: str | None) -> str:
    """What the main engine's draft runs in: ``--draft-quantize`` with "auto" resolved."""
    if quantize == "auto":
        from specd.services.engine.model import default_draft_quantize

        quantize = default_draft_quantize("cpu")
    return quantize or "bf16"


def _identical(r: Run, ref: Run) -> str:
    """How many of ``r``'s outputs equal ``ref``'s, as "n/N"."""
    return f"{sum(a == b for a, b in zip(r.outputs, ref.outputs))}/{len(r.outputs)}"


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _row(r: Run, runs: dict) -> dict:
    base = _base(r, runs)
    row = {
        "system": r.system,
        "mode": r.mode,
        "category": r.category,
        "temperature": r.temperature,
        "k": r.k,
        "tokens": r.tokens,
        "seconds": round(r.seconds, 3),
        "tokens_per_second": round(r.tokens_per_second, 2),
        "speedup_vs_own_target_only": round(r.tokens_per_second / base.tokens_per_second, 3)
        if base and base.tokens_per_second
        else None,
    }
    if r.decode_seconds:
        row["decode_tokens_per_second"] = round(r.decode_tokens_per_second, 2)
    if r.system == "specd" and r.target != "bf16":
        own = runs.get(("specd", f"{r.target} target-only", r.category, r.temperature))
        if own is not None and own.tokens_per_second:
            row["speedup_vs_same_target_only"] = round(r.tokens_per_second / own.tokens_per_second, 3)
        if r.temperature == 0.0 and r is not own and own is not None:
            row["greedy_identical_to_target_only"] = _identical(r, own)
        if r.mode.endswith("target-only") and base is not None and r.temperature == 0.0:
            # What quantization does to the text: greedy outputs equal to the bf16 target's, and the
            # mean share of each output before its first difference.
            row["greedy_identical_to_bf16"] = _identical(r, base)
            row["greedy_prefix_agreement_with_bf16"] = round(
                sum(_prefix(a, b) / max(len(b), 1) for a, b in zip(r.outputs, base.outputs)) / max(len(r.outputs), 1), 3
            )
    elif r.system == "specd" and r.temperature == 0.0 and base is not None and r is not base:
        # bf16 greedy: is the text the target-only text? (exact in fp32; in bf16 a near-tie may round
        # differently with k+1 queries than with one, so this is measured, not assumed)
        row["greedy_identical_to_target_only"] = _identical(r, base)
    if r.system == "specd" and r.stats.target_forward_passes:
        row.update(
            acceptance_rate=round(r.stats.acceptance_rate, 4),
            alpha_hat=round(alpha_hat(r.stats), 4),
            tokens_per_target_forward=round(r.stats.tokens_per_forward, 3),
        )
    if r.llama_draft_n:
        row["acceptance_rate"] = round(r.llama_draft_accepted / r.llama_draft_n, 4)
    return row


def _document(cfg: PairBenchConfig, runs: dict, bound: dict, llama_note: str) -> dict:
    rows = [_row(r, runs) for r in runs.values()]

    def tps(system: str, mode: str, category: str = "code", t: float = 0.0) -> float | None:
        r = runs.get((system, mode, category, t))
        return round(r.tokens_per_second, 2) if r and r.tokens else None

    default_mode = (
        f"auto k<={cfg.auto_k}" if cfg.default_method == "auto" else f"{cfg.default_method} k={cfg.default_k}"
    )
    specd_base = tps("specd", "target-only")
    specd_default = tps("specd", default_mode)
    spec_modes = [
        m
        for (s, m, c, t), r in runs.items()
        if s == "specd" and c == "code" and t == 0.0 and m != "target-only" and r.target == "bf16"
    ]
    # The quantization issue's goals: any exact configuration (speculation keeps its own target's
    # output), against bf16 target-only and llama.cpp's best on the Q4_K_M files.
    any_modes = [m for (s, m, c, t) in runs if s == "specd" and c == "code" and t == 0.0]
    best_any = max(any_modes, key=lambda m: tps("specd", m) or 0.0) if any_modes else None
    llama_q4 = max(
        (v for (s, m, c, t) in runs if s == "llama.cpp" and c == "code" and t == 0.0 and m.startswith("q4_k_m")
         for v in [tps(s, m)] if v),
        default=None,
    )  # fmt: skip
    best_mode = max(spec_modes, key=lambda m: tps("specd", m) or 0.0) if spec_modes else None
    hf_assisted = [v for v in (tps("transformers", "assisted bf16"), tps("transformers", "assisted fp32")) if v]
    llama_f16_draft = max(
        (v for m in LLAMA_DRAFT_MAX for v in [tps("llama.cpp", f"f16+draft k={m}")] if v), default=None
    )
    llama_best = max(
        (
            v
            for (s, m, c, t), r in runs.items()
            if s == "llama.cpp" and c == "code" and t == 0.0
            for v in [tps(s, m)]
            if v
        ),
        default=None,
    )
    target_only = runs.get(("specd", "target-only", "code", 0.0))
    decode = round(target_only.decode_tokens_per_second, 2) if target_only else None

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    goals = {
        "workload": "code prompts, greedy, tokens/s",
        "default_mode": default_mode,
        "specd_target_only": specd_base,
        "specd_default": specd_default,
        "default_vs_specd_target_only": ratio(specd_default, specd_base),
        "default_vs_best_hf_assisted": ratio(specd_default, max(hf_assisted) if hf_assisted else None),
        "specd_target_only_decode": decode,
        "bandwidth_bound": bound["specd_bf16_bound_tokens_per_second"],
        "target_only_share_of_bound": ratio(decode, bound["specd_bf16_bound_tokens_per_second"]),
        # each pass against the bandwidth measured around it (see _paired_target_only)
        "target_only_share_of_bound_per_pass": [p["share_of_bound"] for p in bound.get("target_only_passes", [])],
        # short rounds between two readings, those that agree (see _bound_rounds)
        "target_only_share_of_bound_steady_rounds": summarize_bound_rounds(
            bound.get("target_only_rounds", []), bound["bandwidth_gb_s"]
        ),
        "best_specd_mode": best_mode,
        "best_specd": tps("specd", best_mode) if best_mode else None,
        "llama_cpp_f16_with_draft": llama_f16_draft,
        "best_specd_vs_llama_cpp_f16_with_draft": ratio(
            tps("specd", best_mode) if best_mode else None, llama_f16_draft
        ),
        "default_vs_llama_cpp_f16_with_draft": ratio(specd_default, llama_f16_draft),
        "llama_cpp_best": llama_best,
        "best_specd_any_mode": best_any,
        "best_specd_any": tps("specd", best_any) if best_any else None,
        "best_specd_any_vs_bf16_target_only": ratio(tps("specd", best_any) if best_any else None, specd_base),
        "llama_cpp_q4_k_m_best": llama_q4,
        "best_specd_any_vs_llama_cpp_q4_k_m_best": ratio(tps("specd", best_any) if best_any else None, llama_q4),
    }
    draft_speedups = {
        q: ratio(tps("specd", m), specd_base)
        for q, m in (
            ("bf16", f"bf16 draft k={cfg.default_k}"),
            ("int8", f"int8 draft k={cfg.default_k}"),
            ("int4", f"int4 draft k={cfg.default_k}"),
            (_draft_weights(cfg.draft_quantize), f"draft k={cfg.default_k}"),  # the main engine's draft
        )
        if tps("specd", m)
    }
    if draft_speedups:
        goals["bf16_target_speedup_by_draft_weights"] = draft_speedups
    return {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "kernel_tuning": _kernel_tuning(),
        "llama_cpp": llama_note or "built",
        "bound": bound,
        "goals": goals,
        "rows": rows,
    }


def _kernel_tuning() -> dict | None:
    """What this process's CPU kernels chose (prefetch, one-row block, bf16 dot products and their
    chunked long rows, work stealing), so a result says which blocks ran; None without the kernels."""
    from specd.services.engine import kernels

    tuning = kernels.kernel_tuning()
    if tuning is None:
        return None
    return {
        "float_prefetch": tuning.float_prefetch._asdict(),
        "quant_prefetch": tuning.quant_prefetch._asdict(),
        "bf16_one_row_weight_rows": tuning.bf16_one_row_weight_rows,
        "bf16_dot": tuning.bf16_dot,
        "dot_chunk": tuning.dot_chunk,
        "work_stealing": tuning.work_stealing,
    }


def _plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["category"], r["temperature"]) for r in doc["rows"]})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 6), squeeze=False, sharey=True)
    colors = {"specd": "tab:blue", "transformers": "tab:orange", "llama.cpp": "tab:green"}
    for ax, (category, t) in zip(axes[0], groups):
        rows = [r for r in doc["rows"] if r["category"] == category and r["temperature"] == t]
        labels = [f"{r['system']} {r['mode']}" for r in rows]
        ax.barh(range(len(rows)), [r["tokens_per_second"] for r in rows], color=[colors[r["system"]] for r in rows])
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{category}, T={t}")
        ax.set_xlabel("tokens/s (batch 1)")
        if category == "code" and t == 0.0:
            ax.axvline(doc["bound"]["specd_bf16_bound_tokens_per_second"], color="grey", ls=":", lw=1)
    fig.suptitle(f"{doc['config']['pair']}: specd, transformers and llama.cpp (dotted: bf16 bandwidth bound)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(doc: dict) -> str:
    """The README tables: every row of every group, then the goals (``python -m specd.benchmarks.pair_bench FILE``)."""
    lines = []
    groups = sorted({(r["category"], r["temperature"]) for r in doc["rows"]}, key=lambda g: (g != ("code", 0.0), g))
    for category, t in groups:
        lines += [f"\n{category} prompts, T = {t}:\n", "| system | mode | tok/s | x own target-only | acceptance |"]
        lines.append("|---|---|---|---|---|")
        for r in doc["rows"]:
            if (r["category"], r["temperature"]) != (category, t):
                continue
            acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r and r["k"] else ""
            x = f"{r['speedup_vs_own_target_only']:.2f}" if r.get("speedup_vs_own_target_only") else ""
            lines.append(f"| {r['system']} | {r['mode']} | {r['tokens_per_second']:.2f} | {x} | {acc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
