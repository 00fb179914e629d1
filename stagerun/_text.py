"""Turning generated tokens into text, with stop strings held back until they are decided.

Theory of operation: streamed text must never show a stop string, nor the first characters of
one that may still complete. `TextAssembler.push` takes the newly decoded characters and
returns what is safe to show now: everything except the longest tail of the text that is a
prefix of some stop string. When a stop string appears, the text is cut in front of it and the
assembler reports that generation should stop. Pure: no I/O.

Each stop string has a Knuth-Morris-Pratt matcher that reads the text once, character by
character. Its state is exactly the length of the longest tail of the text that is a prefix of
its stop string, so one pass over a new piece both finds a completed stop string and says how
much to hold back. A push costs O(len(piece)) per stop string (amortized), however long the
text and the stop strings are; searching the held-back tail again for each piece would cost
O(longest stop string) per piece, and finding the hold-back by trying each tail O(longest²).
"""

from __future__ import annotations

from collections.abc import Sequence


def _fallbacks(stop: str) -> list[int]:
    """KMP's failure function: ``f[i]`` is the longest proper border of ``stop[: i + 1]``."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class _StopMatcher:
    """Follows the text for one stop string; ``matched`` is how much of it the text ends with."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        self._fallbacks = _fallbacks(stop)

    def __repr__(self) -> str:
        return f"<_StopMatcher {self.stop!r} matched={self.matched}>"

    def feed(self, piece: str) -> int:
        """Read ``piece``: the index in it where the stop string first ends, or -1."""
        stop, fallbacks, q = self.stop, self._fallbacks, self.matched
        for i, char in enumerate(piece):
            while q and stop[q] != char:
                q = fallbacks[q - 1]
            if stop[q] == char:
                q += 1
                if q == len(stop):
                    self.matched = q
                    return i
        self.matched = q
        return -1


class TextAssembler:
    """Accumulates generated text and applies stop strings with hold-back."""

    def __init__(self, stop: str | Sequence[str] = ()) -> None:
        if isinstance(stop, str):  # one stop string, not its characters
            stop = (stop,)
        self.stop = tuple(s for s in stop if s)
        self.stopped = False
        self._matchers = [_StopMatcher(s) for s in self.stop]
        self._shown: list[str] = []  # the pieces of text returned so far
        # Not shown yet: the text's longest tail that begins some stop string. Every matcher's
        # state lies within it, so a stop string completed by the next piece starts inside it.
        self._held = ""

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else f"holding {len(self._held)}"
        return f"<TextAssembler stops={len(self.stop)} {state}>"

    @property
    def text(self) -> str:
        """The text so far, cut in front of the stop string once one appeared."""
        if len(self._shown) > 1:
            self._shown = ["".join(self._shown)]
        return "".join(self._shown) + self._held

    def push(self, piece: str) -> str:
        """Add decoded text; return the part that can be shown now."""
        if self.stopped or not piece:
            return ""
        pending, offset = self._held + piece, len(self._held)
        cut = -1  # where the earliest completed stop string starts, in `pending`
        for matcher in self._matchers:
            end = matcher.feed(piece)
            if end >= 0:
                start = offset + end + 1 - len(matcher.stop)
                cut = start if cut < 0 else min(cut, start)
        if cut >= 0:
            self.stopped = True
            return self._show(pending[:cut], held="")
        hold = max((m.matched for m in self._matchers), default=0)
        split = len(pending) - hold
        return self._show(pending[:split], held=pending[split:])

    def flush(self, piece: str = "") -> str:
        """The end of generation: whatever was held back is final text after all."""
        shown = self.push(piece)
        if self.stopped:
            return shown
        for matcher in self._matchers:
            matcher.matched = 0  # the held text is shown now: nothing can complete a stop in it
        return shown + self._show(self._held, held="")

    def _show(self, text: str, *, held: str) -> str:
        self._held = held
        if text:
            self._shown.append(text)
        return text
