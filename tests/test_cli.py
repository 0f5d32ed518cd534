"""The ``specd`` command line, run as a real subprocess on the tiny pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _specd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


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
        "specd-draft", "specd-ngram", "specd-hybrid",
    }  # fmt: skip
    assert doc["best_draft"]["code/T=0.0"]["vs_hf_assisted"] > 0
    draft_rows = [r for r in doc["rows"] if r["mode"] == "specd-draft"]
    assert {r["k"] for r in draft_rows} == {1, 3}
    for r in draft_rows:
        assert {
            "acceptance_rate",
            "tokens_per_target_forward",
            "predicted_speedup",
            "speedup_vs_specd_target_only",
        } <= set(r)
    assert doc["costs_ms"]["c"] > 0
    assert (tmp_path / "engine_bench.png").stat().st_size > 10_000


def test_serve_bench_quick_runs_every_k_side_by_side(tiny_pair, tmp_path) -> None:
    """``bench --serve`` starts a real stack, sends every mode through it and through the engine,
    and reports each k against the same baseline (no timing is asserted)."""
    target, draft = tiny_pair
    res = _specd(
        "bench", "--serve", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--quick",
        "--k", "2,3", "--max-tokens", "8", "--out", str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "serve_bench.json").read_text())
    rows = {(r["concurrency"], r["k"]): r for r in doc["rows"]}
    assert set(rows) == {(c, k) for c in (1, 4) for k in (0, 2, 3)}
    for (_, k), r in rows.items():
        assert r["method"] == ("none" if k == 0 else "draft")
        assert r["tokens"] == 8 * r["requests"] and r["requests"] > 0  # every token came back
        assert (r["acceptance_rate"] is None) == (k == 0)
    c1 = doc["concurrency_1"]
    assert set(c1) == {"none", "draft k=2", "draft k=3"}
    for mode in ("draft k=2", "draft k=3"):
        assert c1[mode]["share_of_in_process_speedup_kept"] > 0
        assert len(c1[mode]["share_kept_per_pass"]) == 1
        assert c1[mode]["in_process_tokens_per_second"] > 0
    assert "| 1 | draft k=3 |" in res.stdout
