"""Which waiting forwards one tick of a stage computes together.

A stage runs one forward at a time over every session's ready work. When a tick starts, the
forwards waiting are, in arrival order, each so many rows, each a prefill chunk or not (a
decode step or a verify window). `choose_tick` picks the tick's work under a row budget:

* the oldest waiting forward always goes (nothing waits for ever, and one larger than the
  budget runs alone);
* then decode steps and verify windows, oldest first, while they fit: a stream's next token
  never waits behind somebody's prompt;
* then prefill chunks, oldest first, while they fit: a long prompt shares ticks with the
  streams instead of stalling them.

Only each session's oldest waiting forward can go: two forwards on one session's cache never
share a tick (a tick computes its items side by side), and a session's forwards run in order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs

__all__ = ["DEFAULT_TICK_ROWS", "Waiting", "choose_tick"]

DEFAULT_TICK_ROWS = 512
"""Rows one tick computes at most (unless its oldest forward alone is larger)."""


@attrs.frozen
class Waiting:
    """What `choose_tick` knows of one waiting forward."""

    rows: int
    prefill: bool
    session: Hashable  # forwards of one session never share a tick


def choose_tick(waiting: Sequence[Waiting], budget: int = DEFAULT_TICK_ROWS) -> list[int]:
    """The indices (into ``waiting``, ascending) of the forwards the next tick computes."""
    if budget < 1:
        raise ValueError(f"a tick's row budget must be at least 1, got {budget}")
    if not waiting:
        return []
    eligible: dict[Hashable, int] = {}
    for index, item in enumerate(waiting):
        eligible.setdefault(item.session, index)  # each session's oldest
    chosen, rows = [0], waiting[0].rows
    for prefill in (False, True):
        for index in eligible.values():
            item = waiting[index]
            if index and item.prefill is prefill and rows + item.rows <= budget:
                chosen.append(index)
                rows += item.rows
    return sorted(chosen)
