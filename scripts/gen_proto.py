"""Generate the Python gRPC stubs from proto/ into ./specd/v1 (ignored by git; never edited by hand).

The package build runs this (setup.py), so ``pip install .`` and ``pip install -e .`` always ship
stubs made from the current .proto files; run it by hand after changing one in an editable checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generate(root: Path = ROOT) -> int:
    """protoc over ``root/proto`` into ``root`` (the proto package ``specd.v1`` lands in
    ``root/specd/v1``), with the ``__init__.py`` files that make it importable. Returns how many
    .proto files it compiled."""
    from grpc_tools import protoc

    protos = sorted((root / "proto").rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{root / 'proto'}",
        f"-I{include}",
        f"--python_out={root}",
        f"--pyi_out={root}",
        f"--grpc_python_out={root}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(map(str, protos)))
    for pkg in {p.parent.relative_to(root / "proto") for p in protos}:
        for d in (root / pkg, *(root / pkg).parents):
            if d == root:
                break
            (d / "__init__.py").touch()
    return len(protos)


def main() -> int:
    n = generate()
    print(f"generated stubs for {n} protos under {ROOT / 'specd'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
