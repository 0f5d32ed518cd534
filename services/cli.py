"""``specd`` command line: argument parsing only; the work lives in the modules it calls."""

from __future__ import annotations

import argparse
import json
import sys
import time

from services.engine.builder import DEMO_DRAFT, DEMO_TARGET, DTYPES


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=str(DEMO_TARGET), help="target model dir or hub id (default: demo target)")
    p.add_argument("--draft", default=str(DEMO_DRAFT), help="draft model dir or hub id (default: demo draft)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="dtype of both models; float32 is exact against transformers",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--backend", choices=["auto", "own", "transformers"], default="auto")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def cmd_generate(args: argparse.Namespace) -> int:
    from services.engine.builder import ModelSpec, build_engine
    from services.engine.chat import encode_chat, encode_text
    from services.engine.engine import EngineConfig, Request, SpecConfig
    from services.engine.sampling import SamplingParams

    draft = args.draft if args.method in ("draft", "hybrid") else None
    spec = ModelSpec(
        target=args.target,
        draft=draft,
        target_dtype=args.dtype,
        draft_dtype=args.dtype,
        device=args.device,
        backend=args.backend,
    )
    engine = build_engine(spec, EngineConfig(max_batch_size=1))
    tok = engine.tokenizer
    if args.chat:
        prompt_ids = encode_chat(tok, [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = encode_text(tok, args.prompt)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )
    req = Request("cli", tuple(prompt_ids), params, SpecConfig(args.method, args.num_speculative_tokens))
    engine.add_request(req)
    token_ids: list[int] = []
    text = ""
    stats = None
    finish = None
    t0 = time.perf_counter()
    for out in engine.stream():
        token_ids += out.token_ids
        text += out.text
        if not args.json:
            sys.stdout.write(out.text)
            sys.stdout.flush()
        if out.finished:
            stats, finish = out.stats, out.finish_reason
    seconds = time.perf_counter() - t0
    if args.json:
        result = {
            "text": text,
            "token_ids": token_ids,
            "finish_reason": finish,
            "stats": {
                **(stats.as_dict() if stats else {}),
                "decode_seconds": round(seconds, 4),
                "tokens_per_second": round(len(token_ids) / seconds, 2) if seconds > 0 else None,
            },
        }
        print(json.dumps(result))
    else:
        print()
        s = stats
        print(
            f"[{len(token_ids)} tokens in {seconds:.2f}s, {len(token_ids) / seconds:.1f} tok/s; "
            f"acceptance {s.acceptance_rate:.2f}, {s.tokens_per_forward:.2f} tokens per target forward]",
            file=sys.stderr,
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.engine_bench import BenchConfig, run_engine_bench

    cfg = BenchConfig(
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        ks=tuple(int(k) for k in args.k.split(",")),
        max_tokens=args.max_tokens,
        temperatures=tuple(float(t) for t in args.temperatures.split(",")),
        repeats=args.repeats,
        out_dir=args.out,
        quick=args.quick,
        include_hf=not args.no_hf,
    )
    run_engine_bench(cfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="speculative-decoding LLM server")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text in-process (engine only)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument(
        "--method",
        choices=["draft", "ngram", "hybrid", "none"],
        default="draft",
        help="hybrid: n-gram lookup first, the draft model when it finds nothing",
    )
    g.add_argument("--num-speculative-tokens", type=int, default=4)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="engine benchmark: baselines and specd side by side")
    _add_model_args(b)
    b.add_argument("--k", default="1,2,3,4,5,6,7,8", help="speculative block sizes to sweep")
    b.add_argument("--max-tokens", type=int, default=96)
    b.add_argument("--temperatures", default="0,0.8")
    b.add_argument("--repeats", type=int, default=2, help="interleaved passes over all modes, summed")
    b.add_argument("--out", default="benchmarks/results")
    b.add_argument("--quick", action="store_true", help="two prompts, short outputs (smoke test)")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # bad arguments or models: a clear message, not a traceback
        parser.exit(2, f"specd {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
