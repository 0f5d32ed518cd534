"""Every PromQL expression of the Grafana dashboard, evaluated by a real Prometheus against a live stack.

A live ``specd serve`` (draft, target, gateway on free ports) serves ~20 s of streaming chat
completions with speculation while a real Prometheus (Debian's ``prometheus`` package, installed by
``scripts/install_prometheus.sh`` from ``scripts/setup.sh dev``) scrapes the three metrics endpoints
every second with the job names of ``deploy/prometheus/prometheus.yml``. Then every expression in
``deploy/grafana/dashboards/specd.json`` goes through ``/api/v1/query`` and must return at least one
series with a finite value. The time series of every query (``/api/v1/query_range``) are saved as
JSON (to ``$SPECD_DASHBOARD_RESULTS`` too when set) and rendered with
``deploy/grafana/render_dashboard.py``, which is how ``deploy/grafana/dashboard.png`` was made.

A missing ``prometheus`` binary fails the test: the dashboard working against real data is an
acceptance criterion, not an optional extra.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from specd.services.common.ports import free_ports
from specd.services.common.process import specd_command, stop_process_group
from tests.deploy.files import (
    DEPLOY,
    GRAFANA_INTERVALS,
    HEALTHCHECK,
    PROMETHEUS_COMPOSE,
    REPO,
    dashboard_panels,
    load_dashboard,
    substitute_grafana_vars,
)
from tests.e2e.processes import children

pytestmark = pytest.mark.demo

TRAFFIC_SECONDS = 20.0
CLIENTS = 3
# Every chat opens with it, as a chat application's do, so the prefix cache panel has hits to show.
SYSTEM = (
    "You are a Python tutor. Answer in two or three sentences, name the module the function comes "
    "from, give one short example of a call and its result, and say what error a wrong argument raises."
)
PROMPTS = (
    "Explain `os.path.join`.",
    "Explain `json.dumps`.",
    "Explain `collections.Counter`.",
    "Explain `re.compile`.",
    "Explain `functools.partial`.",
    "Explain `itertools.chain`.",
)


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if path is None:
        pytest.fail(
            "the `prometheus` binary is missing: run `bash scripts/install_prometheus.sh` (Debian's `prometheus` "
            "package; `scripts/setup.sh dev` runs it). This test checks the dashboard against a real Prometheus "
            "and does not skip."
        )
    return path


def _is_specd_service(pid: int) -> bool:
    """Still running, and still the ``specd.services.cli`` process we started (not a reused pid)."""
    try:
        return b"specd.services.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait(what: str, ok, timeout: float, log: Path | None = None, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited\n{log.read_text()[-3000:] if log else ''}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout} s\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.2)


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def prometheus_config(gateway: int, target_metrics: int, draft_metrics: int) -> dict:
    """deploy/prometheus/prometheus.yml with its jobs pointed at the local ports, scraping every second."""
    cfg = yaml.safe_load(PROMETHEUS_COMPOSE.read_text())
    ports = {"gateway": gateway, "target": target_metrics, "draft": draft_metrics}
    jobs = []
    for job in cfg["scrape_configs"]:
        name = job["job_name"]
        jobs.append(
            {
                "job_name": name,
                "metrics_path": job.get("metrics_path", "/metrics"),
                "static_configs": [{"targets": [f"127.0.0.1:{ports.pop(name)}"]}],
            }
        )
    assert not ports, f"deploy/prometheus/prometheus.yml has no job for {sorted(ports)}"
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": jobs,
    }


def drive_traffic(url: str, seconds: float, clients: int) -> dict:
    """``clients`` threads streaming chat completions with speculation until ``seconds`` have passed."""
    stop_at = time.monotonic() + seconds
    counts = {"requests": 0, "chunks": 0, "errors": 0}
    lock = threading.Lock()

    def worker(i: int) -> None:
        n = 0
        with httpx.Client(base_url=url, timeout=60.0) as client:
            while time.monotonic() < stop_at:
                body = {
                    "model": "demo-target",
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]},
                    ],
                    "max_tokens": 48,
                    "temperature": 0.0 if n % 2 == 0 else 0.8,
                    "seed": 100 * i + n,
                    "stream": True,
                    # Half fixed k, half the auto controller (whose block-size panels need data).
                    "speculation": {"method": "draft", "num_tokens": 2 + (i + n) % 3}
                    if (i + n) % 2
                    else {"method": "auto"},
                }
                chunks = 0
                try:
                    with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                chunks += 1
                except httpx.HTTPError:
                    with lock:
                        counts["errors"] += 1
                    continue
                finally:
                    n += 1
                with lock:
                    counts["requests"] += 1
                    counts["chunks"] += chunks

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 120)
    return counts


def _api(prom: str, path: str, params: dict) -> dict:
    r = httpx.get(f"{prom}{path}", params=params, timeout=30.0)
    body = r.json()
    assert r.status_code == 200 and body.get("status") == "success", f"{params.get('query')}: {r.text[:500]}"
    return body["data"]


def _finite(result: list[dict], key: str) -> bool:
    if key == "value":
        return any(math.isfinite(float(s["value"][1])) for s in result)
    return any(math.isfinite(float(v)) for s in result for _, v in s["values"])


def test_dashboard_queries_return_data_from_a_live_stack(tmp_path: Path) -> None:
    prometheus = prometheus_binary()
    dashboard = load_dashboard()
    panels = dashboard_panels(dashboard)
    assert panels and all(t.get("expr") for p in panels for t in p["targets"])

    gw, dport, tport, dmetrics, tmetrics, prom_port, closed = free_ports(7)
    serve_log, prom_log = tmp_path / "serve.log", tmp_path / "prometheus.log"
    cfg_path = tmp_path / "prometheus.yml"
    cfg_path.write_text(yaml.safe_dump(prometheus_config(gw, tmetrics, dmetrics)))
    url, prom = f"http://127.0.0.1:{gw}", f"http://127.0.0.1:{prom_port}"

    serve = prom_proc = None
    kids: list[int] = []
    try:
        args = specd_command("serve", "--host", "127.0.0.1", "--port", str(gw))
        args += ["--draft-port", str(dport), "--target-port", str(tport)]
        args += ["--draft-metrics-port", str(dmetrics), "--target-metrics-port", str(tmetrics)]
        with open(serve_log, "wb") as f:
            serve = subprocess.Popen(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, process_group=0)
        with open(prom_log, "wb") as f:
            prom_proc = subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={cfg_path}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                cwd=tmp_path,
                stdout=f,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        _wait("prometheus", lambda: _http_ok(f"{prom}/-/ready"), 60, prom_log, prom_proc)
        _wait("specd serve", lambda: "specd is ready" in serve_log.read_text(), 180, serve_log, serve)
        kids = children(serve.pid)

        # The probe the compose healthchecks and the Kubernetes exec probes run, on the live services.
        for role, where in (
            ("draft", f"127.0.0.1:{dport}"),
            ("target", f"127.0.0.1:{tport}"),
            ("gateway", f"{url}/health"),
        ):
            rc = subprocess.run([sys.executable, str(HEALTHCHECK), role, where], cwd=REPO, capture_output=True)
            assert rc.returncode == 0, (role, rc.stderr.decode())
        down = subprocess.run([sys.executable, str(HEALTHCHECK), "draft", f"127.0.0.1:{closed}"], capture_output=True)
        assert down.returncode == 1, down.stderr.decode()

        def all_up() -> bool:
            targets = _api(prom, "/api/v1/targets", {})["activeTargets"]
            return len(targets) == 3 and all(t["health"] == "up" for t in targets)

        _wait("prometheus targets up", all_up, 30, prom_log, prom_proc)

        load = os.getloadavg()[0]
        t_start = time.time()
        counts = drive_traffic(url, TRAFFIC_SECONDS, CLIENTS)
        t_end = time.time()
        assert counts["requests"] >= 5 and counts["errors"] == 0, counts
        t_eval = t_end + 1.0
        time.sleep(max(0.0, t_eval + 2.5 - time.time()))  # the last scrapes are ingested

        results, failures = [], []
        for panel in panels:
            entry = {"title": panel["title"], "gridPos": panel["gridPos"], "targets": []}
            defaults = panel.get("fieldConfig", {}).get("defaults", {})
            entry |= {"unit": defaults.get("unit", ""), "min": defaults.get("min")}
            for t in panel["targets"]:
                query = substitute_grafana_vars(t["expr"])
                instant = _api(prom, "/api/v1/query", {"query": query, "time": t_eval})
                series = _api(
                    prom,
                    "/api/v1/query_range",
                    {"query": query, "start": t_start - 5, "end": t_eval, "step": 1},
                )
                if not instant["result"] or not _finite(instant["result"], "value"):
                    failures.append(f"{panel['title']} / {t['refId']}: {query} -> {instant['result']}")
                entry["targets"].append(
                    {
                        "refId": t["refId"],
                        "expr": t["expr"],
                        "query": query,
                        "legendFormat": t.get("legendFormat", ""),
                        "instant": instant["result"],
                        "range": series["result"],
                    }
                )
            results.append(entry)
        version = _api(prom, "/api/v1/status/buildinfo", {}).get("version", "")
    finally:
        if serve is not None:
            stop_process_group(serve, signal.SIGINT, grace=30)  # what Ctrl-C sends: stops gateway, target, draft
            for pid in kids:  # only a child that outlived the supervisor's own shutdown
                if _is_specd_service(pid):
                    os.killpg(pid, signal.SIGKILL)
        if prom_proc is not None:
            stop_process_group(prom_proc)

    out = {
        "generated_by": "tests/deploy/test_prometheus_dashboard.py",
        "dashboard": str(DEPLOY.relative_to(REPO) / "grafana" / "dashboards" / "specd.json"),
        "prometheus_version": version,
        "scrape_interval": "1s",
        "grafana_variables": GRAFANA_INTERVALS,
        "traffic": {"seconds": TRAFFIC_SECONDS, "clients": CLIENTS, **counts},
        "host": {"cpu_cores": os.cpu_count(), "load_average_1m_before": round(load, 2)},
        "traffic_start": t_start,
        "start": t_start - 5,
        "end": t_eval,
        "step": 1,
        "panels": results,
    }
    results_path = tmp_path / "dashboard_results.json"
    results_path.write_text(json.dumps(out, indent=1))
    if os.environ.get("SPECD_DASHBOARD_RESULTS"):
        Path(os.environ["SPECD_DASHBOARD_RESULTS"]).write_text(results_path.read_text())

    assert not failures, "dashboard queries without data:\n" + "\n".join(failures)
    hits = next(p for p in results if p["title"] == "Prefix cache hits")["targets"][0]["instant"]
    assert float(hits[0]["value"][1]) > 0, "every chat shares the system prompt: the prefix cache should serve some"

    png = tmp_path / "dashboard.png"
    render = subprocess.run(
        [sys.executable, str(DEPLOY / "grafana" / "render_dashboard.py"), str(results_path), "-o", str(png)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert render.returncode == 0, render.stderr
    assert png.stat().st_size > 20_000
