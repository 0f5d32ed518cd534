"""The llama-server peer's start-up (benchmarks/llama_cpp.py), against a stand-in binary: the peer is
not ours, and what is tested here is how the benchmark starts and stops it."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import pytest

from specd.benchmarks.llama_cpp import NO_REPACK, LlamaServer, ServerConfig, ServerCrashed

_STAND_IN = """#!{python}
import http.server, os, signal, sys
args = sys.argv[1:]
if {crash_always} or "--no-repack" not in args:
    os.kill(os.getpid(), signal.SIGSEGV)  # as llama-server loading a Q4_K_M file with repacking, on one VM
port = int(args[args.index("--port") + 1])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _stand_in(tmp_path: Path, crash_always: bool) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(_STAND_IN.format(python=sys.executable, crash_always=crash_always))
    binary.chmod(0o755)
    return binary


def test_a_server_killed_while_loading_starts_again_without_weight_repacking(tmp_path: Path) -> None:
    binary = _stand_in(tmp_path, crash_always=False)
    with LlamaServer(ServerConfig(tmp_path / "model.gguf"), binary, startup_timeout=60) as srv:
        assert srv.repack_off and NO_REPACK in srv.config.args(binary, srv.port)
        with urllib.request.urlopen(srv.url + "/health", timeout=5) as resp:
            assert resp.status == 200
        proc = srv._proc
    assert proc is not None and proc.poll() is not None  # stopped on leaving


def test_a_server_that_crashes_without_repacking_too_is_an_error(tmp_path: Path) -> None:
    binary = _stand_in(tmp_path, crash_always=True)
    with pytest.raises(ServerCrashed, match="exited with -11"):
        with LlamaServer(ServerConfig(tmp_path / "model.gguf"), binary, startup_timeout=60):
            pass
