"""The installed package: one import name, stubs and the demo pair inside it, nothing from the checkout.

``built_package`` is the tree ``pip install .`` puts in site-packages. A plain non-editable install
into a fresh venv serving the demo pair is the acceptance check (README, "One import name");
tests/e2e/test_serve_command.py runs ``specd serve`` from this tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_everything_installs_under_specd(built_package: Path) -> None:
    assert sorted(p.name for p in built_package.iterdir()) == ["specd"]
    pkg = built_package / "specd"
    assert {"services", "gateway", "benchmarks", "v1", "models"} <= {p.name for p in pkg.iterdir()}
    for stub in ("common_pb2.py", "draft_pb2_grpc.py", "target_pb2_grpc.py"):
        assert (pkg / "v1" / stub).is_file(), stub
    for model in ("demo-target", "demo-draft"):
        assert (pkg / "models" / model / "model.safetensors").is_file()
        assert (pkg / "models" / model / "tokenizer.json").is_file()
    assert not (pkg / "models" / "build.py").exists()  # the training script is not part of the package
    assert (pkg / "services" / "engine" / "kernels" / "decoder.cpp").is_file()  # built at first use


def test_installed_package_finds_its_own_demo_pair(built_package: Path, tmp_path: Path) -> None:
    code = (
        "import json, specd.services.cli, specd.gateway.app, specd.v1.target_pb2 as t\n"
        "from specd.services.common.constants import DEMO_DRAFT, DEMO_TARGET\n"
        "print(json.dumps([specd.services.cli.__file__, t.__file__, str(DEMO_TARGET), str(DEMO_DRAFT)]))"
    )
    env = dict(os.environ, PYTHONPATH=str(built_package))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for path in json.loads(res.stdout):
        assert Path(path).is_relative_to(built_package), path
        assert Path(path).exists(), path
