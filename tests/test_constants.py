"""Shared values have one definition (services/common/constants.py and services/common/process.py):
the review's list of what was defined several times, checked over the product's source."""

from __future__ import annotations

import re
from pathlib import Path

from specd.services.common import constants

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("services", "gateway", "benchmarks", "deploy") for p in (REPO / folder).rglob("*.py"))


def _where(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [
        f"{p.relative_to(REPO)}:{i}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if rx.search(line) and not line.lstrip().startswith("#")
    ]


def test_each_shared_value_is_defined_once() -> None:
    home = "services/common/constants.py"
    # The speculation methods, as a list of their names.
    methods = r",\s*".join(f"[\"']{m}[\"']" for m in ("auto", "draft", "ngram", "hybrid", "none"))
    assert [w.split(":")[0] for w in _where(methods)] == [home]
    # The largest k, the default k of "auto" and of the fixed methods, the dtype names: assigned once.
    for name in ("MAX_SPECULATIVE_TOKENS", "AUTO_NUM_TOKENS", "FIXED_NUM_TOKENS", "DTYPE_NAMES"):
        assert [w.split(":")[0] for w in _where(rf"^\s*{name}\s*=")] == [home], name
    assert [w.split(":")[0] for w in _where(r"[\"']float16[\"'],\s*[\"']float32[\"']")] == [home]
    # A literal k where a default belongs.
    assert _where(r"SpecConfig\(\s*\"\w+\",\s*[34]\s*\)|default_k: int = \d|num_tokens: int = \d") == []
    # GOMP_SPINCOUNT is set by the CLI alone, before torch loads.
    assert [w.split(":")[0] for w in _where(r"[\"']GOMP_SPINCOUNT[\"']")] == ["services/common/runtime.py"]
    # Child processes' command lines: built by services/common/process.py only.
    assert [w.split(":")[0] for w in _where(r"sys\.executable,\s*\"-m\"")] == ["services/common/process.py"]


def test_the_values_agree_with_what_uses_them() -> None:
    from specd.gateway.schemas import Speculation
    from specd.services.engine.builder import DTYPES

    assert set(DTYPES) == set(constants.DTYPE_NAMES)
    fields = Speculation.model_json_schema()["properties"]
    assert fields["method"]["anyOf"][0]["enum"] == list(constants.SPECULATION_METHODS)
    assert fields["num_tokens"]["anyOf"][0]["maximum"] == constants.MAX_SPECULATIVE_TOKENS
    assert constants.default_num_tokens("auto") == constants.AUTO_NUM_TOKENS
    assert constants.default_num_tokens("draft") == constants.FIXED_NUM_TOKENS
