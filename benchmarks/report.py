"""Render ``engine_bench.json`` as Markdown tables (for the README).

python -m specd.benchmarks.report benchmarks/results/engine_bench.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _best(rows: list[dict], mode: str) -> dict | None:
    cands = [r for r in rows if r["mode"] == mode]
    return max(cands, key=lambda r: r["tokens_per_second"], default=None)


def summary_table(doc: dict) -> str:
    """One line per (prompt set, temperature): every mode at its best k."""
    out = [
        "| prompts | T | specd target-only | hf generate | hf assisted | specd draft (best k) | specd n-gram"
        " | specd hybrid | specd auto |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    temps = sorted({r["temperature"] for r in doc["rows"]})
    for category in ("code", "prose"):
        for t in temps:
            rows = [r for r in doc["rows"] if r["category"] == category and r["temperature"] == t]
            if not rows:
                continue
            base = _best(rows, "specd-target-only")
            hf_gen = max((r for r in rows if r["mode"].startswith("hf-generate")), key=lambda r: r["tokens_per_second"])
            hf_ass = max((r for r in rows if r["mode"].startswith("hf-assisted")), key=lambda r: r["tokens_per_second"])

            def cell(r: dict | None) -> str:
                if r is None:
                    return "-"
                k = f" k={r['k']}" if r["k"] else ""
                return f"{r['tokens_per_second']:.0f} tok/s (x{r['speedup_vs_specd_target_only']:.2f}){k}"

            out.append(
                f"| {category} | {t} | {cell(base)} | {cell(hf_gen)} {hf_gen['mode'][-4:]} | "
                f"{cell(hf_ass)} {hf_ass['mode'][-4:]} | {cell(_best(rows, 'specd-draft'))} | "
                f"{cell(_best(rows, 'specd-ngram'))} | {cell(_best(rows, 'specd-hybrid'))} | "
                f"{cell(_best(rows, 'specd-auto'))} |"
            )
    return "\n".join(out)


def sweep_table(doc: dict, mode: str = "specd-draft") -> str:
    """Every k for one mode: measured against predicted and against the oracle bound."""
    out = [
        "| prompts | T | k | tok/s | speed-up | acceptance | a (per token) | tokens/forward"
        " | predicted tokens/forward | Leviathan speed-up | with measured verify cost | oracle bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if r["mode"] != mode:
            continue
        out.append(
            f"| {r['category']} | {r['temperature']} | {r['k']} | {r['tokens_per_second']:.0f} | "
            f"x{r['speedup_vs_specd_target_only']:.2f} | {r['acceptance_rate']:.2f} | {r['alpha_hat']:.2f} | "
            f"{r['tokens_per_target_forward']:.2f} | {r['predicted_tokens_per_forward']:.2f} | "
            f"x{r['predicted_speedup']:.2f} | {_opt(r.get('predicted_speedup_measured_costs'))} | "
            f"{_opt(r.get('oracle_speedup'))} |"
        )
    return "\n".join(out)


def _opt(x: float | None) -> str:
    return f"x{x:.2f}" if x is not None else "-"


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or ["benchmarks/results/engine_bench.json"])[0])
    doc = json.loads(path.read_text())
    costs = doc["costs_ms"]
    print(
        f"Costs (median ms per forward at 200 tokens of context): draft 1 token {costs['draft_1']:.2f}, "
        f"target 1 token {costs['target_1']:.2f}, c = {costs['c']:.3f}\n"
    )
    print(summary_table(doc))
    print()
    print(sweep_table(doc))
    print()
    if any(r["mode"] == "specd-auto" for r in doc["rows"]):
        print(sweep_table(doc, "specd-auto"))
        print()
    for key, best in doc["best_draft"].items():
        print(
            f"- {key}: best k={best['best_k']}, x{best['speedup_vs_specd_target_only']:.2f} vs target-only, "
            f"x{best['vs_hf_assisted']:.2f} vs {best['hf_assisted_mode']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
