"""Criteria 2, 3 and 5: a draft killed mid-stream, a client that disconnects, and the metrics.

These run on their own stack (the draft gets killed), with the demo pair in float32.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import reference
from tests.e2e.processes import Stack, kill_process, metric_sum, metric_value, wait_grpc

pytestmark = pytest.mark.demo

PROMPT = "def binary_search(items, target):"


@pytest.fixture(scope="module")
def own_stack(demo_pair, tmp_path_factory) -> Iterator[Stack]:
    target, draft = demo_pair
    # A short draft timeout so a dead draft costs little even if its socket does not refuse at once.
    s = Stack(target, draft, tmp_path_factory.mktemp("faults"), target_args=("--draft-timeout", "1.0")).start()
    try:
        yield s
    finally:
        s.stop()


def _wait_for(predicate, timeout: float) -> float:
    """Poll until predicate() is true; returns the seconds it took (fails after ``timeout``)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_metrics_after_traffic(own_stack) -> None:
    s = own_stack
    before = s.metrics("target")
    usage = {"proposed_tokens": 0, "accepted_tokens": 0, "target_forward_passes": 0}
    for i, temperature in enumerate((0.0, 0.0, 0.8, 0.8)):
        r = httpx.post(
            s.url + "/v1/completions",
            json={
                "prompt": PROMPT,
                "max_tokens": 48,
                "temperature": temperature,
                "seed": i,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=120,
        )
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        for k in usage:
            usage[k] += events[-1]["usage"]["speculation"][k]
    after = s.metrics("target")
    delta = {
        name: metric_value(after, name) - (metric_value(before, name) or 0.0)
        for name in (
            "specd_spec_draft_tokens_total",
            "specd_spec_accepted_tokens_total",
            "specd_spec_verifications_total",
        )
    }
    # The target's counters saw exactly what the responses reported.
    assert delta["specd_spec_draft_tokens_total"] == usage["proposed_tokens"] > 0
    assert delta["specd_spec_accepted_tokens_total"] == usage["accepted_tokens"] > 0
    assert delta["specd_spec_verifications_total"] == usage["target_forward_passes"] > 0
    # This stack saw no other traffic, so the windowed rate is exactly accepted / proposed.
    rate = metric_value(after, "specd_spec_acceptance_rate")
    assert rate == pytest.approx(usage["accepted_tokens"] / usage["proposed_tokens"], rel=1e-9)
    per_pos = metric_sum(after, "specd_spec_accepted_tokens_per_position_total")
    assert per_pos == metric_value(after, "specd_spec_accepted_tokens_total")
    assert metric_value(after, "specd_spec_accepted_tokens_per_position_total", 'position="0"') > 0
    # Requests ran one at a time, so every batched pass verified exactly one sequence.
    for name in ("specd_verify_seconds_count", "specd_batch_size_count", "specd_batch_size_sum"):
        grew = metric_value(after, name) - (metric_value(before, name) or 0.0)
        assert grew == usage["target_forward_passes"], name
    assert metric_value(after, "specd_verify_seconds_sum") > 0
    assert metric_value(after, "specd_requests_running") == 0
    assert metric_sum(after, "specd_draft_failures_total") == 0  # present, and nothing failed yet
    assert "specd_draft_failures_total" in after

    draft = s.metrics("draft")
    assert metric_value(draft, "specd_draft_block_seconds_count") > 0
    assert metric_value(draft, "specd_draft_block_seconds_sum") > 0
    assert metric_value(draft, "specd_draft_sequences") == 0

    gw = s.metrics("gateway")
    tokens = metric_value(gw, "specd_generated_tokens_total")
    assert tokens == 4 * 48
    assert metric_value(gw, "specd_time_to_first_token_seconds_count") == 4
    # One observation per token after each request's first.
    assert metric_value(gw, "specd_time_between_tokens_seconds_count") == 4 * 47
    assert metric_value(gw, "specd_time_between_tokens_seconds_sum") > 0
    assert metric_value(gw, "specd_request_seconds_count") == 4
    assert metric_value(gw, "specd_requests_total", 'status="200"') == 4


def test_a_repeated_prompt_is_served_from_the_prefix_cache(own_stack) -> None:
    """The second of two equal long prompts reports its cached tokens (OpenAI's
    usage.prompt_tokens_details.cached_tokens), the target's counters agree, and the text is the same."""
    s = own_stack
    before = s.metrics("target")
    body = {"prompt": PROMPT + "\n    " + "lo, hi = 0, len(items) - 1\n    " * 6, "max_tokens": 16, "temperature": 0}
    first, second = (httpx.post(s.url + "/v1/completions", json=body, timeout=120).json() for _ in range(2))
    after = s.metrics("target")
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 64
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)]
    assert cached[0] == 0 and 0 < cached[1] < prompt_tokens and cached[1] % 32 == 0  # whole blocks of 32
    grew = {n: metric_value(after, n) - (metric_value(before, n) or 0.0) for n in (
        "specd_prompt_tokens_total", "specd_prefix_cache_hit_tokens_total")}  # fmt: skip
    assert grew == {"specd_prompt_tokens_total": 2 * prompt_tokens, "specd_prefix_cache_hit_tokens_total": cached[1]}


