"""The engine's tokenizer (``services/engine/tokenizer.py``) encodes and decodes exactly as
``transformers``' does for the same folder, and hands everything else to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from specd.services.engine.tokenizer import FastTokenizer, load_tokenizer

TEXTS = [
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "  leading spaces,\ttabs\tand\n\n\nblank lines   ",
    "Unicode: naïve café, 日本語のテキスト, emoji 🙂🚀, math ∑ x² ≤ ∞",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "json.dumps({'a': [1, 2.5, None]}, indent=2)  # comment",
    "",
]


def _folders(demo_pair, tiny_pair) -> list[Path]:
    return [Path(demo_pair[0]), Path(tiny_pair[0])]


def _check_same(folder: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, FastTokenizer)
    for text in TEXTS:
        for special in (False, True):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    all_ids = list(range(len(theirs)))
    assert ours.decode(all_ids[:500]) == theirs.decode(all_ids[:500])
    assert ours.convert_ids_to_tokens(all_ids[:50]) == theirs.convert_ids_to_tokens(all_ids[:50])
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    chat = [{"role": "user", "content": "hi"}]
    kw = {"add_generation_prompt": True, "tokenize": False}
    assert ours.apply_chat_template(chat, **kw) == theirs.apply_chat_template(chat, **kw)  # delegated
    assert ours.eos_token == theirs.eos_token


def test_demo_and_tiny_tokenizers_match_transformers(demo_pair, tiny_pair) -> None:
    for folder in _folders(demo_pair, tiny_pair):
        _check_same(folder)


def test_the_real_pairs_tokenizer_matches_transformers(real_pair) -> None:
    _check_same(Path(real_pair[0]))


def test_other_folders_get_transformers_tokenizer(tmp_path, tiny_pair) -> None:
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(tiny_pair[0], folder)
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"tokenizer_class"', '"clean_up_tokenization_spaces": true, "x"'))
    assert not isinstance(load_tokenizer(str(folder)), FastTokenizer)


def test_no_transformers_import_for_encoding(demo_pair) -> None:
    """The point of it: building the tokenizer and encoding/decoding do not import transformers."""
    import subprocess
    import sys

    code = (
        "import sys; from specd.services.engine.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(demo_pair[0])!r}); t.decode(t('def f(x):')['input_ids']); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path.cwd())
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("bad", ["", "{not json"])
def test_a_broken_config_is_not_read_as_plain(tmp_path, tiny_pair, bad: str) -> None:
    """An unreadable tokenizer_config.json leaves the folder to transformers (and its own errors)."""
    import shutil

    from specd.services.engine.tokenizer import _plain

    folder = tmp_path / "broken"
    shutil.copytree(tiny_pair[0], folder)
    assert _plain(folder)
    (folder / "tokenizer_config.json").write_text(bad)
    assert not _plain(folder)
