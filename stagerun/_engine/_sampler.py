"""A request's sampling state on the last stage, kept to the rule the KV caches keep.

Theory of operation: the processors that depend on the tokens before a row (penalties, a
grammar) need the request's token history, and must see, for row *i* of a verify window,
exactly the tokens before that row: the committed ones, then the window's own earlier
tokens. `RowSampler` keeps that history the way a KV cache keeps positions: every message
the stage computes writes its tokens at its position (`RowSampler.record`), cutting off
whatever was there from that position on, so a stale window's tokens are overwritten by the
next window at the same position and a ``Trim`` cuts them (`RowSampler.trim`). Prefix blocks
restored from the stage's prefix cache bring their tokens with them (`RowSampler.restore`).

What is derived from the history (the generated tokens' counts, a grammar matcher's state)
is kept valid for a prefix of it, up to a position, and moves only along the history:
forward by counting (consuming) its tokens, back by uncounting (rolling back) them. The
history itself is the undo log, so rewinding costs what was undone, and nothing a stale
window did survives the next write at its position.

Row *i*'s token is then sampled from its logits adjusted by `adjust_logits` with the state
moved to its position (`stagerun._decide._sampling`), and its log-probabilities, when the
request asked for them, are the raw row's (`row_logprobs`).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import numpy as np

from .. import _proto
from .._decide._sampling import adjust_logits, draw_token, row_logprobs, sample_token

__all__ = ["Grammar", "RowSampler", "Rows"]


class Grammar(Protocol):
    """A grammar matcher over generated tokens (`stagerun._engine._grammar`)."""

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar accepts one after another from its state."""
        ...

    def consume(self, tokens: list[int]) -> None:
        """Advance over ``tokens``, all of which `valid_prefix` accepted."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` tokens consumed."""
        ...

    def allowed(self) -> np.ndarray[Any, Any]:
        """The tokens allowed next, as a ``[vocab]`` bool array."""
        ...


@attrs.frozen
class Rows:
    """What the last stage answers for a message's rows (`_proto.Predictions`' fields)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class _Counts:
    """How many times each token occurs in ``history[start:upto]``, moved along the history."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.upto = start
        self.counts: np.ndarray[Any, Any] | None = None

    def rewind(self, history: list[int], position: int) -> None:
        while self.upto > max(position, self.start):
            self.upto -= 1
            if self.counts is not None and history[self.upto] < self.counts.shape[0]:
                self.counts[history[self.upto]] -= 1

    def move(self, history: list[int], position: int, vocab: int) -> np.ndarray[Any, Any]:
        if self.counts is None:
            self.counts = np.zeros(vocab, dtype=np.int64)
        self.rewind(history, position)
        if position > self.upto:
            tokens = np.asarray(history[self.upto : position], dtype=np.int64)
            np.add.at(self.counts, tokens[tokens < vocab], 1)
            self.upto = position
        return self.counts


