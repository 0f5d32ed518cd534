"""Serving at real lengths: benchmarks (not tests) for chunked prefill, long prompts and the KV pool.

``python -m specd.benchmarks.long_context_bench MODE [options]``; every mode prints one JSON object.

- ``gap``: a stream decodes while a ~900-token prompt arrives; reports the prompt's time to first
  token and the running stream's longest gap between outputs during that time, and their ratio
  (issue 13's acceptance 1 wants it under 0.4). Demo pair, in-process engine, default settings.
- ``gap-stack``: the same through ``specd serve`` (demo pair, default settings): a streaming
  completion decoding, then a completion with a ``--tokens`` prompt.
- ``chunk-cost``: what one prefill pass of T tokens costs against one decode round (batch 1 and
  batch 16, k=3, the target's default): how ``--prefill-chunk``'s default was chosen.
- ``ttft``: time to first token of a long prompt (default 2,000 tokens), speculation on (each
  repeat a different prompt, so the prefix cache never serves it).
- ``prefix``: a conversation of ``--turns`` turns over a ``--tokens`` context, each turn's prompt
  the previous prompt, its answer and a new question, with the prefix cache on and off (one engine,
  the two ways interleaved, each conversation distinct): time to first token per turn, the ratio,
  the tokens the cache served, and whether the answers were the same.
- ``prefix-stack``: the same conversations through ``specd serve`` (``--pair`` if given): two
  stacks at once, ``--prefix-caching on`` and ``off``, the conversations alternating between them;
  time to first streamed token per turn, ``usage.prompt_tokens_details.cached_tokens``, the texts.
- ``decode``: per-token decode time across a long output, in windows of ``--window`` tokens (flat
  means no per-round work grows with the output: detokenization, block tables).
- ``memory``: resident memory of this process after loading the pair and prefilling a prompt of
  ``--tokens`` (up to the model's full context), with the KV pool's size and use.
- ``serve-memory``: ``specd serve`` (default settings, ``--pair`` if given) as a user starts it;
  the context it offers (``/v1/models``), one chat completion with a ``--tokens`` prompt, its time
  to first token, and the whole process tree's resident memory (peak, sampled every 0.2 s).
  Issue 13's acceptance 2: 32k context and a 2,000-token prompt under 12 GB on the real pair.

``--pair qwen2.5-coder`` runs ``ttft``/``decode``/``memory`` on the real pair (fetched into the cache).
On a shared machine every figure is noisy; run on a quiet one for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from specd.services.common.constants import DEMO_DRAFT, DEMO_TARGET, FIXED_NUM_TOKENS
from specd.services.common.process import specd_command
from specd.services.engine.builder import ModelSpec, build_engine
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.sampling import SamplingParams

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
        from specd.services.model_store.fetch import resolve_pair

        paths = resolve_pair(args.pair)
        return ModelSpec(
            str(paths.target), str(paths.draft), args.dtype, args.dtype, draft_quantize=args.draft_quantize
        )
    return ModelSpec(str(DEMO_TARGET), str(DEMO_DRAFT), args.dtype, args.dtype)


def _config(args, **overrides) -> EngineConfig:
    kw = {"max_batch_size": args.batch}
    if args.prefill_chunk:
        kw["prefill_chunk"] = args.prefill_chunk
    return EngineConfig(**(kw | overrides))


def bench_gap(args) -> dict:
    engine = build_engine(_spec_of(args), _config(args))
    spec = SpecConfig("draft", FIXED_NUM_TOKENS)
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

    slots = [cache.allocate() for _ in range(16)]
    for s in slots:
        cache.reserve(s, 600)

    def decode(batch: int) -> None:
        ids = torch.zeros((batch, 4), dtype=torch.long, device=target.device)
        target.forward(ids, cache, cache.layout(slots[:batch], [300] * batch, 4, target.device), "all")

    def prefill(T: int) -> None:
        ids = torch.zeros((1, T), dtype=torch.long, device=target.device)
        target.forward(ids, cache, cache.layout(slots[:1], [300], T, target.device), "none")

    cases = {"decode_b1": lambda: decode(1), "decode_b16": lambda: decode(16)}
    cases |= {f"prefill_{T}": (lambda T=T: prefill(T)) for T in (16, 32, 64, 128, 256)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(args.repeats * 5):  # interleaved, medians: a shared machine drifts between cases
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "mode": "chunk-cost",
        "median_s": med,
        "prefill_over_decode_b1": {n: med[n] / med["decode_b1"] for n in med if n.startswith("prefill")},
        "prefill_over_decode_b16": {n: med[n] / med["decode_b16"] for n in med if n.startswith("prefill")},
    }


def bench_ttft(args) -> dict:
    engine = build_engine(_spec_of(args), _config(args))
    rows = []
    for rep in range(args.repeats):
        ids = prompt_ids(engine, args.tokens, f"# prompt {rep}\n")
        engine.add_request(Request(f"t{rep}", ids, _greedy(2), SpecConfig("draft", FIXED_NUM_TOKENS)))
        t0 = time.perf_counter()
        first = None
        while engine.has_work():
            for o in engine.step():
                if o.token_ids and first is None:
                    first = time.perf_counter() - t0
        rows.append(first)
    return {"mode": "ttft", "prompt_tokens": len(ids), "ttft_s": rows, "max_context": engine.max_len}


def _first_token_and_answer(engine: Engine, req: Request) -> tuple[float, list[int], int]:
    """Run one request alone: seconds to its first token, its tokens, and the prompt tokens cached."""
    engine.add_request(req)
    t0 = time.perf_counter()
    first, tokens, cached = None, [], 0
    while engine.has_work():
        for o in engine.step():
            if o.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += o.token_ids
            cached = o.cached_prompt_tokens
    return first, tokens, cached


def _compare_conversations(args, mode: str, converse) -> dict:
    """``converse(way, rep)`` runs one conversation with the prefix cache ``way`` ("on" or "off") and
    returns its (times to first token, cached prompt tokens, answers) per turn; the two ways
    alternate, the first way of each repeat swapping, and the result compares them turn by turn."""
    runs: dict[str, list[tuple[list, list, list]]] = {"on": [], "off": []}
    for rep in range(args.repeats):
        for way in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            runs[way].append(converse(way, rep))
    ttft = {w: [r[0] for r in runs[w]] for w in runs}
    per_turn = {w: [statistics.median(t[i] for t in ttft[w]) for i in range(args.turns)] for w in ttft}
    return {
        "mode": mode,
        "context_tokens": args.tokens,
        "turns": args.turns,
        "output_tokens": args.output,
        "ttft_s": ttft,
        "ttft_median_by_turn_s": per_turn,
        "ttft_off_over_on_by_turn": [off / on for off, on in zip(per_turn["off"], per_turn["on"])],
        "cached_prompt_tokens": {w: [r[1] for r in runs[w]] for w in runs},
        "same_answers": [r[2] for r in runs["on"]] == [r[2] for r in runs["off"]],
    }


def bench_prefix(args) -> dict:
    engine = build_engine(_spec_of(args), _config(args))
    caches = [engine.cache] + [getattr(engine.model_drafter, "cache", engine.cache)]  # the target's, the draft's
    assert all(c.supports_prefix_caching for c in caches), "a cache here cannot share blocks"

    def converse(way: str, rep: int) -> tuple[list, list, list]:
        for c in caches:
            c.prefix_caching = way == "on"
        prompt = prompt_ids(engine, args.tokens, f"# conversation {rep}\n")
        times, hits, said = [], [], []
        for turn in range(args.turns):
            question = engine.tokenizer(f"\n# turn {turn}: write merge_{turn}\n", add_special_tokens=False)
            prompt = prompt + tuple(question["input_ids"])
            first, answer, hit = _first_token_and_answer(
                engine, Request(f"{way}{rep}.{turn}", prompt, _greedy(args.output), SpecConfig())
            )
            times.append(first)
            hits.append(hit)
            said.append(answer)
            prompt = prompt + tuple(answer)
        return times, hits, said

    return _compare_conversations(args, "prefix", converse)


def bench_decode(args) -> dict:
    engine = build_engine(_spec_of(args), _config(args))
    engine.add_request(
        Request("d", prompt_ids(engine, 64), _greedy(args.output), SpecConfig("draft", FIXED_NUM_TOKENS))
    )
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
    engine.generate([Request("m", prompt_ids(engine, n), _greedy(4), SpecConfig("draft", FIXED_NUM_TOKENS))])
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


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(d))
            rss[int(d)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


class _Serve:
    """``specd serve`` (its defaults, ``--pair`` if given) in its own process group, on free ports."""

    def __init__(self, pair: str | None, extra: tuple[str, ...] = ()) -> None:
        import subprocess

        from specd.services.common.ports import free_ports
        from specd.services.common.process import die_with_parent

        port, dport, tport, dm, tm = free_ports(5)
        cmd = specd_command("serve", "--port", str(port))
        for flag, value in (("--draft-port", dport), ("--target-port", tport), ("--draft-metrics-port", dm)):
            cmd += [flag, str(value)]
        cmd += ["--target-metrics-port", str(tm)]
        if pair:
            cmd += ["--pair", pair]
        cmd += list(extra)
        # Its output to stderr: this tool's stdout is the JSON result.
        self.proc = subprocess.Popen(cmd, stdout=sys.stderr, process_group=0, preexec_fn=die_with_parent)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 900) -> float:
        import urllib.request

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("specd serve exited during start-up")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError("specd serve did not become ready")
            time.sleep(0.5)

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the supervisor stops its three children
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _stream_chunks(url: str, body: dict, on_chunk) -> None:
    """POST a streaming request; ``on_chunk(time)`` for every event that carries text."""
    import httpx

    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            c = choices[0]
            if c.get("text") or (c.get("delta") or {}).get("content"):
                on_chunk(time.perf_counter())


def _long_text(tokenizer, n: int) -> str:
    text = ""
    while len(tokenizer(text)["input_ids"]) < n:
        text += FILLER
    return tokenizer.decode(tokenizer(text)["input_ids"][:n])


def _first_token_through(url: str, prompt: str, max_tokens: int) -> tuple[float, str, dict]:
    """One streamed greedy completion: seconds to its first text, the text, and its usage."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    t0, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            piece = (event.get("choices") or [{}])[0].get("text") or ""
            if piece and first is None:
                first = time.perf_counter() - t0
            text += piece
            usage = event.get("usage") or usage
    return first, text, usage


