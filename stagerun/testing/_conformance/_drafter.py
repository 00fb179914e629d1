"""The drafter conformance suite (`check_drafter`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._common import _Check, _checking

_PROMPT = (5, 6, 7, 8, 9) * 2 + tuple(range(20, 30)) + (5, 6, 7, 8, 9)
_CONTINUATION = (*range(20, 30), 5, 6, *range(40, 45), 5, 6, 7, 8, 9, 20, 21, 22)
_DEFAULT_TOKENS = _PROMPT + _CONTINUATION
DEFAULT_VOCAB = 49152  # the default model's (SmolLM2)


def _proposal(check: _Check, drafter: Any, context: Sequence[int], max_tokens: int) -> list[int]:
    out = drafter.propose(list(context), max_tokens)
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        check.fail(f"propose() returned a {type(out).__name__}, not a sequence of token ids")
    for token in out:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            check.fail(f"propose() returned {token!r} among its tokens; ids are ints >= 0")
    if len(out) > max(max_tokens, 0):
        check.fail(f"propose(context, max_tokens={max_tokens}) returned {len(out)} tokens")
    return [int(t) for t in out]


def check_drafter(
    factory: Callable[[], Any],
    tokens: Sequence[int] = _DEFAULT_TOKENS,
    *,
    vocab_size: int | None = DEFAULT_VOCAB,
    unrelated: bool = True,
) -> None:
    """Check that a drafter proposes drafts the way stagerun calls it.

    Plays a request: ``begin`` with the first half of ``tokens`` as the prompt, ``commit``
    the rest in pieces, and ``propose`` after each, also with contexts that run past what was
    committed (drafts of windows still in flight). Checks that: the drafter has ``begin``,
    ``commit`` and ``propose``; ``propose`` returns a sequence (maybe empty) of at most
    ``max_tokens`` ids >= 0 (and < ``vocab_size`` if given), none for ``max_tokens=0``; two
    drafters fed the same calls propose the same, and asking twice gives the same answer;
    ``begin`` forgets the previous request (also when the next request shares nothing with
    it but its last tokens, where a kept history would find a continuation).

    Args:
        factory: ``factory()`` returns a new drafter; a lambda can pass arguments (an oracle's
            reference tokens, a draft model).
        tokens: a request's tokens, prompt then continuation; the default repeats itself so
            that lookup drafters find matches.
        vocab_size: every proposed id must be below it (default: the default model's
            vocabulary; None skips the check). A pipeline cuts a proposal at its first
            id outside the model's vocabulary, and says which drafter proposed it.
        unrelated: also play a second, unrelated request (False for a drafter that serves
            one request only, such as an oracle of one reference).

    Raises:
        AssertionError: a check failed; the message names it.
    """
    tokens = [int(t) for t in tokens]
    half = max(1, len(tokens) // 2)
    prompt, rest = tokens[:half], tokens[half:]
    with _checking("check_drafter", "interface") as check:
        drafter, twin = factory(), factory()
        _check_interface(check, drafter)
    with _checking("check_drafter", "a request") as check:
        drafter.begin(prompt)
        twin.begin(prompt)
        committed = list(prompt)
        steps = [rest[i : i + 3] for i in range(0, len(rest), 3)] or [[]]
        for piece in steps:
            for width in (0, 1, 4, 16):
                # Drafts of windows still in flight run past what was committed: right ones,
                # and wrong ones.
                right = committed + tokens[len(committed) : len(committed) + 2]
                wrong = [*committed, prompt[0], prompt[0]]
                for ctx in (committed, right, wrong):
                    _check_proposals(check, drafter, twin, ctx, width, vocab_size)
            drafter.commit(piece)
            twin.commit(piece)
            committed += piece
    with _checking("check_drafter", "begin resets the drafter") as check:
        _check_begin_resets(check, drafter, factory(), prompt[: max(1, len(prompt) - 3)])
        # an unrelated request that ends like the first began: a drafter that kept the
        # first request's history finds a continuation there, a fresh one has none
        if unrelated:
            bound = vocab_size or DEFAULT_VOCAB
            other = [(t * 7 + 101) % bound for t in prompt[:4]] + prompt[:3]
            used = factory()
            used.begin(prompt)
            used.commit(rest)
            _check_begin_resets(check, used, factory(), other)


def _check_interface(check: _Check, drafter: Any) -> None:
    """The drafter has ``begin``, ``commit`` and ``propose``, and bool flags if any."""
    for method in ("begin", "commit", "propose"):
        if not callable(getattr(drafter, method, None)):
            check.fail(f"{drafter!r} has no {method}()")
    for flag in ("blocking", "per_request"):
        value = getattr(drafter, flag, True)
        if not isinstance(value, bool):
            check.fail(f"its {flag} is {value!r}, not a bool")


def _check_proposals(
    check: _Check,
    drafter: Any,
    twin: Any,
    ctx: Sequence[int],
    width: int,
    vocab_size: int | None,
) -> None:
    """``propose(ctx, width)`` is well formed, and the same when asked again or of ``twin``."""
    first = _proposal(check, drafter, ctx, width)
    if width == 0 and first:
        check.fail(f"propose(context, max_tokens=0) returned {first}")
    if vocab_size is not None and any(t >= vocab_size for t in first):
        check.fail(f"propose() returned ids >= the vocab size {vocab_size}: {first}")
    again = _proposal(check, drafter, ctx, width)
    other = _proposal(check, twin, ctx, width)
    if again != first or other != first:
        check.fail(
            f"not deterministic: the same propose() gave {first}, then {again}, "
            f"and {other} from a second drafter fed the same calls"
        )


def _check_begin_resets(check: _Check, drafter: Any, fresh: Any, short: Sequence[int]) -> None:
    """After ``begin(short)`` a used drafter proposes what a ``fresh`` one does."""
    drafter.begin(short)
    fresh.begin(short)
    for width in (1, 4, 16):
        got, want = (
            _proposal(check, drafter, short, width),
            _proposal(check, fresh, short, width),
        )
        if got != want:
            check.fail(
                f"after begin() a used drafter proposed {got}, a fresh one {want}: "
                "begin() must forget the previous request"
            )
