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
# (about 80 s of the set-up on 2 cores: torch alone took 45 s with it, 19 s without); Python compiles
# the modules actually imported on first use and caches them in the venv.
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || pip install --no-compile torch==2.13.0
# The gRPC stubs are generated, never committed: the package build runs protoc (setup.py).
extra=""
[ "${1:-}" = "dev" ] && extra="[dev]"
pip install --no-compile -e ".${extra}"
# Build the AVX2 linear kernels now rather than at the first model load (a no-op where they do not apply).
.venv/bin/python -c "from specd.services.engine.kernels import ensure_built; ensure_built()"
# dev: the Prometheus server that tests/deploy/test_prometheus_dashboard.py runs (Debian's package;
# warns instead of failing where apt-get or root is missing, and that test then fails with the advice).
if [ "${1:-}" = "dev" ]; then
  bash scripts/install_prometheus.sh
fi
