#!/usr/bin/env bash
# Create .venv and install specd into it. torch 2.13.0 goes first: it is the CPU build on this
# kind of machine, and any looser spec could pull a multi-GB CUDA build.
# Usage: scripts/setup.sh [dev]      (dev adds pytest, scipy, ruff, matplotlib, the deploy-file validators,
#                                     and a Prometheus server: scripts/install_prometheus.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# --no-compile: pip would byte-compile every file of torch, ray, transformers and the rest up front
# (set-up 2m38 with it, 1m48 without, on 2 cores). What specd imports is compiled below instead.
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || pip install --no-compile torch==2.13.0
# The gRPC stubs are generated, never committed: the package build runs protoc (setup.py).
extra=""
[ "${1:-}" = "dev" ] && extra="[dev]"
pip install --no-compile -e ".${extra}"
# Build the AVX2 linear kernels now rather than at the first model load (a no-op where they do not apply).
.venv/bin/python -c "from specd.services.engine.kernels import ensure_built; ensure_built()"
# Byte-compile what specd's processes import (every specd module, and the libraries' modules they load
# lazily), by importing it once with bytecode writing on: where PYTHONDONTWRITEBYTECODE is set, as on
# these machines, nothing would ever be cached, and each process would compile torch and transformers
# again (about 5 s a start).
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python - <<'PY'
import importlib, pkgutil
for sub in ("v1", "services", "gateway", "benchmarks"):  # setup.py's folders, each its own package
    pkg = importlib.import_module(f"specd.{sub}")
    for m in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
        importlib.import_module(m.name)
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast  # noqa
lazy = ["ray", "fastapi", "uvicorn", "httpx", "transformers.models.qwen2.modeling_qwen2",
        "transformers.models.llama.modeling_llama", "scipy.stats", "matplotlib.pyplot"]
for name in lazy:
    # scipy and matplotlib come with the dev and bench extras only
    try:
        importlib.import_module(name)
    except ImportError:
        pass
PY
# dev: the Prometheus server that tests/deploy/test_prometheus_dashboard.py runs (Debian's package;
# warns instead of failing where apt-get or root is missing, and that test then fails with the advice).
if [ "${1:-}" = "dev" ]; then
  bash scripts/install_prometheus.sh
fi
