"""An example drafter plugin: each token is followed by whatever followed it last time.

Registered through an entry point of this distribution (see pyproject.toml), exactly like
stagerun's own ``ngram`` drafter::

    [project.entry-points."stagerun.drafters"]
    bigram = "stagerun_bigram:BigramDrafter"

Theory of operation: the drafter keeps one table per request, token -> the token that came
right after its most recent committed occurrence. A proposal starts at the last token of the
context and follows the table, so a phrase seen once is proposed again the next time its first
token comes up. Only committed tokens enter the table: the drafts of windows still in flight
may end the context, but a wrong guess never feeds the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from stagerun.abc import Drafter

__all__ = ["BigramDrafter"]
__version__ = "0.1.0"


class BigramDrafter(Drafter):
    """Follows the most recent successor of each token through the committed history.

    Args:
        max_proposal: cap on the tokens proposed at once.
    """

    blocking: ClassVar[bool] = False  # a few dict lookups: call it on the Trio thread
    per_request: ClassVar[bool] = True

    def __init__(self, *, max_proposal: int = 8) -> None:
        if max_proposal < 1:
            raise ValueError(f"max_proposal must be at least 1, got {max_proposal}")
        self.max_proposal = max_proposal
        self._next: dict[int, int] = {}
        self._last: int | None = None

    def __repr__(self) -> str:
        return f"<BigramDrafter entries={len(self._next)} max_proposal={self.max_proposal}>"

    def begin(self, prompt: Sequence[int]) -> None:
        """Start a request: forget the last one, learn the prompt."""
        self._next = {}
        self._last = None
        self.commit(prompt)

    def commit(self, tokens: Sequence[int]) -> None:
        """Learn the successors of committed tokens."""
        for token in tokens:
            token = int(token)
            if self._last is not None:
                self._next[self._last] = token
            self._last = token

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guesses: follow the table from the context's last token."""
        limit = min(max_tokens, self.max_proposal)
        if limit <= 0 or not context:
            return []
        proposal: list[int] = []
        token = int(context[-1])
        while len(proposal) < limit and token in self._next:
            token = self._next[token]
            proposal.append(token)
        return proposal
