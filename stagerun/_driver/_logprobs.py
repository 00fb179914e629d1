"""Log-probabilities on stage 0: the last stage's rows kept by position until committed.

The last stage answers every row of a verify window (or a decode step) with the sampled
token's log-probability and its top alternatives (`stagerun._engine._sampler`). Stage 0
keeps them by the position each row predicts (`LogprobRows.note`); a window sent again at the
same positions after a draft diverged replaces them, and a stale window's reply is never
noted. When a token is committed its row is taken (`LogprobRows.commit`): it must be the
row of that very token, which the acceptance rule guarantees (a committed token is always
the last stage's own sample for its position). `scored_prompt` reads the prompt's scores
from the reply to the last prefill chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import _proto
from .._errors import StagerunError
from ._values import TokenLogprob

__all__ = ["LogprobRows", "scored_prompt"]


class LogprobRows:
    """A request's uncommitted rows by position, and its committed tokens' logprobs."""

    def __init__(self) -> None:
        self._rows: dict[int, TokenLogprob] = {}
        self.committed: list[TokenLogprob] = []

    def __repr__(self) -> str:
        return f"<LogprobRows pending={len(self._rows)} committed={len(self.committed)}>"

    def note(self, reply: _proto.Predictions, first: int) -> None:
        """Keep the log-probabilities of ``reply``'s rows, whose first predicts ``first``."""
        if len(reply.logprobs) != len(reply.tokens):
            raise StagerunError(
                f"the last stage answered {len(reply.tokens)} rows with "
                f"{len(reply.logprobs)} log-probabilities"
            )
        top = len(reply.top_ids) // len(reply.tokens) if reply.tokens else 0
        for i, (token, logprob) in enumerate(zip(reply.tokens, reply.logprobs, strict=True)):
            ids = reply.top_ids[i * top : (i + 1) * top]
            values = reply.top_logprobs[i * top : (i + 1) * top]
            pairs = tuple(zip(ids, values, strict=True))
            self._rows[first + i] = TokenLogprob(token, logprob, pairs)

    def commit(self, token: int, position: int) -> TokenLogprob:
        """The row of ``token``, committed at ``position``; rows before it are forgotten."""
        logprob = self._rows.pop(position, None)
        if logprob is None or logprob.token_id != token:
            raise StagerunError(
                f"no log-probability for token {token} at position {position}: the last "
                f"stage's rows say {logprob}"
            )
        for stale in [p for p in self._rows if p < position]:
            del self._rows[stale]
        self.committed.append(logprob)
        return logprob


def scored_prompt(reply: _proto.Predictions, prompt: Sequence[int]) -> list[TokenLogprob | None]:
    """The prompt's log-probabilities in ``reply``: None for the first token, then one each."""
    scores = reply.prompt_logprobs
    if len(scores) != len(prompt) - 1:
        raise StagerunError(
            f"the last stage scored {len(scores)} of the prompt's {len(prompt) - 1} tokens"
        )
    top = len(reply.prompt_top_ids) // len(scores) if scores else 0
    out: list[TokenLogprob | None] = [None]
    for i, logprob in enumerate(scores):
        ids = reply.prompt_top_ids[i * top : (i + 1) * top]
        values = reply.prompt_top_logprobs[i * top : (i + 1) * top]
        out.append(TokenLogprob(prompt[i + 1], logprob, tuple(zip(ids, values, strict=True))))
    return out
