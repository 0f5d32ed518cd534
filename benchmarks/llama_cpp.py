"""llama.cpp's ``llama-server`` as a benchmark peer.

``scripts/build_llama_cpp.sh`` builds the binary (CPU only) into ``$SPECD_CACHE/llama.cpp``
(default ``~/.cache/specd/llama.cpp``): ``bin/llama-server``, plus the source tree in ``src/``
whose ``convert_hf_to_gguf.py`` and ``gguf-py`` turn a Hugging Face folder into a GGUF file.

- :func:`find_llama_server` locates the binary;
- :func:`convert_to_f16_gguf` converts a Hugging Face folder to an f16 GGUF file (cached);
- :class:`LlamaServer` runs one server (target alone, or with a draft model) for a ``with`` block;
- :func:`complete` sends one request to its native ``/completion`` endpoint and returns the
  server's own timings next to the wall-clock time.

Requests ask for plain sampling at the given temperature (every other sampler off, EOS ignored, no
prompt cache) so each one does the same work as specd's benchmark requests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType

from specd.services.common.process import die_with_parent


def cache_root() -> Path:
    """Where ``scripts/build_llama_cpp.sh`` puts llama.cpp: ``$SPECD_CACHE/llama.cpp``."""
    base = os.environ.get("SPECD_CACHE") or str(Path.home() / ".cache" / "specd")
    return Path(base) / "llama.cpp"


def find_llama_server() -> Path | None:
    """The ``llama-server`` binary: ``$LLAMA_SERVER`` if set, else the cached build; None if absent."""
    env = os.environ.get("LLAMA_SERVER")
    path = Path(env) if env else cache_root() / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def convert_to_f16_gguf(hf_dir: Path, out: Path) -> Path:
    """Convert the Hugging Face model folder ``hf_dir`` to an f16 GGUF file at ``out``; return ``out``.

    Skipped when ``out`` exists. Runs the ``convert_hf_to_gguf.py`` bundled with the build, under this
    interpreter (it needs torch, numpy, transformers and, for SentencePiece tokenizers, sentencepiece).
    """
    if out.exists():
        return out
    src = cache_root() / "src"
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found; run scripts/build_llama_cpp.sh first")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name in the same folder, renamed when complete: an interrupted
    # conversion never leaves a truncated file that a later run would take as cached.
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp.gguf")
    env = dict(os.environ)
    # The bundled gguf-py first: the script uses newer gguf APIs than the PyPI wheel has.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src / "gguf-py"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(script), "--outtype", "f16", "--outfile", str(tmp), str(hf_dir)]
    try:
        subprocess.run(cmd, env=env, check=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


@dataclass(frozen=True)
class ServerConfig:
    """How to start one ``llama-server``.

    ``draft_max``/``draft_min`` bound the tokens drafted per step. ``draft_sampling`` is ``"greedy"``
    (the draft's argmax, accepted when the target samples the same token; this build's default) or
    ``"probabilistic"`` (sampled draft, rejection-sampling verification); None keeps the default.

    ``poll`` is ggml's busy-wait level for idle worker threads (0-100; the build's default is 50).
    0 by default: the target and the draft each have a thread pool, and with polling on they spin
    against each other on a small machine (measured on 2 cores: target + draft at 4.9 tok/s with
    the default, 9.5 with 0; target alone the same either way). None keeps the build's default.
    """

    model: Path
    draft: Path | None = None
    threads: int = 1
    draft_threads: int | None = None  # None: same as threads
    draft_max: int = 8
    draft_min: int = 0
    draft_sampling: str | None = None
    ctx_size: int = 2048
    poll: int | None = 0
    extra_args: tuple[str, ...] = ()

    def args(self, binary: Path, port: int) -> list[str]:
        """The command line for this config on ``127.0.0.1:port``."""
        t = str(self.threads)
        # -tb (prompt processing threads) defaults to -t in this build; given anyway so the command
        # line says it all. One slot (-np 1): the server's default of 4 would split the context.
        cmd = [str(binary), "-m", str(self.model), "-t", t, "-tb", t, "-c", str(self.ctx_size), "-np", "1"]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        if self.poll is not None:
            cmd += ["--poll", str(self.poll)]
        if self.draft is not None:
            td = str(self.draft_threads or self.threads)
            cmd += ["--spec-draft-model", str(self.draft), "--spec-type", "draft-simple"]
            cmd += ["--spec-draft-n-max", str(self.draft_max), "--spec-draft-n-min", str(self.draft_min)]
            cmd += ["--spec-draft-threads", td, "--spec-draft-threads-batch", td]
            if self.poll is not None:
                cmd += ["--spec-draft-poll", str(self.poll)]
            if self.draft_sampling is not None:
                cmd += ["--spec-draft-sampling", self.draft_sampling]
        return cmd + list(self.extra_args)


def _free_port() -> int:
    # Bind to port 0 and let the kernel choose; the tiny race until the server binds is harmless
    # here (a clash makes the server exit, which the start-up wait reports).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerCrashed(RuntimeError):
    """llama-server was killed by a signal before it was healthy."""


NO_REPACK = "--no-repack"


class LlamaServer:
    """A ``llama-server`` process for the duration of a ``with`` block.

    Entering starts it in its own process group and waits until ``/health`` answers 200 (model
    loaded); leaving stops the whole group, SIGTERM then SIGKILL, whatever happened in the block.
    Its output goes to a log file (``log_path``), quoted in the error if it fails to start.

    A server killed by a signal while loading is started once more with weight repacking off
    (``repack_off`` then says so): build 11434 died with SIGSEGV loading Q4_K_M files with it on a
    2-core Intel Xeon VM with AVX-512 and AMX, and loaded them without it.
    """

    def __init__(self, config: ServerConfig, binary: Path | None = None, startup_timeout: float = 300.0) -> None:
        found = binary or find_llama_server()
        if found is None:
            raise FileNotFoundError("llama-server not found; run scripts/build_llama_cpp.sh or set LLAMA_SERVER")
        self.config = config
        self.binary = found
        self.startup_timeout = startup_timeout
        self.port = 0
        self.log_path: Path | None = None
        self.repack_off = NO_REPACK in config.extra_args
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        try:
            self._start()
        except ServerCrashed as crash:
            if self.repack_off:
                raise
            print(
                f"llama-server crashed while loading ({crash.args[0].splitlines()[0]}); again with {NO_REPACK}",
                file=sys.stderr,
                flush=True,
            )
            self.config = replace(self.config, extra_args=(*self.config.extra_args, NO_REPACK))
            self.repack_off = True
            self._start()
        return self

    def _start(self) -> None:
        self.port = _free_port()
        fd, log = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log_path = Path(log)
        with os.fdopen(fd, "wb") as log_file:
            # start_new_session: its own process group, so stopping it reaches any child too and a
            # Ctrl-C meant for the benchmark does not kill it behind our back.
            self._proc = subprocess.Popen(
                self.config.args(self.binary, self.port),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # a benchmark killed outright leaves no server behind
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                error = ServerCrashed if code < 0 else RuntimeError
                raise error(f"llama-server exited with {code}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.25)
        raise TimeoutError(f"llama-server not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's output."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL after ``grace`` seconds. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break  # the whole group is already gone
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()


@dataclass(frozen=True)
class CompletionTiming:
    """One ``/completion`` request: what came back, the server's own timings, and the wall time.

    ``draft_n``/``draft_n_accepted`` (tokens drafted / accepted) are None when no draft ran.
    """

    text: str
    tokens: tuple[int, ...]
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int | None
    draft_n_accepted: int | None
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        """Generation speed as the server measured it (prompt processing excluded)."""
        return self.predicted_n / (self.predicted_ms / 1000) if self.predicted_ms > 0 else 0.0

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted tokens, or None without a draft."""
        if not self.draft_n:
            return None
        return (self.draft_n_accepted or 0) / self.draft_n