def test_a_cache_salt_keeps_requests_apart(own_stack) -> None:
    """cache_salt (vLLM's extension): a request is served from the prefix cache only what requests
    with the same salt cached; without a salt, only what unsalted requests did. The text is the same."""
    prompt = PROMPT + "\n    # salted\n    " + "mid = (lo + hi) // 2\n    " * 6
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}

    def cached(salt: str | None) -> tuple[int, str]:
        extra = {} if salt is None else {"cache_salt": salt}
        r = httpx.post(own_stack.url + "/v1/completions", json=body | extra, timeout=120).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"], r["choices"][0]["text"]

    runs = [cached(s) for s in ("tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None)]
    assert [c for c, _ in runs[:3]] == [0, 0, 0]
    assert all(c > 0 for c, _ in runs[3:])
    assert len({text for _, text in runs}) == 1


def test_client_disconnect_frees_everything(own_stack) -> None:
    s = own_stack
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST",
            s.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Explain json.dumps"}],
                "max_tokens": 800,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                # The draft model every round: whether `auto` asks it in the first rounds depends on
                # what the earlier tests left in its statistics, and the draft must hold the row here.
                "speculation": {"method": "draft", "num_tokens": 3},
            },
        ) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert metric_value(s.metrics("target"), "specd_requests_running") == 1
            assert metric_value(s.metrics("draft"), "specd_draft_sequences") == 1
        # Leaving the block closes the connection mid-stream.
    took = _wait_for(
        lambda: (
            metric_value(s.metrics("target"), "specd_requests_running") == 0
            and metric_value(s.metrics("draft"), "specd_draft_sequences") == 0
        ),
        timeout=10.0,
    )
    print(f"state freed on target and draft {took:.3f}s after the disconnect")
    gw = s.metrics("gateway")
    assert metric_value(gw, "specd_requests_total", 'status="cancelled"') == 1


def test_draft_killed_mid_stream(own_stack, reference_engine) -> None:
    s = own_stack
    ids = reference_engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    want_ids, _ = reference(reference_engine, ids, 200)
    failures_before = metric_sum(s.metrics("target"), "specd_draft_failures_total")
    got: list[int] = []
    finish = None
    with httpx.Client(timeout=120) as client:
        with client.stream(
            "POST",
            s.url + "/v1/completions",
            json={
                "prompt": ids,
                "max_tokens": 200,
                "temperature": 0,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            usage = None
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if not event["choices"]:
                    continue
                c = event["choices"][0]
                got += c.get("token_ids", [])
                finish = c["finish_reason"] or finish
                if len(got) >= 20 and s.procs["draft"].poll() is None:
                    kill_process(s.procs["draft"])  # SIGKILL: no goodbye on the stream
    assert finish == "length"
    assert got == want_ids  # greedy output unchanged, every token delivered
    assert metric_sum(s.metrics("target"), "specd_draft_failures_total") > failures_before
    assert usage["completion_tokens"] == 200

    # With the draft still down, a sampled request asking for it completes too, with exactly the
    # tokens that speculation "none" gives for the same seed (it once failed on the target).
    def sampled(method: str) -> list[int]:
        body = {
            "prompt": ids,
            "max_tokens": 24,
            "temperature": 0.9,
            "seed": 7,
            "return_token_ids": True,
            "speculation": {"method": method, "num_tokens": 3 if method == "draft" else 0},
        }
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    assert sampled("draft") == sampled("none")

    # The draft comes back on the same port: the target reconnects and speculates again.
    s.start_draft()
    wait_grpc(s.draft_port, s.procs["draft"], s.logdir / "draft.log")
    body = {"prompt": ids, "max_tokens": 48, "temperature": 0, "return_token_ids": True}

    def speculating_again() -> bool:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["token_ids"] == want_ids[:48]
        return r["usage"]["speculation"]["accepted_tokens"] > 0

    _wait_for(speculating_again, timeout=30.0)
    assert httpx.get(s.url + "/health").status_code == 200
