#!/usr/bin/env bash
# Install a Prometheus server (Debian's `prometheus` package) for tests/deploy/test_prometheus_dashboard.py,
# which evaluates the Grafana dashboard's queries on a real Prometheus. Called by `scripts/setup.sh dev`.
# Idempotent. It never fails its caller: without apt-get or root it prints what to do and exits 0, and
# that test then fails (it does not skip) with the same advice.
set -uo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
warn() { echo "install_prometheus.sh: $*; install Prometheus yourself (e.g. apt-get install prometheus)" >&2; exit 0; }
command -v apt-get >/dev/null 2>&1 || warn "no apt-get here"
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO=(sudo -n); else warn "not root"; fi
fi
install() {
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null
}
# Stale or missing package lists (a fresh image): refresh once and retry.
install || { "${SUDO[@]}" apt-get update -q >/dev/null && install; } || warn "apt-get install prometheus failed"
command -v prometheus >/dev/null 2>&1 || warn "prometheus is still not on PATH"
echo "install_prometheus.sh: $(prometheus --version 2>&1 | head -n 1)"
