"""The shared end-to-end stack: the demo pair in float32 (exact, batch-invariant), real processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.processes import Stack

PROMPTS = [
    "def binary_search(items, target):",
    "import os\n\n\ndef read_config(path):",
    "class Stack:\n    def __init__(self):",
    "The quick brown fox",
    "for i in range(10):",
    "def fibonacci(n):",
    "    @property\n    def name(self):",
    "# Parse command line arguments\nimport argparse\n",
]


@pytest.fixture(scope="session")
def stack(demo_pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    target, draft = demo_pair
    s = Stack(target, draft, tmp_path_factory.mktemp("stack")).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def reference_engine(demo_pair):
    """Target-only decoding in this process: what every greedy output must equal token for token."""
    from specd.services.engine.builder import ModelSpec, build_engine
    from specd.services.engine.engine import EngineConfig

    target, _ = demo_pair
    return build_engine(ModelSpec(str(target), None, "float32", "float32"), EngineConfig(max_batch_size=8))


def reference(engine, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    from specd.services.engine.engine import Request, SpecConfig
    from specd.services.engine.sampling import SamplingParams

    req = Request(
        "ref", tuple(prompt_ids), SamplingParams(temperature=0.0, max_tokens=max_tokens), SpecConfig("none", 0)
    )
    res = engine.generate([req])["ref"]
    return res.token_ids, res.text


def repo() -> Path:
    return Path(__file__).resolve().parents[2]
