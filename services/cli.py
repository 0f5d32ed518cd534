"""``specd`` command line: argument parsing only; the work lives in the modules it calls."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from specd.services.common.constants import (
    AUTO_NUM_TOKENS,
    DEFAULT_DTYPE,
    DEFAULT_SPECULATION_METHOD,
    DEMO_DRAFT,
    DEMO_TARGET,
    DTYPE_NAMES,
    FIXED_NUM_TOKENS,
    HUGE_PAGES_SWITCH,
    METHODS_USING_DRAFT_MODEL,
    SPECULATION_METHODS,
    default_num_tokens,
)
from specd.services.common.drain import DEFAULT_DRAIN_TIMEOUT


def _add_pair_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pair",
        default=None,
        help="a known target/draft pair (see `specd models list`), e.g. qwen2.5-coder; overrides --target/--draft",
    )


def _add_draft_quantize_arg(p: argparse.ArgumentParser, flag: str = "--draft-quantize") -> None:
    p.add_argument(
        flag,
        choices=["auto", "none", "int8", "int4"],
        default="auto",
        help="quantize the draft's weights at load: fewer bytes per draft step, the same output "
        "(auto: int8 on CPUs with AVX2, else none)",
    )


def _add_target_quantize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantize",
        choices=["none", "int8", "int4"],
        default="none",
        help="serve the target quantized (weight-only; int4: Q4_K-style super-blocks, the GGUF file's own Q4_K "
        "blocks for a model fetched or imported from one, int8 where it keeps more bits, int8 head): a "
        "different, smaller model, whose output speculation keeps exactly",
    )


def _quantize(value: str) -> str | None:
    return None if value == "none" else value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=str(DEMO_TARGET), help="target model dir or hub id (default: demo target)")
    p.add_argument("--draft", default=str(DEMO_DRAFT), help="draft model dir or hub id (default: demo draft)")
    _add_pair_arg(p)
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPE_NAMES),
        default=DEFAULT_DTYPE,
        help="dtype of both models; float32 is exact against transformers",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--backend", choices=["auto", "own", "transformers"], default="auto")
    _add_draft_quantize_arg(p)
    _add_target_quantize_arg(p)


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    from specd.services.common.config import parse_bytes
    from specd.services.engine.prefill import DEFAULT_PREFILL_CHUNK

    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes of the model's KV block pool, e.g. 2GiB, 512MiB (default 2GiB); full means requests wait",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help=f"prompt tokens per prefill pass, between decode rounds (default {DEFAULT_PREFILL_CHUNK})",
    )


def _kv_kwargs(args: argparse.Namespace) -> dict:
    """--kv-cache-memory and --prefill-chunk as config fields (an unset budget keeps the default)."""
    kw = {"prefill_chunk": args.prefill_chunk}
    if args.kv_cache_memory is not None:
        kw["kv_cache_memory"] = args.kv_cache_memory
    return kw


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS, up to --max-tokens")


def cmd_generate(args: argparse.Namespace) -> int:
    from specd.services.engine.builder import ModelSpec, build_engine
    from specd.services.engine.chat import encode_chat, encode_text
    from specd.services.engine.engine import EngineConfig, Request, SpecConfig
    from specd.services.engine.sampling import SamplingParams

    num_tokens = args.num_speculative_tokens
    if num_tokens is None:
        num_tokens = default_num_tokens(args.method)

    if not args.huge_pages:
        # Read by the kernels when the first weights are placed (kernels/huge_pages.h); nothing is loaded yet.
        os.environ[HUGE_PAGES_SWITCH] = "0"
    draft = args.draft if args.method in (*METHODS_USING_DRAFT_MODEL, "auto") else None
    spec = ModelSpec(
        target=args.target,
        draft=draft,
        target_dtype=args.dtype,
        draft_dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        draft_quantize=_quantize(args.draft_quantize),
        target_quantize=_quantize(args.quantize),
    )
    engine = build_engine(spec, EngineConfig(max_batch_size=1, **_kv_kwargs(args)))
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
        ignore_eos=args.ignore_eos,
    )
    req = Request("cli", tuple(prompt_ids), params, SpecConfig(args.method, 0 if args.method == "none" else num_tokens))
    engine.add_request(req)
    token_ids: list[int] = []
    text = ""
    stats = None
    finish = None
    t0 = time.perf_counter()
    t_first = None  # the first tokens come out of the prompt's prefill and the first round
    first_tokens = 0
    for out in engine.stream():
        if out.token_ids and t_first is None:
            t_first, first_tokens = time.perf_counter(), len(out.token_ids)
        token_ids += out.token_ids
        text += out.text
        if not args.json:
            sys.stdout.write(out.text)
            sys.stdout.flush()
        if out.finished:
            stats, finish = out.stats, out.finish_reason
    seconds = time.perf_counter() - t0
    # Decoding only, as llama.cpp reports it: the tokens after the first output, over the time after it.
    decode_seconds = seconds - (t_first - t0) if t_first is not None else 0.0
    decode_tokens = len(token_ids) - first_tokens
    tokens_per_second = decode_tokens / decode_seconds if decode_seconds > 0 else None
    if args.json:
        result = {
            "text": text,
            "token_ids": token_ids,
            "finish_reason": finish,
            "stats": {
                **(stats.as_dict() if stats else {}),
                "time_to_first_token_seconds": round(t_first - t0, 4) if t_first is not None else None,
                "decode_seconds": round(decode_seconds, 4),
                "tokens_per_second": round(tokens_per_second, 2) if tokens_per_second else None,
                "total_seconds": round(seconds, 4),
            },
        }
        print(json.dumps(result))
    else:
        print()
        s = stats
        rate = f"{tokens_per_second:.1f} tok/s decoding" if tokens_per_second else "no decode steps"
        print(
            f"[{len(token_ids)} tokens in {seconds:.2f}s, first after {(t_first or t0) - t0:.2f}s, {rate}; "
            f"acceptance {s.acceptance_rate:.2f}, {s.tokens_per_forward:.2f} tokens per target forward]",
            file=sys.stderr,
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.startup:
        from specd.benchmarks.startup_bench import StartupConfig, run_startup_bench

        run_startup_bench(StartupConfig(pair=args.pair or "qwen2.5-coder", runs=args.runs, out_dir=args.out))
        return 0
    if args.soak:
        from specd.benchmarks.soak_bench import SoakConfig, run_soak

        concurrency = int(args.concurrency) if args.concurrency_given else 64
        return run_soak(
            SoakConfig(
                target=args.target,
                draft=args.draft,
                dtype=args.dtype,
                duration=args.duration,
                warmup=args.warmup,
                concurrency=concurrency,
                out_dir=args.out,
            )
        )
    if args.paired:
        from specd.benchmarks.paired_bench import PairedBenchConfig, run_paired_bench

        run_paired_bench(
            PairedBenchConfig(
                target=args.target,
                draft=args.draft,
                dtype=args.dtype,
                ks=tuple(int(k) for k in args.k.split(",")) if args.k_given else (2, 3, 4),
                max_tokens=args.max_tokens,
                temperature=_one_temperature(args.temperatures),
                workload=args.workloads,
                rounds=args.repeats or 8,
                out_dir=args.out,
                ablations=args.ablations,
            )
        )
        return 0
    if args.pair and args.pair != "demo" and not args.serve:
        from specd.benchmarks.pair_bench import PairBenchConfig, run_pair_bench
        from specd.services.model_store.fetch import gguf_path
        from specd.services.model_store.pairs import get_pair

        pair = get_pair(args.pair)
        ggufs = [gguf_path(m.source) for m in (pair.target, pair.draft) if m.source is not None]
        # llama.cpp runs on the original quantized files only when both are in the cache
        both = len(ggufs) == 2 and all(p.is_file() for p in ggufs)
        target_gguf, draft_gguf = (str(ggufs[0]), str(ggufs[1])) if both else (None, None)
        run_pair_bench(
            PairBenchConfig(
                pair=args.pair,
                target=args.target,
                draft=args.draft,
                target_gguf=target_gguf,
                draft_gguf=draft_gguf,
                dtype=args.dtype,
                draft_quantize=_quantize(args.draft_quantize),
                ks=tuple(int(k) for k in args.k.split(",")) if args.k_given else (1, 2, 3, 4, 5, 6),
                max_tokens=args.max_tokens,
                temperatures=tuple(float(t) for t in (args.temperatures or "0,0.8").split(",")),
                repeats=args.repeats or 1,
                out_dir=args.out,
                quick=args.quick,
                include_hf=not args.no_hf,
                include_llama_cpp=not args.no_llama_cpp,
                quantized_targets=() if args.no_quantized else ("int8", "int4"),
            )
        )
        return 0
    if args.serve:
        return _serve_bench(args)
    from specd.benchmarks.engine_bench import BenchConfig, run_engine_bench

    cfg = BenchConfig(
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        ks=tuple(int(k) for k in args.k.split(",")),
        max_tokens=args.max_tokens,
        temperatures=tuple(float(t) for t in (args.temperatures or "0,0.8").split(",")),
        repeats=args.repeats or 2,
        out_dir=args.out,
        quick=args.quick,
        include_hf=not args.no_hf,
    )
    run_engine_bench(cfg)
    return 0


def _one_temperature(value: str | None) -> float:
    """``--paired`` compares at one temperature (default 0, greedy)."""
    try:
        return float(value or 0.0)
    except ValueError:
        raise ValueError(f"--paired: one --temperatures value, got {value!r}") from None


def _on_off_list(flag: str, value: str) -> tuple[bool, ...]:
    """``off``, ``on``, ``off,on`` (each once) as booleans, in order."""
    words = tuple(w.strip() for w in value.split(","))
    if not words or any(w not in ("on", "off") for w in words) or len(set(words)) != len(words):
        raise ValueError(f"{flag}: off, on or off,on; got {value!r}")
    return tuple(w == "on" for w in words)


def _serve_bench(args: argparse.Namespace) -> int:
    """``bench --serve``: one run per pair (``--pairs``), or the --target/--draft (or --pair) models."""
    from specd.benchmarks.serve_bench import ServeBenchConfig, run_serve_bench
    from specd.services.model_store.fetch import resolve_pair

    draft_ahead = _on_off_list("--draft-ahead", args.draft_ahead)
    pin_cores = _on_off_list("--pin-cores", args.pin_cores)
    studying = len(draft_ahead) > 1 or any(draft_ahead) or any(pin_cores)
    runs = [(args.pair or "", args.target, args.draft)]
    if args.pairs:
        runs = []
        for name in (n.strip() for n in args.pairs.split(",")):
            paths = resolve_pair(name)
            runs.append((name, str(paths.target), str(paths.draft)))
    for name, target, draft in runs:
        # The drafting-ahead study writes its own files, per pair; the plain run keeps serve_bench.json.
        out_name = "serve_bench" if not studying else "serve_bench_ahead" + (f"_{name}" if name else "")
        if args.quick and studying:
            out_name += "_quick"
        run_serve_bench(
            ServeBenchConfig(
                target=target,
                draft=draft,
                dtype=args.dtype,
                ks=tuple(int(k) for k in args.k.split(",")) if args.k_given else (1, 2, 3, 4, 5),
                auto=not args.no_auto,
                max_tokens=args.max_tokens,
                concurrencies=tuple(int(c) for c in args.concurrency.split(",")),
                workloads=tuple(w.strip() for w in args.workloads.split(",")),
                temperatures=tuple(float(t) for t in (args.temperatures or "0").split(",")),
                max_batch_size=args.max_batch_size,
                repeats=args.repeats or 3,
                min_requests=args.min_requests,
                out_dir=args.out,
                quick=args.quick,
                draft_ahead=draft_ahead,
                pin_cores=pin_cores,
                name=out_name,
                seeded=args.seeded,
                pin_seeded=args.seeded_plans == "pinned",
            )
        )
    return 0


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def _service_kwargs(args: argparse.Namespace) -> dict:
    """The ServiceConfig fields every model service shares (see _add_service_args)."""
    names = ("model", "port", "host", "metrics_port", "dtype", "device", "backend", "max_model_len")
    return {n: getattr(args, n) for n in names} | {"served_model_name": args.served_model_name} | _kv_kwargs(args)


def _tls(args: argparse.Namespace):
    """--tls-cert/--tls-key/--tls-ca (all or none), read once here; None for plaintext."""
    from specd.services.common.tls import TLSConfig

    return TLSConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca, getattr(args, "tls_server_name", None))


def cmd_draft(args: argparse.Namespace) -> int:
    from specd.services.common.runtime import configure_torch_threads
    from specd.services.draft.server import DraftServerConfig, serve

    tls = _tls(args)
    configure_torch_threads(args.threads)
    cfg = DraftServerConfig(
        **_service_kwargs(args),
        max_sequences=args.max_sequences,
        support=args.proposal_support,
        quantize=_quantize(args.quantize),
        drain_timeout=args.drain_timeout,
        tls=tls,
        prefix_caching=args.prefix_caching == "on",
    )
    serve(cfg)
    return 0


def cmd_target(args: argparse.Namespace) -> int:
    from specd.services.common.runtime import configure_torch_threads
    from specd.services.target.server import TargetServerConfig, serve

    tls = _tls(args)
    _check_capacity(args)
    configure_torch_threads(args.threads)
    cfg = TargetServerConfig(
        **_service_kwargs(args),
        draft_addresses=_addresses(args.draft_address or ""),
        max_batch_size=args.max_batch_size,
        max_waiting=args.max_waiting,
        drain_timeout=args.drain_timeout,
        tls=tls,
        default_method=args.speculation_method,
        default_num_tokens=args.num_speculative_tokens,
        draft_round_timeout=args.draft_timeout,
        tensor_parallel_size=args.tensor_parallel_size,
        quantize=_quantize(args.quantize),
        draft_ahead=args.draft_ahead == "on",
        prefix_caching=args.prefix_caching == "on",
        pin_seeded=args.seeded_plans == "pinned",
    )
    serve(cfg)
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from specd.gateway.app import run
    from specd.gateway.settings import GatewaySettings

    addresses = _addresses(args.target_address)
    if not addresses:
        raise ValueError("--target-address needs at least one HOST:PORT")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    if args.ssl_ca_certs and not args.ssl_certfile:
        raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
    if args.request_timeout <= 0 or args.max_body_bytes <= 0 or args.retry_after < 0:
        raise ValueError("--request-timeout and --max-body-bytes must be positive, --retry-after >= 0")
    run(
        GatewaySettings(
            target_addresses=addresses,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            request_timeout=args.request_timeout,
            max_body_bytes=args.max_body_bytes,
            retry_after=args.retry_after,
            drain_timeout=args.drain_timeout,
            tls=_tls(args),
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            ssl_ca_certs=args.ssl_ca_certs,
        )
    )
    return 0


def _check_capacity(args: argparse.Namespace) -> None:
    if args.max_batch_size < 1 or args.max_waiting < 0:
        raise ValueError("--max-batch-size must be >= 1 and --max-waiting >= 0")
    if args.drain_timeout < 0:
        raise ValueError("--drain-timeout must be >= 0")


def cmd_serve(args: argparse.Namespace) -> int:
    from specd.services.common.affinity import CorePlan
    from specd.services.serve import ServeConfig, serve

    _check_capacity(args)
    return serve(
        ServeConfig(
            target=args.target,
            draft=None if args.no_draft else args.draft,
            host=args.host,
            port=args.port,
            draft_port=args.draft_port,
            target_port=args.target_port,
            draft_metrics_port=args.draft_metrics_port,
            target_metrics_port=args.target_metrics_port,
            dtype=args.dtype,
            draft_dtype=args.draft_dtype,
            draft_threads=args.draft_threads,
            draft_quantize=_quantize(args.draft_quantize),
            quantize=_quantize(args.quantize),
            device=args.device,
            api_key=args.api_key,
            num_speculative_tokens=args.num_speculative_tokens,
            max_batch_size=args.max_batch_size,
            max_waiting=args.max_waiting,
            drain_timeout=args.drain_timeout,
            max_model_len=args.max_model_len,
            kv_cache_memory=args.kv_cache_memory,
            prefill_chunk=args.prefill_chunk,
            draft_ahead=args.draft_ahead == "on",
            prefix_caching=args.prefix_caching == "on",
            pin_cores=CorePlan.parse(args.pin_cores) if args.pin_cores else None,
            pin_seeded=args.seeded_plans == "pinned",
        )
    )


def cmd_models_fetch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specd.services.model_store.fetch import fetch_pair

    paths = fetch_pair(args.name, Path(args.dir) if args.dir else None)
    if args.json:
        print(json.dumps({"target": str(paths.target), "draft": str(paths.draft)}))
    else:
        print(f"target: {paths.target}\ndraft:  {paths.draft}")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from specd.services.model_store.fetch import pair_status

    rows = pair_status()
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        where = f"target {r['target']}, draft {r['draft']}" if r["present"] else f"specd models fetch {r['name']}"
        print(f"{r['name']:15s} {'present' if r['present'] else 'missing':8s} {r['description']}\n{'':24s}{where}")
    return 0


def _pair_for_serve(name: str):
    """``specd serve --pair``: the pair's folders, fetched on first use; the demo pair, with a warning,
    when the fetch cannot run (offline, say), so the quick start always serves something."""
    from specd.services.model_store.fetch import FetchError, PairNotFetchedError, fetch_pair, resolve_pair
    from specd.services.model_store.pairs import DEMO

    try:
        return resolve_pair(name)
    except PairNotFetchedError:
        print(f"specd serve: model pair {name!r} is not fetched yet; fetching it now (once)", file=sys.stderr)
    try:
        return fetch_pair(name)
    except FetchError as exc:
        print(
            f"specd serve: WARNING: could not fetch {name!r}: {exc}\n"
            f"specd serve: WARNING: serving the bundled DEMO pair instead (a 34M toy model, not for real use); "
            f"fetch the real pair later with: specd models fetch {name}",
            file=sys.stderr,
        )
        return resolve_pair(DEMO.name)


def _apply_pair(args: argparse.Namespace) -> None:
    """Turn ``--pair NAME`` into the model paths each command reads."""
    if not getattr(args, "pair", None):
        return
    if args.command == "serve":
        paths = _pair_for_serve(args.pair)
    else:
        from specd.services.model_store.fetch import resolve_pair

        paths = resolve_pair(args.pair)
    if args.command == "target":
        args.model = str(paths.target)
    elif args.command == "draft":
        args.model = str(paths.draft)
    else:
        args.target, args.draft = str(paths.target), str(paths.draft)


def _add_service_args(p: argparse.ArgumentParser, port: int, metrics_port: int | None) -> None:
    p.add_argument("--model", default=None, help="model dir or hub id")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--metrics-port", type=int, default=metrics_port, help="Prometheus /metrics port")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=DEFAULT_DTYPE)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--backend", choices=["auto", "own", "transformers"], default="auto")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output, in tokens (default: the model's own)"
    )
    _add_kv_args(p)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: one per core)")
    p.add_argument("--served-model-name", default=None)
    _add_pair_arg(p)


def _add_prefix_caching_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix-caching",
        choices=["on", "off"],
        default="on",
        help="keep the K/V of earlier prompts and reuse them for prompts that start alike (a system "
        "prompt, earlier turns); the output is the same (default on)",
    )


def _add_draft_ahead_arg(p: argparse.ArgumentParser) -> None:
    from specd.services.common.constants import DRAFT_AHEAD_DEFAULT

    default = "on" if DRAFT_AHEAD_DEFAULT else "off"
    p.add_argument(
        "--draft-ahead",
        choices=["on", "off"],
        default=default,
        help="the draft service drafts each sequence's next block while the target verifies, for the likeliest "
        f"outcomes, and answers at once when it guessed right; the output is the same (default {default})",
    )


def _add_seeded_plans_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seeded-plans",
        choices=["pinned", "measured"],
        default="pinned",
        help="auto's plan for a seeded sampled request: pinned (from its own history and fixed costs, so its "
        "text repeats whatever shares its batch, but it cannot back off under load) or measured (from timings "
        "and load like any other request: faster under load, its text then depends on its batch); default pinned",
    )


def _add_capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-size", type=int, default=16, help="sequences verified together")
    p.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        help="requests queued beyond the batch; past batch + waiting a target refuses (the gateway answers 429)",
    )


def _add_drain_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT,
        help="on SIGTERM: seconds for in-flight work to finish (new work is refused meanwhile); then exit 0",
    )


def _add_tls_args(p: argparse.ArgumentParser, client_of: str | None) -> None:
    p.add_argument("--tls-cert", default=None, help="PEM certificate: mutual TLS (with --tls-key and --tls-ca)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-ca", default=None, help="PEM CA: peers must present a certificate it signed (and servers are verified)"
    )
    if client_of:
        p.add_argument(
            "--tls-server-name",
            default=None,
            help=f"the name in the {client_of}' certificates (default: the host in the address; set it when a DNS "
            "name is dialled by its replicas' IPs)",
        )


class _ExactOptionParser(argparse.ArgumentParser):
    """An argument parser that takes options only by their whole names: with argparse's default
    prefix matching, `specd generate --k 4` was read as `--kv-cache-memory 4` (a 4-byte KV budget)
    instead of failing. Subcommand parsers are built with the same class."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _ExactOptionParser(prog="specd", description="speculative-decoding LLM server")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text in-process (engine only)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument(
        "--method",
        choices=SPECULATION_METHODS,
        default=DEFAULT_SPECULATION_METHOD,
        help="auto: k and the drafter chosen per round from measured acceptance and cost; "
        "hybrid: n-gram lookup first, the draft model when it finds nothing",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"guesses per round (auto: the most; default {AUTO_NUM_TOKENS}, else {FIXED_NUM_TOKENS})",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument(
        "--huge-pages",
        action="store_true",
        help="stream the weights from 2 MB pages, as the services do: decoding is faster (1.22x for the "
        "1.5B on a 2-core Xeon), but faulting them in can cost seconds at start (6-13 s for the real "
        "pair on a VM that hands free memory back to its host), which one short generation never wins back",
    )
    _add_model_args(g)
    _add_kv_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="engine benchmark: baselines and specd side by side")
    _add_model_args(b)
    b.add_argument("--k", default=None, help="block sizes to sweep (default 1..8; --serve: 1..5)")
    b.add_argument("--max-tokens", type=int, default=96)
    b.add_argument("--temperatures", default=None, help="default 0,0.8 (--serve: 0)")
    b.add_argument(
        "--repeats", type=int, default=None, help="interleaved passes over all modes, summed (default 2; --serve 3)"
    )
    b.add_argument("--out", default="benchmarks/results")
    b.add_argument("--quick", action="store_true", help="two prompts, short outputs (smoke test)")
    b.add_argument(
        "--min-requests",
        type=int,
        default=24,
        help="--serve: requests per cell and pass, at least (each stream runs at least two)",
    )
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    b.add_argument("--no-llama-cpp", action="store_true", help="--pair: skip llama.cpp's llama-server")
    b.add_argument(
        "--no-quantized", action="store_true", help="--pair: skip the int8/int4 targets and the other draft weights"
    )
    b.add_argument(
        "--serve",
        action="store_true",
        help="benchmark the whole stack (gateway + target + draft processes) against the in-process engine",
    )
    b.add_argument(
        "--concurrency", default=None, help="--serve: streams to sweep (default 1,4,16); --soak: clients (default 64)"
    )
    b.add_argument(
        "--soak",
        action="store_true",
        help="mixed traffic against specd serve for --duration s: 5xx, lost/hung streams, memory growth, leaks",
    )
    b.add_argument(
        "--startup",
        action="store_true",
        help="cold starts of specd generate --pair (default qwen2.5-coder): seconds to the first token",
    )
    b.add_argument("--runs", type=int, default=5, help="--startup: cold starts after the first")
    b.add_argument("--duration", type=float, default=300.0, help="--soak: seconds of traffic")
    b.add_argument("--warmup", type=float, default=None, help="--soak: seconds before the memory baseline")
    b.add_argument("--workloads", default="code", help="--serve: code (completions), prose (chat), or both")
    b.add_argument(
        "--max-batch-size", type=int, default=None, help="--serve: the target's (default: the largest concurrency)"
    )
    b.add_argument("--no-auto", action="store_true", help="--serve: skip the auto method")
    b.add_argument(
        "--paired",
        action="store_true",
        help="auto against each fixed k (--k, default 2,3,4) request by request at batch 1, in-process: "
        "median paired speed ratios with 95%% intervals and an A/A control (--repeats rounds, default 8; "
        "--workloads code or prose; one --temperatures value)",
    )
    b.add_argument(
        "--ablations",
        action="store_true",
        help="--paired, greedy: also auto with its choices forced to the middle --k (its work still done) and "
        "the auto path with no controller: what auto's own work costs and what its choices are worth",
    )
    b.add_argument(
        "--draft-ahead",
        default="off",
        help="--serve: drafting in turn (off), ahead (on), or both side by side (off,on); default off",
    )
    b.add_argument(
        "--pin-cores",
        default="off",
        help="--serve: unpinned (off), draft + gateway and target on disjoint cores, one thread each (on), "
        "or both (off,on); default off",
    )
    b.add_argument("--pairs", default=None, help="--serve: one run per known pair, e.g. demo,qwen2.5-coder")
    _add_seeded_plans_arg(b)
    b.add_argument(
        "--seeded",
        action="store_true",
        help="--serve: every request carries a seed (sampled ones are then planned as seeded requests are)",
    )
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("draft", help="run the gRPC draft service")
    _add_service_args(d, 50051, None)
    d.add_argument("--max-sequences", type=int, default=64, help="KV cache slots (sequences held at once)")
    d.add_argument(
        "--proposal-support",
        type=int,
        default=128,
        help="sampled guesses come from q truncated to this many tokens (sent sparse; still lossless)",
    )
    _add_draft_quantize_arg(d, "--quantize")
    _add_prefix_caching_arg(d)
    _add_drain_arg(d)
    _add_tls_args(d, None)
    d.set_defaults(func=cmd_draft, model_default=str(DEMO_DRAFT))

    t = sub.add_parser("target", help="run the gRPC target (verification) service")
    _add_service_args(t, 50052, None)
    t.add_argument("--draft-address", default=None, help="HOST:PORT[,HOST:PORT...] of draft services")
    _add_capacity_args(t)
    t.add_argument(
        "--speculation-method",
        choices=SPECULATION_METHODS,
        default=None,
        help="default for requests that do not choose (default: auto, which uses the draft service if given)",
    )
    t.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"default guesses per round (auto: the most it may choose; default {AUTO_NUM_TOKENS} for auto, "
        f"{FIXED_NUM_TOKENS} otherwise)",
    )
    t.add_argument("--draft-timeout", type=float, default=2.0, help="seconds to wait for a draft round")
    _add_draft_ahead_arg(t)
    _add_prefix_caching_arg(t)
    _add_seeded_plans_arg(t)
    t.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the target over N processes (one per GPU: cuda:0..N-1 of CUDA_VISIBLE_DEVICES; gloo on CPU)",
    )
    _add_target_quantize_arg(t)
    _add_drain_arg(t)
    _add_tls_args(t, "drafts")
    t.set_defaults(func=cmd_target, model_default=str(DEMO_TARGET))

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    gw.add_argument("--target-address", required=True, help="HOST:PORT[,HOST:PORT...] of target services")
    gw.add_argument("--host", default="0.0.0.0")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    gw.add_argument("--served-model-name", default=None, help="default: the target's model name")
    gw.add_argument(
        "--request-timeout", type=float, default=600.0, help="deadline of one generation on the target (then 504)"
    )
    gw.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get 413")
    gw.add_argument("--retry-after", type=int, default=1, help="seconds, in the Retry-After of a 429 (targets full)")
    _add_drain_arg(gw)
    _add_tls_args(gw, "targets")
    gw.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (uvicorn's TLS)")
    gw.add_argument("--ssl-keyfile", default=None, help="the HTTPS certificate's PEM key")
    gw.add_argument("--ssl-ca-certs", default=None, help="HTTPS clients must present a certificate of this CA")
    gw.set_defaults(func=cmd_gateway)

    s = sub.add_parser("serve", help="run draft, target and gateway locally (demo models by default)")
    s.add_argument("--target", default=str(DEMO_TARGET), help="target model dir or hub id")
    s.add_argument("--draft", default=str(DEMO_DRAFT), help="draft model dir or hub id")
    _add_pair_arg(s)
    s.add_argument("--no-draft", action="store_true", help="no draft service (n-gram or no speculation only)")
    s.add_argument("--host", default="0.0.0.0", help="gateway bind address (the services bind 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--draft-port", type=int, default=50051)
    s.add_argument("--target-port", type=int, default=50052)
    s.add_argument("--draft-metrics-port", type=int, default=9101)
    s.add_argument("--target-metrics-port", type=int, default=9102)
    s.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=DEFAULT_DTYPE)
    s.add_argument("--draft-dtype", choices=sorted(DTYPE_NAMES), default=None, help="default: --dtype")
    s.add_argument("--draft-threads", type=int, default=None, help="draft torch threads (default: 1 on CPU)")
    _add_draft_quantize_arg(s)
    _add_target_quantize_arg(s)
    s.add_argument("--device", default="cpu")
    s.add_argument("--api-key", default=None)
    s.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"the target's default (auto: the most; default {AUTO_NUM_TOKENS})",
    )
    _add_capacity_args(s)
    _add_drain_arg(s)
    s.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output, in tokens (default: the model's own)"
    )
    _add_kv_args(s)
    _add_draft_ahead_arg(s)
    _add_prefix_caching_arg(s)
    _add_seeded_plans_arg(s)
    s.add_argument(
        "--pin-cores",
        nargs="?",
        const="auto",
        default=None,
        metavar="DRAFT:TARGET",
        help="run the draft (with the gateway) and the target on disjoint cores, as many threads as cores: "
        "alone, the first two usable cores, one each; or core lists, e.g. 0:1 or 0-1:2-7",
    )
    s.set_defaults(func=cmd_serve)
    m = sub.add_parser("models", help="fetch and list the known model pairs")
    msub = m.add_subparsers(dest="models_command", required=True)
    mf = msub.add_parser("fetch", help="download, verify and convert a pair into the cache (idempotent)")
    mf.add_argument("name", help="pair name, e.g. qwen2.5-coder")
    mf.add_argument("--dir", default=None, help="where the converted folders go (default: ~/.cache/specd/models)")
    mf.add_argument("--json", action="store_true", help='print one line: {"target": ..., "draft": ...}')
    mf.set_defaults(func=cmd_models_fetch)
    ml = msub.add_parser("list", help="the known pairs and which are present")
    ml.add_argument("--json", action="store_true")
    ml.set_defaults(func=cmd_models_list)

    from specd.services.ray_cluster.cli import add_parser as add_ray_parser

    add_ray_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        args.concurrency_given = args.concurrency is not None
        args.concurrency = args.concurrency or ("1,4" if args.serve and args.quick else "1,4,16")
        args.k_given = args.k is not None
        args.k = args.k or "1,2,3,4,5,6,7,8"
    if getattr(args, "model", "unset") is None:
        args.model = args.model_default
    # Before anything imports torch: libgomp reads its settings once, when it loads.
    from specd.services.common.runtime import configure_openmp

    configure_openmp()
    from specd.services.model_store.fetch import FetchError

    try:
        _apply_pair(args)
        return args.func(args)
    except FetchError as exc:  # offline, a missing part, a hash mismatch, a full disk
        parser.exit(1, f"specd {args.command}: error: {exc}\n")
    except (ValueError, OSError) as exc:  # bad arguments or models: a clear message, not a traceback
        parser.exit(2, f"specd {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
