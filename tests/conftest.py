"""Shared fixtures: tiny model pairs built once per session into a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_micro_pair, build_tiny_pair

REPO = Path(__file__).resolve().parent.parent
DEMO_TARGET = REPO / "models" / "demo-target"
DEMO_DRAFT = REPO / "models" / "demo-draft"


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def micro_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_micro_pair(tmp_path_factory.mktemp("micro"))


@pytest.fixture(scope="session")
def demo_pair() -> tuple[Path, Path]:
    if not (DEMO_TARGET / "model.safetensors").exists():
        pytest.fail("demo models missing: run `python models/build.py all` (they are committed in git)")
    return DEMO_TARGET, DEMO_DRAFT


@pytest.fixture(autouse=True)
def _deterministic_threads() -> None:
    torch.manual_seed(0)
