"""Plot recorded dashboard query results into one PNG laid out like the Grafana dashboard.

    python deploy/grafana/render_dashboard.py RESULTS.json [-o deploy/grafana/dashboard.png]

RESULTS.json is what ``tests/deploy/test_prometheus_dashboard.py`` writes (to ``$SPECD_DASHBOARD_RESULTS``
when set): for every panel of ``deploy/grafana/dashboards/specd.json`` its title, grid position and
unit, and for every query the ``/api/v1/query_range`` series a real Prometheus returned. One subplot
per panel, at the panel's place on Grafana's 24-column grid. This is a plot of real query results,
not a Grafana screenshot, and the caption says so.

    SPECD_DASHBOARD_RESULTS=/tmp/results.json .venv/bin/python -m pytest -q tests/deploy/test_prometheus_dashboard.py
    .venv/bin/python deploy/grafana/render_dashboard.py /tmp/results.json -o deploy/grafana/dashboard.png

deploy/grafana/dashboard-results.json is the results file deploy/grafana/dashboard.png was rendered from.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from datetime import UTC, datetime
from pathlib import Path

GRID_COLUMNS = 24
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ("#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a")


def legend(fmt: str, metric: dict) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)


def scale_for(unit: str) -> tuple[float, str]:
    """Multiplier and axis label for a Grafana unit."""
    return {"s": (1000.0, "ms"), "percentunit": (100.0, "%")}.get(unit, (1.0, ""))


def render(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = results["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(22, rows * 0.5 + 1.6), facecolor=BACKGROUND)
    # Grafana's grid in figure fractions; each panel keeps room for its title above and ticks below.
    left, right, top, bottom = 0.03, 0.995, 0.95, 0.08
    cell_w, cell_h = (right - left) / GRID_COLUMNS, (top - bottom) / rows
    t0 = results.get("traffic_start", results["start"])
    for panel in panels:
        g = panel["gridPos"]
        x0 = left + g["x"] * cell_w + 0.018
        y0 = top - (g["y"] + g["h"]) * cell_h + 0.03
        ax = fig.add_axes((x0, y0, g["w"] * cell_w - 0.026, g["h"] * cell_h - 0.06))
        ax.set_facecolor(PANEL)
        ax.set_title(panel["title"], color=TEXT, fontsize=11, loc="left", fontweight="bold")
        ax.tick_params(colors=TEXT, labelsize=8)
        for side in ax.spines.values():
            side.set_color(GRID)
        ax.grid(color=GRID, linewidth=0.6)
        factor, unit_label = scale_for(panel.get("unit", ""))
        n = 0
        for target in panel["targets"]:
            for series in target["range"]:
                xs = [float(t) - t0 for t, _ in series["values"]]
                ys = [float(v) * factor for _, v in series["values"]]
                if not any(math.isfinite(y) for y in ys):
                    continue
                color = COLORS[n % len(COLORS)]
                ax.plot(xs, ys, color=color, linewidth=1.6, label=legend(target["legendFormat"], series["metric"]))
                n += 1
        if panel.get("min") is not None:
            ax.set_ylim(bottom=panel["min"] * factor, top=None if ax.get_ylim()[1] > panel["min"] * factor else 1)
        if unit_label:
            ax.set_ylabel(unit_label, color=TEXT, fontsize=8)
        ax.set_xlim(results["start"] - t0, results["end"] - t0)
        if g["y"] + g["h"] == rows:
            ax.set_xlabel("seconds from the start of the traffic", color=TEXT, fontsize=8)
        if n:
            ax.legend(fontsize=7, loc="best", facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, ncols=2 if n > 3 else 1)
        else:
            ax.text(0.5, 0.5, "no data", color=TEXT, transform=ax.transAxes, ha="center")
    traffic = results.get("traffic", {})
    fig.suptitle("specd: speculative decoding (deploy/grafana/dashboards/specd.json)", color=TEXT, fontsize=15, x=0.04,
                 ha="left")  # fmt: skip
    when = datetime.fromtimestamp(results["end"], UTC).strftime("%Y-%m-%d %H:%M UTC")
    rate_interval = results.get("grafana_variables", {}).get("$__rate_interval", "?")
    cpu = results.get("host", {})
    host = (
        f" on {cpu['cpu_cores']} CPU cores (1-min load average {cpu['load_average_1m_before']} before)" if cpu else ""
    )
    caption = (
        f"Rendered with matplotlib from real Prometheus {results.get('prometheus_version', '')} query_range results "
        f"recorded by {results.get('generated_by', 'a test run')} on {when}: a live `specd serve` (demo pair, CPU) "
        f"under {traffic.get('clients', '?')} streaming clients for {traffic.get('seconds', '?')} s "
        f"({traffic.get('requests', '?')} requests){host}, scraped every {results.get('scrape_interval', '?')}, "
        f"$__rate_interval = {rate_interval}. Not a Grafana screenshot."
    )
    fig.text(0.04, 0.02, caption, color=TEXT, fontsize=9, ha="left", wrap=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=BACKGROUND)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="JSON written by tests/deploy/test_prometheus_dashboard.py")
    parser.add_argument("-o", "--out", type=Path, default=Path(__file__).with_name("dashboard.png"))
    args = parser.parse_args(argv)
    render(json.loads(args.results.read_text()), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
