"""Criterion 1: the official ``openai`` client against real draft, target and gateway processes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import PROMPTS, reference

pytestmark = pytest.mark.demo


def _client(stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(stack) -> None:
    models = _client(stack).models.list()
    assert [m.id for m in models.data] == ["demo-target"]
    r = httpx.get(stack.url + "/health")
    assert r.status_code == 200
    assert r.json()["targets"][0]["drafts_healthy"] == 1


def test_chat_streamed_equals_non_streamed(stack) -> None:
    client = _client(stack)
    messages = [{"role": "user", "content": "Explain os.path.join"}]
    full = client.chat.completions.create(model="demo-target", messages=messages, max_tokens=48, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model="demo-target",
        messages=messages,
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert text == full.choices[0].message.content


def test_completion(stack) -> None:
    out = _client(stack).completions.create(
        model="demo-target", prompt="def binary_search(items, target):", max_tokens=24, temperature=0
    )
    assert out.object == "text_completion"
    assert out.usage.completion_tokens == 24 and out.choices[0].finish_reason == "length"
    assert len(out.choices[0].text) > 0


def test_greedy_through_the_stack_is_token_identical_to_target_alone(stack, reference_engine) -> None:
    tok = reference_engine.tokenizer
    for prompt in PROMPTS[:4]:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        want_ids, want_text = reference(reference_engine, ids, 64)
        for method in ("draft", "ngram", "hybrid", "auto"):
            r = httpx.post(
                stack.url + "/v1/completions",
                json={
                    "prompt": ids,
                    "max_tokens": 64,
                    "temperature": 0,
                    "return_token_ids": True,
                    "speculation": {"method": method, "num_tokens": 4},
                },
                timeout=120,
            ).json()
            assert r["choices"][0]["token_ids"] == want_ids, (prompt, method)
            assert r["choices"][0]["text"] == want_text
            if method == "draft":
                assert r["usage"]["speculation"]["proposed_tokens"] > 0
                assert r["usage"]["speculation"]["mean_k"] == pytest.approx(4.0, abs=0.5)


def test_eight_concurrent_streams(stack, reference_engine) -> None:
    tok = reference_engine.tokenizer
    wants = [reference(reference_engine, tok(p, add_special_tokens=False)["input_ids"], 40)[1] for p in PROMPTS]

    async def one(client: AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model="demo-target", prompt=prompt, max_tokens=40, temperature=0, stream=True
        )
        text, finish = "", None
        async for c in stream:
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them():
        client = AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert len(PROMPTS) == 8
    for (text, finish), want in zip(results, wants):
        assert finish in ("stop", "length")
        assert text == want


def test_seeded_sampling_repeats(stack) -> None:
    body = {"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0.8, "top_p": 0.95, "seed": 1234}
    a = httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["speculation"]["proposed_tokens"] > 0


def test_stop_string(stack) -> None:
    client = _client(stack)
    full = (
        client.completions.create(
            model="demo-target", prompt="def binary_search(items, target):", max_tokens=40, temperature=0
        )
        .choices[0]
        .text
    )
    stop = full[10:14]
    cut = client.completions.create(
        model="demo-target", prompt="def binary_search(items, target):", max_tokens=40, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
