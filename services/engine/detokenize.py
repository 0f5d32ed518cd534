"""Incremental detokenization with stop strings, at a cost proportional to the new tokens.

Each push decodes only a short window of ids, as TGI and vLLM do: ``prefix_offset`` marks where the
window starts (a few ids of context, so tokenizers that merge across tokens, e.g. SentencePiece's
leading spaces, decode the new ids as they would in the whole text) and ``read_offset`` where the
ids whose text is already out start. The new text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``.

Text is released only when it is final: a trailing incomplete UTF-8 sequence (decoded as U+FFFD)
waits for its next byte, and any suffix that could still grow into a stop string is held back, so a
stream never shows text that a stop string later removes. Stop strings are searched only in the held
text plus the new text: released text never holds the start of a stop string (it would have been held).
"""

from __future__ import annotations


class Detokenizer:
    """Turns a growing list of generated token ids into text deltas, watching for stop strings."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.prefix_offset = 0  # the decode window starts here
        self.read_offset = 0  # text of ids before this is final (released or held in ``pending``)
        self.pending = ""  # final text not yet released: a possible start of a stop string
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self, upto: int) -> str:
        """Text of ``ids[read_offset:upto]``, decoded in its window (may end with U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset : upto])
        return full[len(prefix) :]

    def _find_stop(self, text: str) -> int:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def push(self, ids: list[int]) -> tuple[str, int]:
        """Add ids; returns (new text, how many of ``ids`` to keep).

        The count is ``len(ids)`` unless a stop string completed inside them: then the ids after the
        one that completed it are dropped, the text is cut before the stop string, and ``stopped`` is set.
        """
        start = len(self.ids)
        self.ids += ids
        upto, new = self._clean_prefix(len(self.ids))
        if self.stop and self._find_stop(self.pending + new) >= 0:
            return self._stop_inside(start, ids)
        if upto > self.read_offset:
            self.pending += new
            self.prefix_offset, self.read_offset = self.read_offset, upto
        return self._release(), len(ids)

    def _clean_prefix(self, upto: int) -> tuple[int, str]:
        """The longest ``ids[:m]`` (m <= upto) whose new text does not end inside a character, and that
        text. A character's bytes span at most the last 3 ids, so at most 4 windows are tried; where
        none is clean (tokens that cut characters everywhere), nothing is read yet."""
        new = self._new_text(upto)
        if not new.endswith("\ufffd"):
            return upto, new
        for m in range(upto - 1, max(self.read_offset, upto - 4), -1):
            t = self._new_text(m)
            if not t.endswith("\ufffd"):
                return m, t
        return self.read_offset, ""

    def _stop_inside(self, start: int, ids: list[int]) -> tuple[str, int]:
        """Rare path: find the first id whose text completes a stop string and cut there."""
        keep, text, cut = 0, self.pending, self._find_stop(self.pending)
        for n in range(1, len(ids) + 1):
            t = self.pending + self._new_text(start + n).rstrip("\ufffd")
            c = self._find_stop(t)
            if c >= 0:
                keep, text, cut = n, t, c
                break
        del self.ids[start + keep :]
        self.stopped = True
        self.pending = ""
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[: max(cut, 0)], keep

    def _release(self) -> str:
        """Release ``pending`` but its longest suffix that is a prefix of a stop string."""
        text, hold = self.pending, 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        cut = len(text) - hold
        self.pending = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        """Release whatever was held back (the sequence ended without a stop string)."""
        if self.stopped:
            return ""
        rest = self.pending + self._new_text(len(self.ids))
        self.pending = ""
        self.prefix_offset = self.read_offset = len(self.ids)
        return rest
