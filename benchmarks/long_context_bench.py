"""Serving at real lengths: benchmarks (not tests) for chunked prefill, long prompts and the KV pool.

``python -m benchmarks.long_context_bench MODE [options]``; every mode prints one JSON object.

- ``gap``: a stream decodes while a ~900-token prompt arrives; reports the prompt's time to first
  token and the running stream's longest gap between outputs during that time, and their ratio
  (issue 13's acceptance 1 wants it under 0.4). Demo pair, in-process engine, default settings.
- ``chunk-cost``: what one prefill pass of T tokens costs against one decode round (batch 1 and
  batch 16, k=3, the target's default): how ``--prefill-chunk``'s default was chosen.
- ``ttft``: time to first token of a long prompt (default 2,000 tokens), speculation on.
- ``decode``: per-token decode time across a long output, in windows of ``--window`` tokens (flat
  means no per-round work grows with the output: detokenization, block tables).
- ``memory``: resident memory of this process after loading the pair and prefilling a prompt of
  ``--tokens`` (up to the model's full context), with the KV pool's size and use.

``--pair qwen2.5-coder`` runs ``ttft``/``decode``/``memory`` on the real pair (fetched into the cache).
On a shared machine every figure is noisy; run on a quiet one for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from services.engine.builder import ModelSpec, build_engine
from services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from services.engine.sampling import SamplingParams
from services.paths import DEMO_DRAFT, DEMO_TARGET

FILLER = (
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"
)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def prompt_ids(engine: Engine, n: int, salt: str = "") -> tuple[int, ...]:
    """Exactly ``n`` token ids of code text (repeated filler, distinct per salt)."""
    text = salt
    ids: list[int] = []
    while len(ids) < n:
        text += FILLER.replace("merge", f"merge_{len(text) % 97}")
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return tuple(ids[:n])


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _spec_of(args) -> ModelSpec:
    if args.pair:
        from services.model_store.pairs import resolve_pair

        paths = resolve_pair(args.pair)
        return ModelSpec(str(paths.target), str(paths.draft), args.dtype, args.dtype, draft_quantize=args.draft_quantize)
    return ModelSpec(str(DEMO_TARGET), str(DEMO_DRAFT), args.dtype, args.dtype)


def _config(args, **overrides) -> EngineConfig:
    kw = {"max_batch_size": args.batch}
    if args.prefill_chunk:
        kw["prefill_chunk"] = args.prefill_chunk
    return EngineConfig(**(kw | overrides))


def bench_gap(args) -> dict:
    engine = build_engine(_spec_of(args), _config(args))
    spec = SpecConfig("draft", 3)
    results = []
    for rep in range(args.repeats):
        stream = Request(f"run{rep}", prompt_ids(engine, 32, f"# run {rep}\n"), _greedy(10_000), spec)
        long = Request(f"long{rep}", prompt_ids(engine, args.tokens, f"# long {rep}\n"), _greedy(4), spec)
        engine.add_request(stream)
        for _ in range(5):  # the stream is decoding before the long prompt arrives
            engine.step()
        last = time.perf_counter()
        engine.add_request(long)
        t_add = last
        gaps, ttft = [], None
        while ttft is None:
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id == stream.request_id and o.token_ids:
                    gaps.append(now - last)
                    last = now
                if o.request_id == long.request_id and o.token_ids and ttft is None:
                    ttft = now - t_add
        engine.abort(stream.request_id)
        engine.abort(long.request_id)
        engine.step()
        results.append({"ttft_s": ttft, "longest_gap_s": max(gaps), "ratio": max(gaps) / ttft, "gaps": len(gaps)})
    return {
        "mode": "gap",
        "prompt_tokens": args.tokens,
        "prefill_chunk": engine.config.prefill_chunk,
        "runs": results,
        "median_ratio": statistics.median(r["ratio"] for r in results),
    }


@torch.inference_mode()
def bench_chunk_cost(args) -> dict:
    engine = build_engine(_spec_of(args), _config(args, max_batch_size=16))
    target, cache = engine.target, engine.cache

    def timed(fn, n: int = 10) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    slots = [cache.allocate() for _ in range(16)]
    for s in slots:
        cache.reserve(s, 600)

    def decode(batch: int) -> None:
        ids = torch.zeros((batch, 4), dtype=torch.long, device=target.device)
        target.forward(ids, cache, cache.layout(slots[:batch], [300] * batch, 4, target.device), "all")

    def prefill(T: int) -> None:
        ids = torch.zeros((1, T), dtype=torch.long, device=target.device)
        target.forward(ids, cache, cache.layout(slots[:1], [300], T, target.device), "none")

    out = {"mode": "chunk-cost", "decode_round_b1_s": timed(lambda: decode(1)), "decode_round_b16_s": timed(lambda: decode(16))}
    out["prefill_pass_s"] = {T: timed(lambda T=T: prefill(T)) for T in (16, 32, 64, 128, 256)}
    return out


def bench_ttft(args) -> dict:
    engine = build_engine(_spec_of(args), _config(args))
    ids = prompt_ids(engine, args.tokens)
    rows = []
    for rep in range(args.repeats):
        engine.add_request(Request(f"t{rep}", ids, _greedy(2), SpecConfig("draft", 3)))
        t0 = time.perf_counter()
        first = None
        while engine.has_work():
            for o in engine.step():
                if o.token_ids and first is None:
                    first = time.perf_counter() - t0
        rows.append(first)
    return {"mode": "ttft", "prompt_tokens": len(ids), "ttft_s": rows, "max_context": engine.max_len}


def bench_decode(args) -> dict:
    engine = build_engine(_spec_of(args), _config(args))
    engine.add_request(Request("d", prompt_ids(engine, 64), _greedy(args.output), SpecConfig("draft", 3)))
    marks, n = [time.perf_counter()], 0
    next_mark = args.window
    while engine.has_work():
        for o in engine.step():
            n += len(o.token_ids)
        if n >= next_mark:
            marks.append(time.perf_counter())
            next_mark += args.window
    per_token_ms = [1000 * (b - a) / args.window for a, b in zip(marks, marks[1:])]
    return {"mode": "decode", "window": args.window, "ms_per_token_by_window": per_token_ms}


def bench_memory(args) -> dict:
    before = _rss_bytes()
    engine = build_engine(_spec_of(args), _config(args))
    loaded = _rss_bytes()
    n = min(args.tokens, engine.max_len - 8)
    engine.generate([Request("m", prompt_ids(engine, n), _greedy(4), SpecConfig("draft", 3))])
    cache = engine.cache
    return {
        "mode": "memory",
        "max_context": engine.max_len,
        "prompt_tokens": n,
        "kv_pool_bytes": cache.num_blocks * cache.block_size * engine.target.kv_bytes_per_token,
        "kv_pool_positions": cache.capacity_tokens,
        "rss_start_bytes": before,
        "rss_loaded_bytes": loaded,
        "rss_after_prompt_bytes": _rss_bytes(),
    }


MODES = {"gap": bench_gap, "chunk-cost": bench_chunk_cost, "ttft": bench_ttft, "decode": bench_decode, "memory": bench_memory}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--pair", default=None, help="a fetched pair (e.g. qwen2.5-coder); default: the demo pair")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--draft-quantize", default=None)
    p.add_argument("--tokens", type=int, default=900, help="gap/ttft/memory: prompt length")
    p.add_argument("--output", type=int, default=2048, help="decode: tokens to generate")
    p.add_argument("--window", type=int, default=256, help="decode: tokens per timing window")
    p.add_argument("--batch", type=int, default=16, help="engine max batch size")
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the engine's")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = MODES[args.mode](args) | {"pid": os.getpid(), "note": "single run; a shared machine makes it noisy"}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