class RowSampler:
    """One request's sampling on the last stage: its token history and what depends on it.

    Args:
        params: the request's sampling settings.
        prompt_len: the prompt's length (generated tokens start there).
        grammar: the request's grammar matcher, at the start of the generated text.
    """

    def __init__(
        self, params: _proto.SamplingParams, prompt_len: int, grammar: Grammar | None = None
    ) -> None:
        self.params = params
        self.prompt_len = prompt_len
        self.history: list[int] = []
        self.grammar = grammar
        self._grammar_upto = prompt_len  # the matcher has consumed history[prompt_len:this]
        self._generated = (
            _Counts(prompt_len) if params.presence_penalty or params.frequency_penalty else None
        )
        # the draw takes the processed row: its bias is applied already
        self._draw_params = attrs.evolve(params, bias_ids=(), bias_values=())
        # prompt scoring: each prompt token's logprobs from position 1 on, and the last row
        # of a chunk, which predicts the next chunk's first token
        self.prompt_scores: list[tuple[float, list[int], list[float]]] = []
        self._pending: tuple[int, np.ndarray[Any, Any]] | None = None

    def __repr__(self) -> str:
        return f"<RowSampler history={len(self.history)} prompt={self.prompt_len}>"

    @property
    def plain(self) -> bool:
        """Whether the rows need nothing but their logits (no history, no logprobs)."""
        return self.grammar is None and not self.params.penalized and self.params.logprobs < 0

    # -- the history --------------------------------------------------------------------------

    def restore(self, tokens: list[int]) -> None:
        """The history starts with ``tokens`` (positions restored from the prefix cache)."""
        self.trim(0)
        self.history.extend(tokens)

    def record(self, position: int, tokens: tuple[int, ...] | list[int]) -> None:
        """The tokens a message carries, at its position; what followed them is cut off."""
        end = position + len(tokens)
        if len(self.history) == end and self.history[position:end] == list(tokens):
            return  # written already (the answer to a message its compute recorded)
        self.trim(position)
        if position > len(self.history):
            raise ValueError(
                f"tokens at position {position} follow a history of {len(self.history)}: "
                "positions are missing"
            )
        self.history.extend(tokens)

    def trim(self, position: int) -> None:
        """Cut the history back to ``position`` tokens, and what was derived from the rest."""
        if position >= len(self.history):
            return
        if self._generated is not None:
            self._generated.rewind(self.history, position)
        if self.grammar is not None and self._grammar_upto > max(position, self.prompt_len):
            self.grammar.rollback(self._grammar_upto - max(position, self.prompt_len))
            self._grammar_upto = max(position, self.prompt_len)
        del self.history[position:]

    # -- the rows -----------------------------------------------------------------------------

    @property
    def scores_prompt(self) -> bool:
        """Whether the request asked for its prompt tokens' log-probabilities."""
        return self.params.prompt_logprobs >= 0

    def score(self, message: _proto.ActivationMessage, out: np.ndarray[Any, Any]) -> None:
        """Score the prompt tokens that ``out`` (every row of a prefill chunk) predicts.

        Row *i* predicts the token at ``message.position + i + 1``; a chunk's last row
        predicts the next chunk's first token, and is kept until that chunk comes.
        """
        top, history = self.params.prompt_logprobs, self.history
        if self._pending is not None and self._pending[0] < len(history):
            position, row = self._pending
            self.prompt_scores.append(row_logprobs(row, history[position], top))
            self._pending = None
        for i, row in enumerate(out):
            position = message.position + i + 1
            if position >= self.prompt_len:
                break
            if position >= len(history):
                self._pending = (position, row.copy())
                break
            self.prompt_scores.append(row_logprobs(row, history[position], top))

    def take_prompt_scores(self) -> tuple[tuple[float, ...], tuple[int, ...], tuple[float, ...]]:
        """The prompt scores so far, as `_proto.Predictions` carries them (then forgotten)."""
        scores, self.prompt_scores = self.prompt_scores, []
        return (
            tuple(mine for mine, _, _ in scores),
            tuple(i for _, ids, _ in scores for i in ids),
            tuple(v for _, _, values in scores for v in values),
        )

    def answer(self, message: _proto.ActivationMessage, out: np.ndarray[Any, Any]) -> Rows:
        """The token after each row of ``out``, the logits of the message's last rows."""
        first = message.position + len(message.tokens) - out.shape[0] + 1  # row 0's position
        params = self.params
        if self.plain:
            return Rows(tuple(sample_token(row, params, first + i) for i, row in enumerate(out)))
        self.record(message.position, message.tokens)
        tokens: list[int] = []
        logprobs: list[float] = []
        top_ids: list[int] = []
        top_logprobs: list[float] = []
        for i, row in enumerate(out):
            token = self._sample(row, first + i)
            tokens.append(token)
            if params.logprobs >= 0:
                mine, ids, values = row_logprobs(row, token, params.logprobs)
                logprobs.append(mine)
                top_ids.extend(ids)
                top_logprobs.extend(values)
        return Rows(tuple(tokens), tuple(logprobs), tuple(top_ids), tuple(top_logprobs))

    def _sample(self, row: np.ndarray[Any, Any], position: int) -> int:
        """The token at ``position`` (> 0), from the row that predicts it."""
        params, vocab = self.params, row.shape[0]
        allowed = None
        if self.grammar is not None:
            if not self._grammar_reaches(position):
                return int(np.argmax(row))  # after a token the grammar refused: never used
            allowed = self.grammar.allowed()
        generated = None
        if self._generated is not None:
            generated = self._generated.move(self.history, position, vocab)
        recent: list[int] = []
        if params.repetition_penalty != 1.0:
            n = params.repetition_last_n
            recent = self.history[max(0, position - n) if n else 0 : position]
        adjusted = adjust_logits(row, params, generated=generated, recent=recent, allowed=allowed)
        return draw_token(adjusted, self._draw_params, position)

    def _grammar_reaches(self, position: int) -> bool:
        """Move the grammar to ``position``; False if a token before it is not allowed."""
        assert self.grammar is not None
        target = max(position, self.prompt_len)
        if target < self._grammar_upto:
            self.grammar.rollback(self._grammar_upto - target)
            self._grammar_upto = target
        pending = self.history[self._grammar_upto : target]
        valid = self.grammar.valid_prefix(pending)
        self.grammar.consume(pending[:valid])
        self._grammar_upto += valid
        return valid == len(pending)
