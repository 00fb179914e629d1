"""Prompt-lookup drafting: guess that text repeats itself.

Theory of operation: rewriting, quoting and editing reuse long runs of the prompt. The drafter
indexes every n-gram (``min_ngram <= n <= max_ngram``) of the request's committed history by
the position just after its most recent occurrence. To propose, it takes the longest suffix of
the query context that occurs earlier and returns the tokens that followed that occurrence.
Longer matches win; among equal lengths the most recent occurrence wins. Matches of one token
are allowed by default: right after a divergence the target's correction rarely continues a
longer n-gram, and a one-token match resynchronises a copy at once. Only committed tokens
are indexed: the optimistic drafts of windows still in flight may be part of a query, never of
the index, so a wrong guess cannot feed itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..abc import Drafter


class NgramDrafter(Drafter):
    """Longest-suffix prompt lookup over one request's committed history.

    Args:
        min_ngram: shortest suffix that counts as a match.
        max_ngram: longest suffix tried.
        max_proposal: cap on the tokens proposed at once.
    """

    name = "ngram"
    blocking = False  # propose is a dictionary lookup: call it on the Trio thread
    per_request = True  # it indexes the request's own history

    def __init__(self, *, min_ngram: int = 1, max_ngram: int = 6, max_proposal: int = 16) -> None:
        if not 1 <= min_ngram <= max_ngram <= 64:
            raise ValueError(
                f"ngram sizes must satisfy 1 <= min_ngram <= max_ngram <= 64, "
                f"got {min_ngram} and {max_ngram}"
            )
        if max_proposal < 1:
            raise ValueError(f"max_proposal must be at least 1, got {max_proposal}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_proposal = max_proposal
        self._history: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}

    def __repr__(self) -> str:
        return (
            f"<NgramDrafter n={self.min_ngram}..{self.max_ngram} "
            f"history={len(self._history)} entries={len(self._index)}>"
        )

    def begin(self, prompt: Sequence[int]) -> None:
        """Start a request: forget everything, index the prompt."""
        self._history = []
        self._index = {}
        self.commit(prompt)

    def commit(self, tokens: Sequence[int]) -> None:
        """Add committed tokens to the history and the index."""
        history = self._history
        for token in tokens:
            history.append(int(token))
            end = len(history)
            # The n-gram ending at end-1 is followed by whatever lands at `end`; record that
            # position once a token follows it, i.e. index n-grams ending one before the end.
            for n in range(self.min_ngram, self.max_ngram + 1):
                start = end - 1 - n
                if start < 0:
                    break
                self._index[tuple(history[start : end - 1])] = end - 1

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guesses for the tokens after ``context``."""
        limit = min(max_tokens, self.max_proposal)
        if limit <= 0:
            return []
        history = self._history
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            follow = self._index.get(tuple(context[len(context) - n :]))
            if follow is None:
                continue
            # Prefer committed continuation; extend through the context's own tail if the
            # match runs into the optimistic part.
            source = list(history) + list(context[len(history) :])
            proposal = source[follow : follow + limit]
            if proposal:
                return proposal
        return []
