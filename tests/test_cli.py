"""The ``specd`` command line, run as a real subprocess on the tiny pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from specd.services.common.process import specd_command


def _specd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(specd_command(*args), capture_output=True, text=True, timeout=timeout, env=env)


def test_generate_json_output(tiny_pair) -> None:
    target, draft = tiny_pair
    common = ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--max-tokens", "12", "--json"]
    spec = _specd("generate", "--prompt", "def wrap(text):", *common, "--num-speculative-tokens", "3")
    assert spec.returncode == 0, spec.stderr
    doc = json.loads(spec.stdout)
    assert set(doc["stats"]) >= {
        "proposed_tokens",
        "accepted_tokens",
        "target_forward_passes",
        "acceptance_rate",
        "decode_seconds",
        "tokens_per_second",
    }
    assert len(doc["token_ids"]) == 12 and isinstance(doc["text"], str)
    assert doc["stats"]["proposed_tokens"] > 0
    base = json.loads(_specd("generate", "--prompt", "def wrap(text):", *common, "--method", "none").stdout)
    assert base["token_ids"] == doc["token_ids"]  # greedy: speculation changes nothing
    assert base["stats"]["proposed_tokens"] == 0


# `specd generate` in a fresh interpreter, then the huge-pages switch as the kernels will read it.
GENERATE_THEN_SWITCH = """
import os, sys
from specd.services.cli import main
assert main(sys.argv[1:]) == 0
print("switch:", os.environ.get("SPECD_HUGE_PAGES", "unset"))
"""


def test_generate_keeps_small_pages_unless_asked(tiny_pair) -> None:
    """One short generation never wins back the seconds huge pages can cost to fault in (on a VM
    that hands free memory back to its host), so `generate` turns them off unless --huge-pages."""
    target, draft = tiny_pair
    args = ["generate", "--prompt", "x", "--target", str(target), "--draft", str(draft), "--max-tokens", "2", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "SPECD_HUGE_PAGES"}
    for extra, switch in (([], "0"), (["--huge-pages"], "unset")):
        command = [sys.executable, "-c", GENERATE_THEN_SWITCH, *args, *extra]
        run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines()[-1] == f"switch: {switch}"


def test_generate_refuses_mismatched_draft(tiny_pair, micro_pair) -> None:
    res = _specd("generate", "--prompt", "x", "--target", str(tiny_pair[0]), "--draft", str(micro_pair[1]))
    assert res.returncode != 0 and "vocabulary" in res.stderr


def test_bench_quick_writes_json_and_png(tiny_pair, tmp_path) -> None:
    target, draft = tiny_pair
    res = _specd(
        "bench", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--quick",
        "--k", "1,3", "--max-tokens", "8", "--out", str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "engine_bench.json").read_text())
    modes = {r["mode"] for r in doc["rows"]}
    assert modes == {
        "specd-target-only", "hf-generate-bf16", "hf-assisted-bf16", "hf-generate-fp32", "hf-assisted-fp32",
        "specd-draft", "specd-ngram", "specd-hybrid", "specd-auto",
    }  # fmt: skip
    assert doc["best_draft"]["code/T=0.0"]["vs_hf_assisted"] > 0
    draft_rows = [r for r in doc["rows"] if r["mode"] == "specd-draft"]
    assert {r["k"] for r in draft_rows} == {1, 3}
    for r in draft_rows:
        assert {
            "acceptance_rate",
            "tokens_per_target_forward",
            "predicted_speedup",
            "oracle_speedup",
            "speedup_vs_specd_target_only",
        } <= set(r)
        assert r["oracle_speedup"] > 0
    auto = [r for r in doc["rows"] if r["mode"] == "specd-auto"]
    assert auto and all(r["k"] == 3 and 0 <= r["mean_k"] <= 3 for r in auto)
    assert doc["costs_ms"]["c"] > 0
    assert (tmp_path / "engine_bench.png").stat().st_size > 10_000


def test_bench_paired_compares_auto_with_each_fixed_k_request_by_request(tiny_pair, tmp_path) -> None:
    """``bench --paired``: every prompt runs in every mode each round, and auto is compared with each
    fixed k on those pairs (and the first fixed k with itself, the A/A control)."""
    target, draft = tiny_pair
    res = _specd(
        "bench", "--paired", "--target", str(target), "--draft", str(draft), "--dtype", "float32",
        "--k", "1,2", "--max-tokens", "8", "--repeats", "1", "--out", str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "paired_bench.json").read_text())
    assert [(r["a"], r["b"]) for r in doc["auto_vs_fixed"]] == [("auto k<=6", "draft k=1"), ("auto k<=6", "draft k=2")]
    assert (doc["control"]["a"], doc["control"]["b"]) == ("draft k=1 again", "draft k=1")
    assert doc["best_fixed"] in ("draft k=1", "draft k=2") and doc["auto_vs_best"]["b"] == doc["best_fixed"]
    for r in [*doc["auto_vs_fixed"], doc["control"]]:
        assert r["n"] == 6 and 0 < r["low"] <= r["median"] <= r["high"]  # 6 code prompts x 1 round
        assert r["verdict"] in ("faster", "as fast", "slower")
    assert all(len(v) == 6 and min(v) > 0 for v in doc["per_request_speed"].values())
    assert "auto against the best fixed k" in res.stdout


def test_bench_paired_ablations_split_auto_s_work_from_its_choices(tiny_pair, tmp_path) -> None:
    """``bench --paired --ablations``: auto with its choices forced to the middle k and the auto path
    without a controller run beside the rest and are compared with that fixed k."""
    target, draft = tiny_pair
    res = _specd(
        "bench", "--paired", "--ablations", "--target", str(target), "--draft", str(draft), "--dtype", "float32",
        "--k", "1,2,3", "--max-tokens", "8", "--repeats", "1", "--out", str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "paired_bench.json").read_text())
    assert [(r["a"], r["b"]) for r in doc["ablations"]] == [
        ("auto, choices = k=2", "draft k=2"),
        ("auto path, no controller, k=2", "draft k=2"),
        ("auto k<=6", "auto, choices = k=2"),
    ]
    for r in doc["ablations"]:
        assert r["n"] == 6 and 0 < r["low"] <= r["median"] <= r["high"]


def test_ablation_controllers_force_the_draft_at_k_with_and_without_the_work() -> None:
    from specd.benchmarks.paired_bench import ForcedChoiceController, SkippedController
    from specd.services.engine.controller import MODEL, RowPlan, SeqAcceptance

    forced, skipped = ForcedChoiceController(3), SkippedController(3)
    for ctl in (forced, skipped):
        for cap in (6, 2):
            choice = ctl.plan_one(SeqAcceptance(6), True, cap, True, 10, lambda: 6)
            assert (choice.width, choice.model_steps, int(choice.drafters[0])) == (min(3, cap), min(3, cap), MODEL)
        choice = ctl.plan([RowPlan(SeqAcceptance(6), False, 6, 0, True, deterministic=True)], 6)
        assert choice.ks.tolist() == [3] and choice.drafters.tolist() == [MODEL]
    assert forced.stats.rounds == 3 and skipped.stats.rounds == 0  # the forced one still planned


def test_paired_interval_and_verdict() -> None:
    from specd.benchmarks.paired_bench import paired_interval, verdict

    assert paired_interval([1.1] * 20, 500, 0) == (1.1, 1.1, 1.1)
    med, low, high = paired_interval([0.9, 1.0, 1.1, 1.2, 0.95, 1.05, 1.0, 0.98], 2000, 0)
    assert low <= med <= high and low < 1.0 < high
    assert (verdict(1.01, 1.2), verdict(0.9, 1.0), verdict(0.8, 0.99)) == ("faster", "as fast", "slower")


def test_serve_bench_reports_the_median_pass_so_one_disturbed_pass_moves_it_little() -> None:
    from specd.benchmarks.serve_bench import LoadResult, _merge

    total = LoadResult("code", 0.0, 1, ("none", 0), tokens=640, pass_rates=[640 / 2.0])
    for tokens, wall in ((640, 10.0), (640, 2.1)):  # a pass slowed 5x by another job, then a normal one
        _merge(total, LoadResult("code", 0.0, 1, ("none", 0), tokens=tokens, pass_rates=[tokens / wall]))
    assert total.tokens == 1920 and total.pass_rates == [320.0, 64.0, 640 / 2.1]
    assert total.tokens_per_second == 640 / 2.1  # the aggregate would be 1920 / 14.1 = 136


def test_serve_bench_runs_none_and_auto_back_to_back_in_every_pass() -> None:
    """The criterion's ratio is auto over none: the two run next to each other in every pass, and
    every mode runs once per pass, in reverse order every other pass."""
    from specd.benchmarks.serve_bench import ServeBenchConfig

    cfg = ServeBenchConfig(target="t", draft="d", ks=(1, 2, 3))
    first, second = cfg.pass_order(0), cfg.pass_order(1)
    assert first == (("none", 0), ("auto", 3), ("draft", 1), ("draft", 2), ("draft", 3))
    assert second == first[::-1] and cfg.pass_order(2) == first
    assert sorted(first) == sorted(cfg.modes)
    plain = ServeBenchConfig(target="t", draft="d", ks=(2, 4), auto=False)
    assert plain.pass_order(0) == (("none", 0), ("draft", 2), ("draft", 4)) == plain.modes


def test_serve_bench_judges_each_bar_from_the_paired_passes() -> None:
    """met: the interval of the median paired ratio lies above the bar; within noise: it reaches
    the bar; not met: it lies below."""
    from specd.benchmarks.serve_bench import judged

    assert judged([1.02, 0.99, 1.05, 1.01, 0.98, 1.03], 0.97)["verdict"] == "met"
    assert judged([0.90, 0.93, 0.92, 0.91, 0.94, 0.92], 0.97)["verdict"] == "not met"
    noisy = judged([0.85, 1.10, 0.92, 1.04, 0.96, 1.01], 0.97)
    assert noisy["verdict"] == "within noise" and noisy["low"] < 0.97 <= noisy["high"]
    one = judged([0.96], 0.95)  # one pass: the interval is that pass
    assert (one["median"], one["low"], one["high"], one["verdict"]) == (0.96, 0.96, 0.96, "met")


def test_serve_bench_sends_seeds_only_when_asked() -> None:
    """--seeded: every request carries its own seed (the gateway's "seed"); otherwise none."""
    from specd.benchmarks.serve_bench import ServeBenchConfig, _body

    mode = ("auto", 4)
    _, plain = _body("code", "def f():", mode, 0.8, ServeBenchConfig(target="t", draft="d"), seed=5)
    path, seeded = _body("prose", "Hi", mode, 0.8, ServeBenchConfig(target="t", draft="d", seeded=True), seed=5)
    assert "seed" not in plain and seeded["seed"] == 5 and path == "/v1/chat/completions"
    assert {k: v for k, v in seeded.items() if k not in ("seed", "messages")} == {
        k: v for k, v in plain.items() if k != "prompt"
    }


def test_seeded_plans_reach_the_target_from_serve() -> None:
    """`specd serve --seeded-plans measured` starts its target with it; pinned is the default."""
    from specd.services.cli import build_parser
    from specd.services.serve import ServeConfig, _commands

    def target_cmd(cfg: ServeConfig) -> list[str]:
        return dict(_commands(cfg))["target"]

    measured = target_cmd(ServeConfig(target="t", draft="d", pin_seeded=False))
    assert measured[measured.index("--seeded-plans") + 1] == "measured"
    pinned = target_cmd(ServeConfig(target="t", draft="d"))
    assert pinned[pinned.index("--seeded-plans") + 1] == "pinned"
    parser = build_parser()
    assert parser.parse_args(["target", "--model", "m"]).seeded_plans == "pinned"
    assert parser.parse_args(["target", "--model", "m", "--seeded-plans", "measured"]).seeded_plans == "measured"


def test_serve_bench_runs_enough_requests_per_cell_for_every_stream() -> None:
    from specd.benchmarks.serve_bench import ServeBenchConfig, requests_per_stream

    cfg = ServeBenchConfig(target="t", draft="d", min_requests=24)
    # At least 24 requests a cell, and every stream runs at least two (its first one pays the start).
    assert [requests_per_stream(cfg, c, 6) for c in (1, 4, 16, 32, 64)] == [24, 6, 2, 2, 2]
    assert requests_per_stream(ServeBenchConfig(target="t", draft="d", min_requests=10), 4, 6) == 3
    quick = ServeBenchConfig(target="t", draft="d", quick=True)
    assert [requests_per_stream(quick, c, 2) for c in (1, 2, 4)] == [2, 1, 2]


def test_serve_bench_quick_runs_every_k_side_by_side(tiny_pair, tmp_path) -> None:
    """``bench --serve`` starts a real stack, sends every mode (none, fixed k, auto) through it and
    through the engine, and reports each against the same baseline (no timing is asserted)."""
    target, draft = tiny_pair
    res = _specd(
        "bench", "--serve", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--quick",
        "--k", "2,3", "--max-tokens", "8", "--out", str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "serve_bench.json").read_text())
    modes = ("none", "draft k=2", "draft k=3", "auto k<=3")
    rows = {(r["concurrency"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {(c, m) for c in (1, 4) for m in modes}
    for (_, mode), r in rows.items():
        assert r["method"] == mode.split()[0]
        assert r["tokens"] == 8 * r["requests"] and r["requests"] > 0  # every token came back
        assert (r["acceptance_rate"] is None) == (mode == "none") or r["method"] == "auto"
        assert 0 <= r["mean_k"] <= 3 and (r["mean_k"] == 0) == (mode == "none") or r["method"] == "auto"
        assert r["tokens_per_second_per_pass"] == [r["tokens_per_second"]]  # --quick: one pass
    c1 = doc["concurrency_1"]
    assert set(c1) == set(modes)
    for mode in modes[1:]:
        assert c1[mode]["share_of_in_process_speedup_kept"] > 0
        assert len(c1[mode]["share_kept_per_pass"]) == 1
        assert c1[mode]["in_process_tokens_per_second"] > 0
    verdicts = doc["auto_vs_others"]
    assert [v["concurrency"] for v in verdicts] == [1, 4] and all(v["auto_vs_best"] > 0 for v in verdicts)
    for v in verdicts:  # one pass: its paired ratio is the cell's
        assert v["auto_vs_best_per_pass"] == [v["auto_vs_best"]] and v["auto_vs_none_per_pass"] == [v["auto_vs_none"]]
        assert v["auto_vs_none_judged"]["median"] == v["auto_vs_none"] and v["auto_vs_none_judged"]["bar"] == 0.97
        assert v["auto_vs_best_judged"]["verdict"] == ("met" if v["auto_vs_best"] >= 0.95 else "not met")
    assert "| code | 0 | 1 | draft k=3 |" in res.stdout and "auto / best" in res.stdout
    # Drafting in turn: every block counted over the measured loads was drafted fresh.
    assert doc["block_shares"] == {"unpinned, in turn": {"prepared": 0.0, "offered": 0.0}}
    assert (tmp_path / "serve_bench.png").stat().st_size > 10_000


def test_serve_bench_counts_a_cell_s_blocks_over_its_own_loads_only() -> None:
    """The shares of prepared and offered blocks come from the target's counters read before and
    after each measured load and summed per cell and per stack, so the warm-up (two streams, never
    offered a block) and other cells do not dilute a cell's figure."""
    from specd.benchmarks.serve_bench import LoadResult, _blocks, _merge, block_shares

    def load(blocks: dict[str, float]) -> LoadResult:
        return LoadResult("code", 0.0, 1, ("draft", 4), tokens=96, pass_rates=[100.0], blocks=blocks)

    c1 = load({"fresh": 3.0, "offered": 6.0, "prepared": 1.0})
    _merge(c1, load({"fresh": 1.0, "offered": 8.0, "continued": 1.0}))
    assert c1.blocks == {"fresh": 4.0, "offered": 14.0, "prepared": 1.0, "continued": 1.0}
    assert block_shares(c1.blocks) == {"prepared": 0.8, "offered": 0.7}
    assert block_shares({}) is None and block_shares({"fresh": 0.0}) is None
    c16 = load({"fresh": 10.0, "prepared": 10.0})
    results = {
        ("pinned", True, "code", 0.0, 1, ("draft", 4)): c1,
        ("pinned", True, "code", 0.0, 16, ("draft", 4)): c16,
        ("pinned", False, "code", 0.0, 1, ("draft", 4)): load({"fresh": 30.0}),
    }
    assert _blocks(results, "pinned", True) == {"fresh": 14.0, "offered": 14.0, "prepared": 11.0, "continued": 1.0}
    assert block_shares(_blocks(results, "pinned", False)) == {"prepared": 0.0, "offered": 0.0}


def test_bench_paired_refuses_what_it_cannot_compare() -> None:
    """One workload of the prompt sets, one temperature, k of at least 1: else a clear error."""
    import pytest

    from specd.benchmarks.paired_bench import PairedBenchConfig
    from specd.services.cli import _one_temperature

    with pytest.raises(ValueError, match="code or prose"):
        PairedBenchConfig("t", "d", workload="both")
    with pytest.raises(ValueError, match="1 or more"):
        PairedBenchConfig("t", "d", ks=(0, 2))
    with pytest.raises(ValueError, match="one --temperatures value"):
        _one_temperature("0,0.8")
    assert _one_temperature(None) == 0.0 and _one_temperature("0.8") == 0.8


def test_options_are_taken_only_by_their_whole_names(tiny_pair) -> None:
    """`--k 4` is not an option of `generate`: it fails with a usage error instead of being read as a
    prefix of `--kv-cache-memory` (which it was, a 4-byte KV budget and 8 tokens out of 256)."""
    import pytest

    from specd.services.cli import build_parser

    target, draft = tiny_pair
    r = _specd("generate", "--target", target, "--draft", draft, "--prompt", "x", "--k", "4", timeout=120)
    assert r.returncode == 2
    assert "unrecognized arguments: --k" in r.stderr
    parser = build_parser()
    for argv in (["serve", "--max-batch", "8"], ["ray", "up", "--draft-rep", "2"], ["models", "fetch", "demo", "--j"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert parser.parse_args(["serve", "--max-batch-size", "8"]).max_batch_size == 8
