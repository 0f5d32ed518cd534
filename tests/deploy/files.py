"""Paths of the deployment files and small loaders shared by the deploy tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "compose" / "docker-compose.gpu.yml"
COMPOSE_MTLS = DEPLOY / "compose" / "docker-compose.mtls.yml"
DOCKERFILES = (REPO / "Dockerfile", DEPLOY / "docker" / "Dockerfile.cuda")
PROMETHEUS_COMPOSE = DEPLOY / "prometheus" / "prometheus.yml"
PROMETHEUS_K8S = DEPLOY / "prometheus" / "prometheus-k8s.yml"
ADAPTER_VALUES = DEPLOY / "prometheus" / "adapter-values.yaml"
K8S = DEPLOY / "k8s"
K8S_MTLS = DEPLOY / "k8s-mtls"  # a kustomize overlay of K8S (it cannot live inside it)
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specd.json"
HEALTHCHECK = DEPLOY / "healthcheck.py"

# Grafana's interval variables, and what the tests substitute for them (Prometheus scrapes every
# second in the dashboard test, so 10 s holds ten samples).
GRAFANA_INTERVALS = {"$__rate_interval": "10s", "$__interval": "1s", "$__range": "1m"}


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel that has queries, rows' nested panels included, in dashboard order."""
    out = []
    for p in dashboard["panels"]:
        if p.get("type") == "row":
            out += [c for c in p.get("panels", []) if c.get("targets")]
        elif p.get("targets"):
            out.append(p)
    return out


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def substitute_grafana_vars(expr: str) -> str:
    """The PromQL Prometheus itself would receive from Grafana; raises on a variable it cannot fill."""
    for name, value in sorted(GRAFANA_INTERVALS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    left = re.findall(r"\$\{?\w+", expr)
    if left:
        raise ValueError(f"unknown Grafana variables {left} in {expr!r}")
    return expr


def parse_specd_args(args: list[str]):
    """``args`` parsed by the real ``specd`` argument parser; fails the test with the reason if rejected."""
    import contextlib
    import io

    import pytest

    from specd.services.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"`specd {' '.join(args)}` is rejected by specd.services.cli:\n{err.getvalue()}")


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def defined_metrics() -> dict[str, tuple[str, ...]]:
    """Every sample name the services export, with its label names (the metric modules' collectors)."""
    from prometheus_client.metrics import MetricWrapperBase

    import specd.gateway.metrics
    import specd.services.draft.metrics
    import specd.services.target.metrics

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    out: dict[str, tuple[str, ...]] = {}
    for module in (specd.services.target.metrics, specd.services.draft.metrics, specd.gateway.metrics):
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase):
                for suffix in suffixes[value._type]:
                    labels = value._labelnames + (("le",) if suffix == "_bucket" else ())
                    out[value._name + suffix] = labels
    return out
