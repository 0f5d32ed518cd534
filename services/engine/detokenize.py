"""Incremental detokenization with stop strings.

Text is released only when it is final: a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and
any suffix that could still grow into a stop string are held back, so a stream never shows text that
a stop string later removes.
"""

from __future__ import annotations


class Detokenizer:
    """Turns a growing list of generated token ids into text deltas, watching for stop strings."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters already released
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def push(self, ids: list[int]) -> tuple[str, int]:
        """Add ids; returns (new text, how many of ``ids`` to keep).

        The count is ``len(ids)`` unless a stop string completed inside them: then the ids after the
        one that completed it are dropped, the text is cut before the stop string, and ``stopped`` is set.
        """
        keep = len(ids)
        text = self._decode(self.ids + ids)
        cut = self._find_stop(text)
        if cut >= 0:
            # Rare path: find the first id that completes the stop string.
            for n in range(1, len(ids) + 1):
                t = self._decode(self.ids + ids[:n])
                c = self._find_stop(t)
                if c >= 0:
                    keep, text, cut = n, t, c
                    break
            self.stopped = True
            self.ids += ids[:keep]
            self.text = text[:cut]
            delta = self.text[self.sent :]
            self.sent = len(self.text)
            return delta, keep
        self.ids += ids
        self.text = text
        end = len(text)
        if text.endswith("\ufffd"):
            end -= 1
        hold = 0
        for s in self.stop:  # hold back the longest suffix that is a prefix of a stop string
            for n in range(min(len(s) - 1, end), hold, -1):
                if text[end - n : end] == s[:n]:
                    hold = n
                    break
        end = max(end - hold, self.sent)
        delta = text[self.sent : end]
        self.sent = end
        return delta, keep

    def flush(self) -> str:
        """Release whatever was held back (the sequence ended without a stop string)."""
        if self.stopped:
            return ""
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta
