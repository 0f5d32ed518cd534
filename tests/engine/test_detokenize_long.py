"""Incremental detokenization at real lengths: constant work per token, exact text over 4,000 tokens."""

from __future__ import annotations

import itertools

import pytest

from specd.services.engine.detokenize import Detokenizer
from tests.conftest import DEMO_TARGET

# Code, accented Latin, CJK and emoji: the 8k byte-level vocabulary splits the last two into
# byte tokens, so characters end mid-token all the time.
PIECES = [
    "def wrap(text, width=70):\n    return [line for line in text.split('\\n')]\n",
    "# naïve café: überprüfe die Länge\n",
    "print('数据结构与算法', len('数据'))\n",
    "emoji = '🙂🚀✨' * 2  # 🎉\n",
]


class _CountingTokenizer:
    """A real tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def long_output():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    text = "".join(f"{PIECES[i % 4]}x{i} = {i * i}\n" for i in range(400))
    ids = tok(text, add_special_tokens=False)["input_ids"][:4000]
    assert len(ids) == 4000
    return tok, ids


def _blocks(ids: list[int]):
    """Ids in speculative-round sized blocks of 1 to 5."""
    sizes = itertools.cycle([1, 3, 5, 2, 4])
    i = 0
    while i < len(ids):
        n = next(sizes)
        yield ids[i : i + n]
        i += n


def test_decode_work_per_push_is_flat_in_output_length(long_output) -> None:
    tok, ids = long_output
    counting = _CountingTokenizer(tok)
    d = Detokenizer(counting, stop=("<|never|>",))
    per_push, out = [], []
    for block in _blocks(ids):
        before = counting.decoded
        out.append(d.push(block)[0])
        per_push.append((counting.decoded - before) / len(block))
    out.append(d.flush())
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True)
    early, late = per_push[:200], per_push[-200:]
    # Ids decoded per new id: the same near token 4,000 as near token 100, and a small constant
    # (decoding the whole output again, as before, was thousands per push near the end).
    assert sum(late) / len(late) <= 1.25 * sum(early) / len(early) and max(per_push) <= 40


@pytest.mark.parametrize("line", [44, 114])
def test_stop_string_and_utf8_exact_over_4000_tokens(long_output, line: int) -> None:
    """A stop string made of multi-byte characters, first seen at token ~1,500 or ~4,000: the text
    ends exactly before it and the ids kept end with the one that completes it."""
    tok, _ = long_output
    stop = "终止🎯"
    text = "".join(f"{PIECES[i % 4]}x{i} = {i * i}\n" + (f"# {stop} here\n" if i == line else "") for i in range(400))
    ids = tok(text, add_special_tokens=False)["input_ids"][:4200]
    full = tok.decode(ids, skip_special_tokens=True)
    assert full.count(stop) == 1
    d = Detokenizer(tok, stop=("never-there", stop))
    out, kept = [], 0
    for block in _blocks(ids):
        delta, keep = d.push(block)
        out.append(delta)
        kept += keep
        if d.stopped:
            break
    assert d.stopped and "".join(out) == full[: full.find(stop)]
    assert stop in tok.decode(ids[:kept]) and stop not in tok.decode(ids[: kept - 1])
    assert (line == 44 and 1000 < kept < 2000) or (line == 114 and kept > 3700)