def complete(
    server: LlamaServer,
    prompt: str | Sequence[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    timeout: float = 600.0,
) -> CompletionTiming:
    """Generate exactly ``max_tokens`` tokens after ``prompt`` (text, or token ids) on ``server``.

    Temperature 0 is greedy; above 0 it is plain sampling from the softmax at that temperature.
    """
    payload = {
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "n_predict": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "ignore_eos": True,  # every request does the same amount of work
        "cache_prompt": False,  # every request pays for its prompt, as in specd's benchmark
        # Only the temperature sampler (then the final draw from the distribution): no top-k/top-p/
        # min-p truncation and no repetition penalties, which llama.cpp applies by default. The
        # values are set too, in case a build ignores the sampler list.
        "samplers": ["temperature"],
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "return_tokens": True,
        "stream": False,
    }
    req = urllib.request.Request(
        server.url + "/completion",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = json.load(resp)
    wall = time.perf_counter() - start
    t = body["timings"]
    return CompletionTiming(
        text=body.get("content", ""),
        tokens=tuple(body.get("tokens") or ()),
        prompt_n=int(t["prompt_n"]),
        prompt_ms=float(t["prompt_ms"]),
        predicted_n=int(t["predicted_n"]),
        predicted_ms=float(t["predicted_ms"]),
        draft_n=t.get("draft_n"),
        draft_n_accepted=t.get("draft_n_accepted"),
        wall_s=wall,
    )
