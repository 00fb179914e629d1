"""Turning generated tokens into text, with stop strings held back until they are decided.

Theory of operation: streamed text must never show a stop string, nor the first characters of
one that may still complete. `TextAssembler.push` takes the newly decoded characters and
returns what is safe to show now: everything except the longest tail of the text that is a
prefix of some stop string. When a stop string appears, the text is cut in front of it and the
assembler reports that generation should stop. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextAssembler:
    """Accumulates generated text and applies stop strings with hold-back."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self.text = ""
        self.stopped = False
        self._shown = 0
        self._longest = max((len(s) for s in self.stop), default=0)

    def push(self, piece: str) -> str:
        """Add decoded text; return the part that can be shown now."""
        if self.stopped or not piece:
            return ""
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        if not self.stop:
            return self._show(len(self.text))
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            return self._show(len(self.text))
        return self._show(len(self.text) - self._held_back())

    def flush(self, piece: str = "") -> str:
        """The end of generation: whatever was held back is final text after all."""
        shown = self.push(piece)
        if self.stopped:
            return shown
        return shown + self._show(len(self.text))

    def _held_back(self) -> int:
        for size in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0

    def _show(self, end: int) -> str:
        out = self.text[self._shown : end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return out
