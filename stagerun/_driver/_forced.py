"""Drafts from a request's grammar: forced tokens, and other drafts cut where it refuses them.

Theory of operation: where a grammar admits only one continuation (``{"name": "``, a closing
brace, a schema's fixed keys), the last stage is certain to sample exactly those tokens: every
other token is masked. `GrammarDrafter` proposes them as drafts, so a verify window carries a
whole scaffold through the pipeline at once and is accepted whole, one traversal for what
plain decoding pays a traversal per token for. After them it may add the request's ordinary
drafter's guesses, cut at the first one the grammar does not allow (a draft the last stage
could never accept only costs compute).

It keeps its own matcher over the grammar, on stage 0, moved to each proposal's context the
way the last stage's follows its history: rolled back to the common prefix with what it
consumed last, then advanced. Nothing it proposes changes an answer: drafts are accepted
only when they equal what the last stage samples (`SpeculationController`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._engine._grammar import GrammarMatcher
from ..abc import Drafter

__all__ = ["GrammarDrafter"]


class GrammarDrafter(Drafter):
    """Forced tokens of ``matcher``'s grammar first, then ``inner``'s drafts that it allows.

    Args:
        matcher: a matcher at the start of the request's grammar (stage 0's own).
        inner: the request's drafter, if speculation is on (None: forced tokens only).
    """

    per_request = True

    def __init__(self, matcher: GrammarMatcher, inner: Drafter | None = None) -> None:
        self._matcher = matcher
        self._inner = inner
        self._prompt_len = 0
        self._consumed: list[int] = []  # generated tokens the matcher has consumed
        self.blocking = inner.blocking if inner is not None else False  # type: ignore[misc]
        self.certain = 0  # how many of the last proposal were forced
        self.forced_total = 0  # forced tokens proposed, over the request

    def __repr__(self) -> str:
        return f"<GrammarDrafter consumed={len(self._consumed)} forced={self.forced_total}>"

    def begin(self, prompt: Sequence[int]) -> None:
        self._move_to([])
        self._prompt_len = len(prompt)
        if self._inner is not None:
            self._inner.begin(prompt)

    def commit(self, tokens: Sequence[int]) -> None:
        if self._inner is not None:
            self._inner.commit(tokens)

    def propose(self, context: Sequence[int], max_tokens: int) -> Sequence[int]:
        """Forced tokens after ``context`` (any number), then up to ``max_tokens`` others."""
        self.certain = 0
        if not self._move_to(list(context[self._prompt_len :])):
            return ()  # the context leaves the grammar (a draft in flight): no guess
        forced = self._matcher.forced()
        self.certain = len(forced)
        self.forced_total += len(forced)
        if self._inner is None or max_tokens <= len(forced):
            return forced
        guesses = list(self._inner.propose([*context, *forced], max_tokens - len(forced)))
        self._matcher.consume(forced)
        allowed = self._matcher.valid_prefix(guesses)
        self._matcher.rollback(len(forced))
        return [*forced, *guesses[:allowed]]

    def _move_to(self, generated: list[int]) -> bool:
        """Have the matcher consume ``generated``; False if the grammar refuses a token of it."""
        consumed = self._consumed
        common = 0
        for mine, theirs in zip(consumed, generated, strict=False):
            if mine != theirs:
                break
            common += 1
        if common < len(consumed):
            self._matcher.rollback(len(consumed) - common)
            del consumed[common:]
        pending = generated[common:]
        allowed = self._matcher.valid_prefix(pending)
        self._matcher.consume(pending[:allowed])
        consumed.extend(pending[:allowed])
        return allowed == len(pending)
