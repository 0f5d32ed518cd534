"""Generate the Python gRPC stubs from proto/ into ./specd/ (ignored by git; never edited by hand).

Run by scripts/setup.sh before the package is installed; rerun after changing a .proto file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    protos = sorted((ROOT / "proto").rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for pkg in {p.parent.relative_to(ROOT / "proto") for p in protos}:
        for d in (ROOT / pkg, *(ROOT / pkg).parents):
            if d == ROOT:
                break
            (d / "__init__.py").touch()
    print(f"generated stubs for {len(protos)} protos under {ROOT / 'specd'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
