"""The standard grpc.health.v1 service on the draft and the target (Kubernetes' native gRPC probes)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.demo


@pytest.mark.parametrize("service", ["draft", "target"])
def test_standard_health_service_reports_serving(stack, service: str) -> None:
    port = stack.draft_port if service == "draft" else stack.target_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # A service name it does not know is NOT_FOUND, as the protocol says, not a false SERVING.
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
