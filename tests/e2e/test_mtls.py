"""Mutual TLS through draft, target and gateway, with certificates from ``scripts/dev-certs.sh``.

A completion works end to end (the gateway reaches the target, the target its draft: guesses are
verified, and the gateway itself serves HTTPS); a plaintext client, a TLS client without a
certificate and one whose certificate comes from another CA are all refused by draft and target.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from specd.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.e2e.processes import REPO, Stack

pytestmark = pytest.mark.demo


def _certs(out: Path) -> Path:
    subprocess.run(["bash", str(REPO / "scripts" / "dev-certs.sh"), str(out)], check=True, capture_output=True)
    return out


def _creds(certs: Path, name: str | None) -> grpc.ChannelCredentials:
    ca = (certs / "ca.crt").read_bytes()
    if name is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(certs / f"{name}.key").read_bytes(),
        certificate_chain=(certs / f"{name}.crt").read_bytes(),
    )


def _tls_args(certs: Path, name: str) -> tuple[str, ...]:
    return ("--tls-cert", str(certs / f"{name}.crt"), "--tls-key", str(certs / f"{name}.key"),
            "--tls-ca", str(certs / "ca.crt"))  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[Path, Path]:
    """Our CA's certificates, and another CA's (same names, unrelated keys)."""
    return _certs(tmp_path_factory.mktemp("ca")), _certs(tmp_path_factory.mktemp("other-ca"))


@pytest.fixture(scope="module")
def tls_stack(demo_pair, certs, tmp_path_factory) -> Iterator[Stack]:
    ours, _ = certs
    target, draft = demo_pair
    s = Stack(
        target,
        draft,
        tmp_path_factory.mktemp("mtls"),
        draft_args=_tls_args(ours, "draft"),
        target_args=_tls_args(ours, "target"),
        gateway_args=(
            *_tls_args(ours, "gateway"),
            "--ssl-certfile",
            str(ours / "gateway.crt"),
            "--ssl-keyfile",
            str(ours / "gateway.key"),
        ),  # fmt: skip
        gateway_scheme="https",
        grpc_credentials=_creds(ours, "client"),
        http_verify=str(ours / "ca.crt"),
    ).start()
    try:
        yield s
    finally:
        s.stop()


def test_a_completion_goes_through_draft_target_and_gateway_over_mutual_tls(tls_stack, certs) -> None:
    ours, _ = certs
    r = httpx.post(
        tls_stack.url + "/v1/completions",
        json={"prompt": "def binary_search(items, target):", "max_tokens": 24, "temperature": 0},
        verify=ssl.create_default_context(cafile=ours / "ca.crt"),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 24
    assert usage["speculation"]["proposed_tokens"] > 0  # the target got guesses from its draft
    health = httpx.get(tls_stack.url + "/health", verify=ssl.create_default_context(cafile=ours / "ca.crt")).json()
    assert health["targets"][0]["drafts_healthy"] == 1
    # The container probe speaks mutual TLS too.
    for role, port in (("draft", tls_stack.draft_port), ("target", tls_stack.target_port)):
        probe = subprocess.run(
            [
                sys.executable,
                str(REPO / "deploy" / "healthcheck.py"),
                role,
                f"127.0.0.1:{port}",
                *_tls_args(ours, "client"),
            ],  # fmt: skip
            capture_output=True,
        )
        assert probe.returncode == 0, probe.stderr.decode()


@pytest.mark.parametrize("service", ["draft", "target"])
@pytest.mark.parametrize("client", ["plaintext", "tls without a certificate", "certificate of another CA", "ours"])
def test_only_clients_with_a_certificate_of_our_ca_get_in(tls_stack, certs, service: str, client: str) -> None:
    ours, other = certs
    address = f"127.0.0.1:{tls_stack.draft_port if service == 'draft' else tls_stack.target_port}"
    if client == "plaintext":
        channel = grpc.insecure_channel(address)
    elif client == "tls without a certificate":
        channel = grpc.secure_channel(address, _creds(ours, None))
    elif client == "certificate of another CA":
        # It trusts our server (our CA) but presents a certificate our CA did not sign.
        mixed = grpc.ssl_channel_credentials(
            root_certificates=(ours / "ca.crt").read_bytes(),
            private_key=(other / "client.key").read_bytes(),
            certificate_chain=(other / "client.crt").read_bytes(),
        )
        channel = grpc.secure_channel(address, mixed)
    else:
        channel = grpc.secure_channel(address, _creds(ours, "client"))
    stub_class = draft_pb2_grpc.DraftServiceStub if service == "draft" else target_pb2_grpc.TargetServiceStub
    with channel:
        call = stub_class(channel).Health
        if client == "ours":
            assert call(common_pb2.HealthRequest(), timeout=10).serving
        else:
            with pytest.raises(grpc.RpcError) as e:
                call(common_pb2.HealthRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value


def test_the_https_gateway_refuses_plain_http(tls_stack) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_stack.url.replace("https://", "http://") + "/health", timeout=10)
