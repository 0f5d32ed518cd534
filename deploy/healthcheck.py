"""Health probe for specd containers: compose healthchecks and Kubernetes exec readiness probes.

    python deploy/healthcheck.py draft   127.0.0.1:50051
    python deploy/healthcheck.py target  127.0.0.1:50052
    python deploy/healthcheck.py gateway http://127.0.0.1:8000/health

Exit status 0 when the service says it can take work, 1 otherwise (one line on stderr says why).

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


def check_grpc(role: str, address: str) -> str | None:
    """None when healthy, else the reason."""
    import grpc

    from specd.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

    stub_class = draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub
    with grpc.insecure_channel(address) as channel:
        try:
            reply = stub_class(channel).Health(common_pb2.HealthRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            return f"{role} {address}: Health RPC failed: {e.code().name}"
    if not reply.serving:
        return f"{role} {address}: not serving"
    return None


def check_http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            return None if r.status == 200 else f"{url}: HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"{url}: HTTP {e.code}"
    except OSError as e:
        return f"{url}: {e}"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("draft", "target", "gateway"):
        print(__doc__, file=sys.stderr)
        return 2
    role, where = argv
    problem = check_http(where) if role == "gateway" else check_grpc(role, where)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
