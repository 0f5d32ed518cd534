"""Health probe for specd containers: compose healthchecks and Kubernetes exec readiness probes.

    python deploy/healthcheck.py draft   127.0.0.1:50051
    python deploy/healthcheck.py target  127.0.0.1:50052
    python deploy/healthcheck.py gateway http://127.0.0.1:8000/health
    python deploy/healthcheck.py target 127.0.0.1:50052 --tls-cert C --tls-key K --tls-ca CA   # mutual TLS

Exit status 0 when the service says it can take work, 1 otherwise (one line on stderr says why).
With --tls-cert/--tls-key/--tls-ca the probe speaks mutual TLS (gRPC), or verifies an https://
gateway against --tls-ca (presenting the certificate if the gateway asks for one). Kubernetes'
native ``grpc:`` probes cannot speak TLS, so the mutual-TLS overlay (deploy/k8s-mtls) runs this.

- draft, target: calls the service's own ``Health`` RPC (``specd.v1``) and needs ``serving``. The
  services do not register the standard ``grpc.health.v1`` service, so Kubernetes' native ``grpc:``
  probe cannot be used on them; this script is what the manifests run instead. A target is ready
  without its drafts (it decodes without guesses meanwhile), so only ``serving`` is checked.
- gateway: ``GET /health``, which answers 200 only when a target and one of its drafts are ready.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def check_grpc(role: str, address: str, tls: tuple[str, str, str] | None = None) -> str | None:
    """None when healthy, else the reason. ``tls``: (cert, key, ca) paths for mutual TLS."""
    import grpc

    from specd.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

    stub_class = draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        cert, key, ca = (open(p, "rb").read() for p in tls)
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        # The name the services' certificates carry (they are dialled by pod or container IP).
        channel = grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", role)])
    with channel:
        try:
            reply = stub_class(channel).Health(common_pb2.HealthRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            return f"{role} {address}: Health RPC failed: {e.code().name}"
    if not reply.serving:
        return f"{role} {address}: not serving"
    return None


def check_http(url: str, tls: tuple[str, str, str] | None = None) -> str | None:
    context = None
    if tls is not None:
        import ssl

        cert, key, ca = tls
        context = ssl.create_default_context(cafile=ca)
        context.load_cert_chain(cert, key)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as r:
            return None if r.status == 200 else f"{url}: HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"{url}: HTTP {e.code}"
    except OSError as e:
        return f"{url}: {e}"


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("draft", "target", "gateway"))
    parser.add_argument("where", help="HOST:PORT (draft, target) or the gateway's /health URL")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-ca")
    args = parser.parse_args(argv)
    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(files) and not all(files):
        parser.error("--tls-cert, --tls-key and --tls-ca go together")
    tls = files if all(files) else None
    role, where = args.role, args.where
    problem = check_http(where, tls) if role == "gateway" else check_grpc(role, where, tls)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
