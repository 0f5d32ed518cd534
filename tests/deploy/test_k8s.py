"""deploy/k8s: valid Kubernetes objects, wired to each other and to the specd CLI as the README says.

Every object is validated against the Kubernetes OpenAPI JSON schemas bundled in the
``kubernetes-validate`` package (a dev dependency; no cluster or network needed), in strict mode
(unknown fields are errors), for Kubernetes ``KUBERNETES_VERSION``.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.files import (
    ADAPTER_VALUES,
    K8S,
    K8S_MTLS,
    defined_metrics,
    host_port,
    load_yaml,
    load_yaml_docs,
    parse_specd_args,
)

KUBERNETES_VERSION = "1.33.0"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
ROLES = ("draft", "target", "gateway")


def objects() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in load_yaml_docs(path)]


def find(kind: str, name: str) -> dict:
    matches = [d for _, d in objects() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container(role: str) -> dict:
    (c,) = find("Deployment", role)["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def schema_errors(doc: dict) -> str | None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "path_doc", objects(), ids=lambda pd: f"{pd[0].name}:{pd[1]['kind']}/{pd[1]['metadata']['name']}"
)
def test_manifest_matches_the_kubernetes_schema(path_doc: tuple[Path, dict]) -> None:
    assert schema_errors(path_doc[1]) is None


def test_the_schema_check_catches_mistakes() -> None:
    bad = copy.deepcopy(find("Deployment", "draft"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # misspelt
    assert schema_errors(bad) is not None
    bad = copy.deepcopy(find("HorizontalPodAutoscaler", "target"))
    bad["spec"]["maxReplicas"] = "eight"
    assert schema_errors(bad) is not None


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)
    assert {d["kind"] for _, d in objects()} >= {"Deployment", "Service", "HorizontalPodAutoscaler"}


def test_kustomize_renders_valid_objects() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (the manifests themselves are validated above)")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(rendered) == len(objects())
    for doc in rendered:
        assert schema_errors(doc) is None
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "specd"


@pytest.mark.parametrize("role", ROLES)
def test_container_args_are_accepted_by_the_specd_cli(role: str) -> None:
    c = container(role)
    assert c["args"][0] == role and "command" not in c  # the image's ENTRYPOINT is `specd`
    args = parse_specd_args([str(a) for a in c["args"]])
    if role != "gateway":
        assert args.device == "cuda" and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if role == "gateway":
        assert ports == {"http": args.port}
    else:
        assert ports == {"grpc": args.port, "metrics": args.metrics_port}


@pytest.mark.parametrize("role", ("draft", "target"))
def test_draft_and_target_request_one_gpu(role: str) -> None:
    resources = container(role)["resources"]
    assert int(resources["requests"]["nvidia.com/gpu"]) == 1
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1  # extended resources: limits must equal requests


def test_gateway_needs_no_gpu() -> None:
    resources = container("gateway")["resources"]
    assert "nvidia.com/gpu" not in resources.get("requests", {}) and "nvidia.com/gpu" not in resources.get("limits", {})


@pytest.mark.parametrize("role", ROLES)
def test_probes(role: str) -> None:
    c = container(role)
    assert c.get("readinessProbe") and c.get("livenessProbe")
    args = [str(a) for a in c["args"]]
    port = int(flag(args, "--port"))
    if role == "gateway":
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert "tcpSocket" in c["livenessProbe"]  # /health is 503 while targets are down: no restart loop
        return
    # specd's gRPC services serve grpc.health.v1 (tests/e2e/test_grpc_health.py): native gRPC probes.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": port}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


@pytest.mark.parametrize("role", ROLES)
def test_pods_carry_prometheus_scrape_annotations(role: str) -> None:
    template = find("Deployment", role)["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    args = [str(a) for a in container(role)["args"]]
    metrics_port = flag(args, "--port" if role == "gateway" else "--metrics-port")
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": metrics_port,
        "prometheus.io/path": "/metrics",
    }


@pytest.mark.parametrize("role", ROLES)
def test_services_select_their_pods_and_ports(role: str) -> None:
    deployment = find("Deployment", role)
    service = find("Service", role)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"] for p in container(role)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_target_reaches_every_draft_pod_through_a_headless_service() -> None:
    draft_service = find("Service", "draft")
    assert draft_service["spec"]["clusterIP"] == "None"
    grpc_port = next(p["port"] for p in draft_service["spec"]["ports"] if p["name"] == "grpc")
    target_args = [str(a) for a in container("target")["args"]]
    assert host_port(flag(target_args, "--draft-address")) == ("draft", grpc_port)
    # Likewise the gateway reaches every target pod.
    target_service = find("Service", "target")
    assert target_service["spec"]["clusterIP"] == "None"
    grpc_port = next(p["port"] for p in target_service["spec"]["ports"] if p["name"] == "grpc")
    gateway_args = [str(a) for a in container("gateway")["args"]]
    assert host_port(flag(gateway_args, "--target-address")) == ("target", grpc_port)


@pytest.mark.parametrize("role", ("draft", "target"))
def test_an_autoscaler_per_draft_and_target(role: str) -> None:
    hpas = [
        d
        for _, d in objects()
        if d["kind"] == "HorizontalPodAutoscaler" and d["spec"]["scaleTargetRef"]["name"] == role
    ]
    assert len(hpas) == 1, f"{role}: {len(hpas)} HorizontalPodAutoscalers"
    (hpa,) = hpas
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": role}
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    exported = defined_metrics()
    adapter = {rule["name"]["as"] for rule in load_yaml(ADAPTER_VALUES)["rules"]["custom"]}
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "Pods":
            name = metric["pods"]["metric"]["name"]
            assert name in exported, f"{name} is not a specd metric"
            assert name in adapter, f"{name} is not published by deploy/prometheus/adapter-values.yaml"
        else:
            assert metric["type"] == "Resource", metric


@pytest.mark.parametrize("role", ROLES)
def test_grace_period_covers_the_pre_stop_sleep_and_the_drain(role: str) -> None:
    pod = find("Deployment", role)["spec"]["template"]["spec"]
    c = container(role)
    drain = parse_specd_args([str(a) for a in c["args"]]).drain_timeout
    assert "--drain-timeout" in c["args"]  # stated, so the numbers are read together
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 5  # past the 5 s re-resolution of the clients (services/common/discovery.py)
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5, (role, pod["terminationGracePeriodSeconds"])


def _render_mtls() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S_MTLS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_mtls_overlay_renders_valid_objects_with_each_service_on_its_secret() -> None:
    rendered = _render_mtls()
    assert len(rendered) == len(objects())
    deployments = {}
    for doc in rendered:
        assert schema_errors(doc) is None
        if doc["kind"] == "Deployment":
            deployments[doc["metadata"]["name"]] = doc
    for role in ROLES:
        pod = deployments[role]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        args = parse_specd_args([str(a) for a in c["args"]])
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == f"specd-{role}-tls"
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
        assert mount["readOnly"]
        root = mount["mountPath"]
        assert (args.tls_cert, args.tls_key, args.tls_ca) == (f"{root}/tls.crt", f"{root}/tls.key", f"{root}/ca.crt")
        assert pod["securityContext"]["fsGroup"] == 10001  # the image's user reads the Secret's files
        if role != "draft":
            assert args.tls_server_name == {"target": "draft", "gateway": "target"}[role]
    for role in ("draft", "target"):
        (c,) = deployments[role]["spec"]["template"]["spec"]["containers"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in c[probe], "native gRPC probes cannot speak TLS"
            cmd = c[probe]["exec"]["command"]
            assert cmd[:4] == [
                "python",
                "/app/deploy/healthcheck.py",
                role,
                f"127.0.0.1:{container(role)['ports'][0]['containerPort']}",
            ]
            assert all(f in cmd for f in ("--tls-cert", "--tls-key", "--tls-ca")), cmd