def bench_prefix_stack(args) -> dict:
    from specd.services.engine.builder import load_tokenizer

    stacks = {way: _Serve(args.pair, ("--prefix-caching", way)) for way in ("on", "off")}
    try:
        for s in stacks.values():
            s.wait_ready()
        tok = load_tokenizer(str(_spec_of(args).target))

        def converse(way: str, rep: int) -> tuple[list, list, list]:
            prompt = f"# conversation {rep}\n" + _long_text(tok, args.tokens)
            times, hits, said = [], [], []
            for turn in range(args.turns):
                prompt += f"\n# turn {turn}: write merge_{turn}\n"
                first, text, usage = _first_token_through(stacks[way].url, prompt, args.output)
                times.append(first)
                hits.append(usage["prompt_tokens_details"]["cached_tokens"])
                said.append(text)
                prompt += text
            return times, hits, said

        return _compare_conversations(args, "prefix-stack", converse)
    finally:
        for s in stacks.values():
            s.stop()


def bench_gap_stack(args) -> dict:
    """``gap`` through the whole stack: a stream decoding through ``specd serve``, then a long prompt."""
    import threading

    from transformers import AutoTokenizer

    serve = _Serve(None)
    try:
        serve.wait_ready()
        tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
        runs = []
        for rep in range(args.repeats):
            stamps: list[float] = []
            body = {"prompt": f"# stream {rep}\ndef f(x):\n", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
            t = threading.Thread(target=_stream_chunks, args=(serve.url + "/v1/completions", body, stamps.append))
            t.start()
            while len(stamps) < 10:
                time.sleep(0.01)
            first: list[float] = []
            long_body = {"prompt": f"# long {rep}\n" + _long_text(tok, args.tokens), "max_tokens": 2, "temperature": 0}
            t_send = time.perf_counter()
            _stream_chunks(serve.url + "/v1/completions", long_body, first.append)
            t_first = first[0]
            during = [b - a for a, b in zip(stamps, stamps[1:]) if b > t_send and a < t_first]
            # The gap that spans the long prompt's arrival counts too.
            longest = max(during) if during else 0.0
            runs.append({"ttft_s": t_first - t_send, "longest_gap_s": longest, "ratio": longest / (t_first - t_send)})
            t.join()
        return {
            "mode": "gap-stack",
            "prompt_tokens": args.tokens,
            "runs": runs,
            "median_ratio": statistics.median(r["ratio"] for r in runs),
        }
    finally:
        serve.stop()


def bench_serve_memory(args) -> dict:
    import threading
    import urllib.request

    serve = _Serve(args.pair)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], _tree_rss(serve.proc.pid))

    threading.Thread(target=sample, daemon=True).start()
    try:
        started_s = serve.wait_ready()
        rss_ready = _tree_rss(serve.proc.pid)
        with urllib.request.urlopen(serve.url + "/v1/models", timeout=10) as r:
            card = json.loads(r.read())["data"][0]
        from transformers import AutoTokenizer

        tok_dir = DEMO_TARGET
        if args.pair:
            from specd.services.model_store.fetch import resolve_pair

            tok_dir = resolve_pair(args.pair).target
        tok = AutoTokenizer.from_pretrained(tok_dir)
        body = {
            "model": card["id"],
            "messages": [{"role": "user", "content": "Explain this code briefly:\n" + _long_text(tok, args.tokens)}],
            "max_tokens": 16,
            "temperature": 0,
        }
        stamps: list[float] = []
        t1 = time.perf_counter()
        _stream_chunks(serve.url + "/v1/chat/completions", body, stamps.append)
        return {
            "mode": "serve-memory",
            "pair": args.pair or "demo",
            "max_model_len": card.get("max_model_len"),
            "prompt_tokens_approx": args.tokens,
            "startup_s": started_s,
            "ttft_s": stamps[0] - t1 if stamps else None,
            "request_s": time.perf_counter() - t1,
            "chunks": len(stamps),
            "rss_tree_ready_bytes": rss_ready,
            "rss_tree_after_bytes": _tree_rss(serve.proc.pid),
            "rss_tree_peak_bytes": max(peak[0], rss_ready),
        }
    finally:
        stop.set()
        serve.stop()


MODES = {
    "serve-memory": bench_serve_memory,
    "gap-stack": bench_gap_stack,
    "prefix-stack": bench_prefix_stack,
    "gap": bench_gap,
    "chunk-cost": bench_chunk_cost,
    "ttft": bench_ttft,
    "prefix": bench_prefix,
    "decode": bench_decode,
    "memory": bench_memory,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--pair", default=None, help="a fetched pair (e.g. qwen2.5-coder); default: the demo pair")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--draft-quantize", default=None)
    p.add_argument("--tokens", type=int, default=900, help="gap/ttft/memory: prompt length")
    p.add_argument("--output", type=int, default=None, help="decode: tokens to generate (2048); prefix: per turn (48)")
    p.add_argument("--turns", type=int, default=3, help="prefix: turns of the conversation")
    p.add_argument("--window", type=int, default=256, help="decode: tokens per timing window")
    p.add_argument("--batch", type=int, default=16, help="engine max batch size")
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the engine's")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.output is None:
        args.output = 48 if args.mode.startswith("prefix") else 2048
    if args.threads:
        torch.set_num_threads(args.threads)
    out = MODES[args.mode](args) | {"pid": os.getpid(), "note": "single run; a shared machine makes it noisy"}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
