"""Schemathesis against the live gateway: cases generated from its own /openapi.json, valid and
not, must never get a 5xx; afterwards every service still runs and nothing is left running.

The schema is the app's own (``create_app(...).openapi()``, built at collection time, since
schemathesis' lazy fixture loader does not work with pytest 9); the first test checks that the live
gateway serves exactly it.

Generation is capped at a few tokens per request (the fuzz is about the API, not about decoding):
an explicit max_tokens in the context is cut to 2, and a chat request without one gets 2.
"""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from specd.gateway.app import create_app
from specd.gateway.settings import GatewaySettings
from tests.e2e.processes import metric_value

pytestmark = pytest.mark.demo

MAX_EXAMPLES = 20  # per operation; with the examples and coverage phases ~600 requests
GENERATED_TOKENS = 2


OPENAPI = create_app(GatewaySettings(target_addresses=("127.0.0.1:1",))).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)


def test_the_live_gateway_serves_this_schema(stack) -> None:
    assert httpx.get(stack.url + "/openapi.json").json() == OPENAPI


def _cap_generation(case) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    limits = [k for k in ("max_tokens", "max_completion_tokens") if k in body]
    for key in limits:
        value = body[key]
        if isinstance(value, int) and not isinstance(value, bool) and GENERATED_TOKENS < value <= 1024:
            body[key] = GENERATED_TOKENS
    if not limits and case.path.endswith("/chat/completions"):
        body["max_tokens"] = GENERATED_TOKENS


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases on every run: a CI failure is reproducible
    suppress_health_check=list(HealthCheck),
)
def test_no_generated_request_gets_a_server_error(case, stack) -> None:
    _cap_generation(case)
    response = case.call(base_url=stack.url, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])


def test_everything_still_serves_after_the_fuzz(stack) -> None:
    deadline = time.monotonic() + 15
    while metric_value(stack.metrics("target"), "specd_requests_running") != 0:
        assert time.monotonic() < deadline, "requests left running after the fuzz"
        time.sleep(0.1)
    assert metric_value(stack.metrics("draft"), "specd_draft_sequences") == 0
    assert all(p.poll() is None for p in stack.procs.values())
    r = httpx.post(stack.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    gateway = stack.metrics("gateway")
    assert metric_value(gateway, "specd_requests_total", 'status="500"') is None
