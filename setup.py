"""The package layout setuptools cannot express in pyproject.toml alone.

Everything installs under the one import name ``specd``, while the repository keeps the design's
top-level folders: ``services/`` is ``specd.services``, ``gateway/`` is ``specd.gateway``,
``benchmarks/`` is ``specd.benchmarks``, the bundled demo pair in ``models/`` is package data of
``specd.models``, and the gRPC stubs are generated from ``proto/`` into ``specd/v1`` by the build
itself (so a plain ``pip install .`` of a fresh clone has them). The installed tree mirrors the
checkout (``specd/services`` beside ``specd/models``, as ``services/`` beside ``models/``), which is
how :mod:`specd.services.common.constants` finds the demo pair in both.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SOURCE_FOLDERS = ("services", "gateway", "benchmarks")  # each installs as specd.<folder>


def _generate_stubs() -> None:
    runpy.run_path(str(ROOT / "scripts" / "gen_proto.py"))["generate"](ROOT)


class BuildWithStubs(build_py):
    """build_py that first compiles proto/ (grpcio-tools is a build requirement)."""

    def run(self) -> None:
        _generate_stubs()
        super().run()

    def get_source_files(self) -> list[str]:  # what an sdist lists: the stubs must exist by then
        _generate_stubs()
        return super().get_source_files()

    def find_package_modules(self, package: str, package_dir: str):
        if package == "specd.models":
            return []  # the demo pair's files only, not the script that trains it (models/build.py)
        return super().find_package_modules(package, package_dir)


packages = ["specd", "specd.v1", "specd.models"]
package_dir = {"specd.models": "models"}
for folder in SOURCE_FOLDERS:
    package_dir[f"specd.{folder}"] = folder
    packages += [f"specd.{folder}"] + [f"specd.{folder}.{p}" for p in find_packages(folder)]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "specd.models": ["demo-target/*", "demo-draft/*"],
        "specd.services.engine.kernels": ["*.cpp", "*.h"],
        "specd.v1": ["*.pyi"],
    },
    cmdclass={"build_py": BuildWithStubs},
)
