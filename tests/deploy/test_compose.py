"""docker-compose.yml, its GPU override and the Dockerfiles: valid, consistent with the repo and the CLI.

The Compose files are validated against the Compose Specification's JSON schema as vendored by the
``check-jsonschema`` package (``check_jsonschema/builtin_schemas/vendor/compose-spec.json``, from
github.com/compose-spec/compose-spec; a dev dependency), so no network is needed. No Docker engine
is needed either: what ``docker compose up`` would do is checked file by file.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import jsonschema
import pytest

from tests.deploy.files import (
    COMPOSE,
    COMPOSE_GPU,
    COMPOSE_MTLS,
    DASHBOARD,
    DOCKERFILES,
    PROMETHEUS_COMPOSE,
    PROMETHEUS_K8S,
    REPO,
    defined_metrics,
    host_port,
    load_dashboard,
    load_yaml,
    parse_specd_args,
)

SPECD_SERVICES = ("draft", "target", "gateway")


def compose_schema() -> dict:
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())


def validation_errors(document: dict) -> list[str]:
    schema = compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def command(service: dict) -> list[str]:
    cmd = service["command"]
    assert isinstance(cmd, list), "use the exec form: no shell in between, signals reach specd"
    return [str(c) for c in cmd]


def flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} missing from {cmd}"
    return cmd[cmd.index(name) + 1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return load_yaml(COMPOSE_GPU)


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU, COMPOSE_MTLS], ids=lambda p: p.name)
def test_compose_files_follow_the_compose_specification(path: Path) -> None:
    assert validation_errors(load_yaml(path)) == []


def test_the_schema_check_catches_mistakes(compose: dict) -> None:
    """The validation above is not vacuous: a misspelt key and a wrong type are both reported."""
    bad = copy.deepcopy(compose)
    bad["services"]["draft"]["replcas"] = 3
    bad["services"]["target"]["healthcheck"]["test"] = {"cmd": "python"}
    errors = validation_errors(bad)
    assert any("replcas" in e for e in errors) and any("healthcheck/test" in e for e in errors), errors


def test_the_stack_is_gateway_target_draft_prometheus_grafana(compose: dict) -> None:
    assert set(compose["services"]) == {"gateway", "target", "draft", "prometheus", "grafana"}
    assert compose["services"]["gateway"]["ports"] == ["8000:8000"]
    assert compose["services"]["grafana"]["ports"] == ["3000:3000"]


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_build_contexts_and_dockerfiles_exist(path: Path) -> None:
    # With several -f files, every relative path resolves against the first file's folder: the repo root.
    services = load_yaml(path)["services"]
    builds = [s["build"] for s in services.values() if "build" in s]
    assert builds
    for build in builds:
        context = REPO / build["context"]
        assert context.is_dir(), build
        assert (context / build.get("dockerfile", "Dockerfile")).is_file(), build


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(p, pat.rstrip("/")) for p in prefixes for pat in patterns if not pat.startswith("!"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    patterns = _dockerignore()
    copies = [rest.split() for op, rest in _instructions(dockerfile) if op in ("COPY", "ADD")]
    assert copies
    for args in copies:
        args = [a for a in args if not a.startswith("--")]
        for src in args[:-1]:
            assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src}: not in the repository"
            assert not _ignored(src.rstrip("/"), patterns), (
                f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"
            )


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = _dockerignore()
    for path in (".venv", ".git", "specd", "models/.work", ".pytest_cache", "services/__pycache__"):
        assert _ignored(path, patterns), path


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_torch_then_the_specd_package(dockerfile: Path) -> None:
    runs = [rest for op, rest in _instructions(dockerfile) if op == "RUN"]
    order = [
        next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r and "--index-url" in r),
        # The package from the bind-mounted build context: its build generates the stubs (setup.py).
        next(i for i, r in enumerate(runs) if re.search(r"--mount=type=bind,target=/src,rw pip install /src$", r)),
    ]
    assert order == sorted(order), runs
    # Installed like any package: nothing is imported from a source copy.
    envs = " ".join(rest for op, rest in _instructions(dockerfile) if op == "ENV")
    assert "PYTHONPATH" not in envs
    copied = [rest.split()[0] for op, rest in _instructions(dockerfile) if op == "COPY"]
    assert copied == ["deploy/healthcheck.py"], copied
    args = dict(rest.split("=", 1) for op, rest in _instructions(dockerfile) if op == "ARG" and "=" in rest)
    assert args["TORCH_VERSION"] == "2.13.0"
    if dockerfile.name == "Dockerfile":
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
        assert _instructions(dockerfile)[0] == ("FROM", "python:3.11-slim")
    else:
        assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert ("ENTRYPOINT", '["specd"]') in _instructions(dockerfile)


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU, COMPOSE_MTLS], ids=lambda p: p.name)
def test_every_command_is_accepted_by_the_specd_cli(path: Path) -> None:
    services = load_yaml(path)["services"]
    for name in SPECD_SERVICES:
        if "command" not in services[name]:
            continue
        cmd = command(services[name])
        assert cmd[0] == name
        args = parse_specd_args(cmd)
        if name != "gateway":  # the demo pair installed with the package (no path into a source tree)
            assert args.model is None and args.pair == "demo", cmd


def test_services_are_addressed_by_name_so_drafts_and_targets_scale(compose: dict) -> None:
    services = compose["services"]
    for name in ("draft", "target"):
        service = services[name]
        assert "container_name" not in service, f"{name}: a fixed container_name stops --scale"
        assert "ports" not in service, f"{name}: a host port stops --scale (use expose)"
        for net in (service.get("networks") or {}).values() if isinstance(service.get("networks"), dict) else []:
            assert not (net or {}).get("ipv4_address"), f"{name}: fixed address"
    draft_port = flag(command(services["draft"]), "--port")
    target_port = flag(command(services["target"]), "--port")
    assert host_port(flag(command(services["target"]), "--draft-address")) == ("draft", int(draft_port))
    assert host_port(flag(command(services["gateway"]), "--target-address")) == ("target", int(target_port))
    for name in ("draft", "target"):
        assert flag(command(services[name]), "--host") == "0.0.0.0"
    assert services["target"]["depends_on"]["draft"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["target"]["condition"] == "service_healthy"


def test_healthchecks_probe_each_service_on_its_port(compose: dict) -> None:
    for name in SPECD_SERVICES:
        service = compose["services"][name]
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/app/deploy/healthcheck.py"] and test[3] == name, test
        port = int(flag(command(service), "--port"))
        assert test[4].startswith("http://127.0.0.1:" if name == "gateway" else "127.0.0.1:")
        assert f":{port}" in test[4]
    for dockerfile in DOCKERFILES:
        assert "COPY deploy/healthcheck.py deploy/healthcheck.py" in dockerfile.read_text()


def test_gpu_override_reserves_an_nvidia_gpu_for_draft_and_target(gpu: dict) -> None:
    for name in ("draft", "target"):
        service = gpu["services"][name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), devices
        assert flag(command(service), "--device") == "cuda"
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
        assert "container_name" not in service and "ports" not in service
    assert "deploy" not in gpu["services"]["gateway"]
    target = command(gpu["services"]["target"])
    assert host_port(flag(target, "--draft-address"))[0] == "draft"


def test_prometheus_scrapes_every_replica_by_dns(compose: dict) -> None:
    cfg = load_yaml(PROMETHEUS_COMPOSE)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == set(SPECD_SERVICES)
    for name in ("draft", "target"):
        metrics_port = int(flag(command(compose["services"][name]), "--metrics-port"))
        (sd,) = jobs[name]["dns_sd_configs"]
        assert sd == {"names": [name], "type": "A", "port": metrics_port, "refresh_interval": sd["refresh_interval"]}
    gateway_port = flag(command(compose["services"]["gateway"]), "--port")
    assert jobs["gateway"]["static_configs"] == [{"targets": [f"gateway:{gateway_port}"]}]
    mounts = compose["services"]["prometheus"]["volumes"]
    assert f"./{PROMETHEUS_COMPOSE.relative_to(REPO)}:/etc/prometheus/prometheus.yml:ro" in mounts


def test_promtool_accepts_the_compose_prometheus_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing (Debian's prometheus package; test_prometheus_dashboard fails without it)")
    out = subprocess.run([promtool, "check", "config", str(PROMETHEUS_COMPOSE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kubernetes_prometheus_relabelling_points_at_the_annotated_port() -> None:
    """deploy/prometheus/prometheus-k8s.yml (Debian's promtool is built without Kubernetes discovery, so
    its relabel rules are applied here by hand to a pod target, the way Prometheus does: anchored regexes)."""
    (job,) = load_yaml(PROMETHEUS_K8S)["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    labels = {
        "__address__": "10.1.2.3:50051",
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
        "__meta_kubernetes_pod_annotation_prometheus_io_port": "9101",
        "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
        "__meta_kubernetes_pod_label_app_kubernetes_io_component": "draft",
        "__meta_kubernetes_namespace": "specd",
        "__meta_kubernetes_pod_name": "draft-abc",
    }
    for rule in job["relabel_configs"]:
        value = ";".join(labels.get(s, "") for s in rule["source_labels"])
        m = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule.get("action", "replace") == "keep":
            assert m, rule
        elif m:
            labels[rule["target_label"]] = m.expand(rule.get("replacement", "$1").replace("$", "\\"))
    assert labels["__address__"] == "10.1.2.3:9101"
    assert (labels["job"], labels["namespace"], labels["pod"]) == ("draft", "specd", "draft-abc")


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(compose: dict) -> None:
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith("./"))
    for src in mounts:
        assert (REPO / src).exists(), src
    by_target = {dst: REPO / src for src, dst in mounts.items()}
    provisioning = by_target["/etc/grafana/provisioning"]
    (ds,) = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["uid"] == "prometheus"
    (provider,) = load_yaml(provisioning / "dashboards" / "specd.yml")["providers"]
    dashboards_dir = by_target[provider["options"]["path"]]
    assert (dashboards_dir / DASHBOARD.name).is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards_dir / Path(home).relative_to(provider["options"]["path"])).is_file()


def test_dashboard_queries_use_metrics_and_labels_the_services_export() -> None:
    exported = defined_metrics()
    target_labels = {"instance", "job", "le"}
    dashboard = load_dashboard()
    panels = [p for p in dashboard["panels"] if p.get("targets")]
    titles = {p["title"] for p in panels}
    for wanted in ("Acceptance rate", "Acceptance by position", "Mean accepted length", "Time between tokens",
                   "Time to first token", "Throughput", "Requests running", "Batch size", "Draft latency",
                   "Verify latency", "Draft failures"):  # fmt: skip
        assert wanted in titles
    for panel in panels:
        for t in panel["targets"]:
            names = set(re.findall(r"\bspecd_\w+", t["expr"]))
            assert names or re.match(r"sum by \(job\) \(up\{", t["expr"]), t["expr"]
            for name in names:
                assert name in exported, f"{panel['title']}: {name} is not exported by any specd service"
            labels = set(re.findall(r"by \(([^)]*)\)", t["expr"]))
            used = {x.strip() for group in labels for x in group.split(",") if x.strip()}
            used |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            allowed = target_labels.union(*(exported[n] for n in names))
            assert used <= allowed, f"{panel['title']}: labels {used - allowed} do not exist on {names}"
            assert t["datasource"]["uid"] == "${datasource}"


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)s", duration)
    assert m, f"write grace periods in seconds: {duration!r}"
    return float(m.group(1))


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU, COMPOSE_MTLS], ids=lambda p: p.name)
def test_compose_waits_longer_than_each_service_drains(path: Path, compose: dict) -> None:
    """SIGTERM drains for --drain-timeout; compose must not SIGKILL before that (plus room to exit)."""
    grace = _seconds(compose["x-specd"]["stop_grace_period"])
    for name, service in load_yaml(path)["services"].items():
        if name not in SPECD_SERVICES or "command" not in service:
            continue
        drain = parse_specd_args(command(service)).drain_timeout
        assert flag(command(service), "--drain-timeout")  # stated, so the two numbers are read together
        assert grace >= drain + 5, (name, grace, drain)


def test_mtls_override_wires_each_service_to_its_own_certificate(compose: dict) -> None:
    mtls = load_yaml(COMPOSE_MTLS)
    declared = mtls["secrets"]
    for secret in declared.values():
        assert secret["file"].startswith("./certs/"), secret
    for name in SPECD_SERVICES:
        service = mtls["services"][name]
        cmd = command(service)
        args = parse_specd_args(cmd)
        mounted = {f"/run/secrets/{s['target']}": s["source"] for s in service["secrets"]}
        assert mounted[args.tls_cert] == f"{name}_cert" and mounted[args.tls_key] == f"{name}_key"
        assert mounted[args.tls_ca] == "ca_cert"
        assert set(mounted.values()) <= set(declared)
        # The rest of the command is the base file's, plus the TLS flags.
        base = command(compose["services"][name])
        assert cmd[: len(base)] == base, (cmd, base)
        if name != "draft":  # clients dial replicas by IP: they check the service name instead
            assert args.tls_server_name == {"target": "draft", "gateway": "target"}[name]
        if name != "gateway":
            test = service["healthcheck"]["test"]
            assert test[3] == name and all(f in test for f in ("--tls-cert", "--tls-key", "--tls-ca")), test
