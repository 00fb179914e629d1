"""The acceptance rule of speculative decoding: which tokens a verify window commits.

Theory of operation
-------------------
A window verifies draft tokens ``d1..dk``. The target's *verdict vector* ``t0..tk`` holds the
token the target model itself produces at each of those positions: ``t_i`` is what follows the
committed history plus ``d1..di``. For a window that starts an epoch (inputs ``[c, d1..dk]``)
the vector is the window's own predictions, one per input row. For a continuation chunk (inputs
``[e1..em]``, right after the previous chunk of the same epoch) the first entry comes from the
previous chunk's last prediction (its *boundary*): :func:`compose_target_predictions` builds
``[boundary] + predictions[:m]``.

:func:`accept_window` walks the drafts: while ``d_{i+1} == t_i`` the draft is accepted; at the
first mismatch the target's own token ``t_i`` is committed as the correction and the window is
rejected; when every draft matches, the bonus token ``t_k`` is committed too. Generation stops at
the first committed end-of-generation token or when the remaining budget is used up, whichever
comes first. Every committed token is an entry of the verdict vector, never a draft, so the
committed output is exactly what plain decoding of the target would produce.

The verdict's kind follows the original's classic classifier: FULL_ACCEPT (every draft matched),
ACCEPTED_STOP (an accepted token ended generation before the window's end), TAIL_REJECT (the last
draft was wrong), EARLY_REJECT (an earlier draft was wrong) and EARLY_REJECT_STOP (a draft was
wrong and the correction ended generation). :class:`SpeculationStats` tallies verdicts for a
request's ``speculative_*`` timings.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence

import attrs

from .._errors import VerifyWindowError


class VerdictKind(enum.Enum):
    """How a verify window ended (the original's classic classification)."""

    FULL_ACCEPT = "full_accept"
    ACCEPTED_STOP = "accepted_stop"
    TAIL_REJECT = "tail_reject"
    EARLY_REJECT = "early_reject"
    EARLY_REJECT_STOP = "early_reject_stop"


_REJECTED = frozenset(
    {VerdictKind.TAIL_REJECT, VerdictKind.EARLY_REJECT, VerdictKind.EARLY_REJECT_STOP}
)


@attrs.frozen
class Verdict:
    """What one verify window commits.

    Attributes:
        kind: the classification.
        tokens: the committed tokens, all the target's own (may end in an EOG token).
        accepted: how many drafts matched the target before the first mismatch or stop.
        stop: whether generation ends with the last committed token (EOG or budget).
    """

    kind: VerdictKind
    tokens: tuple[int, ...]
    accepted: int
    stop: bool

    @property
    def rejected(self) -> bool:
        """Whether a draft was wrong (the last committed token is the target's correction)."""
        return self.kind in _REJECTED


@attrs.frozen
class SpeculationStats:
    """Verification counters of one request (stale windows are not counted here)."""

    windows: int = 0
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0
    full_accept_windows: int = 0
    accepted_stop_windows: int = 0
    tail_reject_windows: int = 0
    early_reject_windows: int = 0
    early_reject_stop_windows: int = 0
    width: int = 0
    # Per draft position within a window (index 0 = first draft): how often a draft was
    # proposed there, and how often it was accepted.
    proposed_by_position: tuple[int, ...] = ()
    accepted_by_position: tuple[int, ...] = ()

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def accept_rate_by_position(self) -> tuple[float, ...]:
        return tuple(
            a / p if p else 0.0
            for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=True)
        )

    def observe(self, verdict: Verdict, proposed: int) -> SpeculationStats:
        """These counters with one more verified window of ``proposed`` drafts."""
        kind = f"{verdict.kind.value}_windows"
        size = max(len(self.proposed_by_position), proposed)
        by_proposed = list(self.proposed_by_position) + [0] * (
            size - len(self.proposed_by_position)
        )
        by_accepted = list(self.accepted_by_position) + [0] * (
            size - len(self.accepted_by_position)
        )
        for i in range(proposed):
            by_proposed[i] += 1
        for i in range(min(verdict.accepted, proposed)):
            by_accepted[i] += 1
        return attrs.evolve(
            self,
            windows=self.windows + 1,
            proposed=self.proposed + proposed,
            accepted=self.accepted + verdict.accepted,
            rejected=self.rejected + verdict.rejected,
            proposed_by_position=tuple(by_proposed),
            accepted_by_position=tuple(by_accepted),
            **{kind: getattr(self, kind) + 1},
        )


def speculation_timings(stats: SpeculationStats) -> dict[str, int | float | list[float]]:
    """The ``speculative_*`` entries of a response's ``timings`` map."""
    return {
        "speculative_windows": stats.windows,
        "speculative_proposed_n": stats.proposed,
        "speculative_accepted_n": stats.accepted,
        "speculative_rejected_n": stats.rejected,
        "speculative_accept_rate": stats.accept_rate,
        "speculative_accept_rate_by_position": list(stats.accept_rate_by_position),
    }


def compose_target_predictions(
    boundary: int, predictions: Sequence[int], proposal_len: int
) -> tuple[int, ...]:
    """The verdict vector of a continuation chunk: ``[boundary] + predictions[:proposal_len]``.

    Raises:
        VerifyWindowError: fewer than ``proposal_len`` predictions came back.
    """
    if len(predictions) < proposal_len:
        raise VerifyWindowError(
            f"verify window returned too few tokens: {len(predictions)} predictions for a "
            f"continuation of {proposal_len} drafts"
        )
    return (boundary, *predictions[:proposal_len])


def accept_window(
    proposal: Sequence[int],
    target: Sequence[int],
    *,
    remaining: int,
    eog: Collection[int] = (),
) -> Verdict:
    """Decide what a window with drafts ``proposal`` commits, given the verdict vector ``target``.

    Args:
        proposal: the drafts ``d1..dk`` (may be empty: a plain decode step).
        target: ``t0..tk``, exactly one more token than ``proposal``.
        remaining: how many tokens generation may still commit (at least 1).
        eog: end-of-generation token ids.

    Raises:
        VerifyWindowError: ``target`` does not hold ``len(proposal) + 1`` tokens.
        ValueError: ``remaining`` is below 1.
    """
    if len(target) != len(proposal) + 1:
        few = "few" if len(target) <= len(proposal) else "many"
        raise VerifyWindowError(
            f"verify window returned too {few} tokens: {len(target)} target tokens for "
            f"{len(proposal)} drafts (expected {len(proposal) + 1})"
        )
    if remaining < 1:
        raise ValueError(f"remaining token budget must be at least 1, got {remaining}")
    for index, draft in enumerate(proposal):
        token = target[index]
        ends = token in eog or index + 1 >= remaining
        if draft != token:
            if ends:
                kind = VerdictKind.EARLY_REJECT_STOP
            elif index == len(proposal) - 1:
                kind = VerdictKind.TAIL_REJECT
            else:
                kind = VerdictKind.EARLY_REJECT
            return Verdict(kind=kind, tokens=tuple(target[: index + 1]), accepted=index, stop=ends)
        if ends:
            return Verdict(
                kind=VerdictKind.ACCEPTED_STOP,
                tokens=tuple(target[: index + 1]),
                accepted=index + 1,
                stop=True,
            )
    bonus = target[-1]
    return Verdict(
        kind=VerdictKind.FULL_ACCEPT,
        tokens=tuple(target),
        accepted=len(proposal),
        stop=bonus in eog or len(target) >= remaining,
    )
