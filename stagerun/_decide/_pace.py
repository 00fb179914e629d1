"""How fast and how deep one request speculates: pace against plain decoding, adaptive depth.

Pure bookkeeping over timestamps and counters that the caller passes in; no clock is read here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ._verdict import SpeculationStats

# Drafting stops for a request, after this many windows with drafts, when its acceptance is
# below ADAPTIVE_MIN_ACCEPT_RATE or it commits tokens slower than PACE_MARGIN times the measured
# rate of plain decoding (see PaceCheck).
ADAPTIVE_MIN_WINDOWS = 4
ADAPTIVE_MIN_ACCEPT_RATE = 0.15
PACE_MARGIN = 1.1


class PaceCheck:
    """Whether speculation is measured slower than plain decoding for one request.

    A plain decoding step costs one round trip of a one-token window, and no window costs
    less, so the shortest window round trip seen in the request stands for it. Speculation is
    slower when the tokens committed per millisecond since the first window opened fall below
    ``PACE_MARGIN`` tokens per shortest round trip.
    """

    def __init__(self) -> None:
        self._opened: dict[int, float] = {}
        self.first_opened_ms: float | None = None
        self.shortest_round_trip_ms = math.inf

    def opened(self, window_id: int, now_ms: float) -> None:
        self._opened[window_id] = now_ms
        if self.first_opened_ms is None:
            self.first_opened_ms = now_ms

    def replied(self, window_id: int, now_ms: float) -> None:
        opened = self._opened.pop(window_id, None)
        if opened is not None:
            self.shortest_round_trip_ms = min(self.shortest_round_trip_ms, now_ms - opened)

    def forget(self, window_ids: Sequence[int]) -> None:
        for window_id in window_ids:
            self._opened.pop(window_id, None)

    def slower_than_plain(self, committed: int, now_ms: float) -> bool:
        if self.first_opened_ms is None or math.isinf(self.shortest_round_trip_ms):
            return False
        elapsed = now_ms - self.first_opened_ms
        return committed * self.shortest_round_trip_ms < PACE_MARGIN * elapsed


# Adaptive requests start narrow and shallow and earn width and depth with accepted drafts:
# a window that is wrong from its first draft costs little, and no continuation windows are
# drafted behind a branch that keeps diverging (they would only go stale).
ADAPTIVE_INITIAL_WIDTH = 2


# Adaptive depth: a continuation window pays only if every window ahead of it is accepted in
# full. Its chance is estimated as p**k (p: the request's full-accept rate, an EWMA over
# windows that carried drafts, starting from PRIOR), and a window opens while that chance is at
# least MIN_CHAIN_PROBABILITY.
FULL_ACCEPT_PRIOR = 0.7
FULL_ACCEPT_EWMA_ALPHA = 0.3
MIN_CHAIN_PROBABILITY = 0.2


class DepthControl:
    """How many live windows an adaptive request may keep in flight (pure bookkeeping).

    With the prior (p = 0.5) a request starts at depth 3; windows accepted in full raise the
    estimate and the depth (p = 0.8 allows 7), rejections lower it to 1. Without ``adaptive``
    the configured depth always applies.
    """

    def __init__(self, depth: int, *, adaptive: bool) -> None:
        self.max_depth = depth
        self.adaptive = adaptive
        self.full_accept_rate = FULL_ACCEPT_PRIOR
        self.allowed = self._depth_for(self.full_accept_rate) if adaptive else depth

    def _depth_for(self, p: float) -> int:
        allowed, chance = 1, p
        while allowed < self.max_depth and chance >= MIN_CHAIN_PROBABILITY:
            allowed += 1
            chance *= p
        return allowed

    def observe(self, before: SpeculationStats, after: SpeculationStats) -> None:
        """Take the windows verified between two snapshots of the request's counters."""
        if not self.adaptive or after.proposed == before.proposed:
            return  # nothing verified, or a window without drafts (a plain step)
        judged = after.windows - before.windows
        full = after.full_accept_windows - before.full_accept_windows
        for i in range(judged):
            outcome = 1.0 if i < full else 0.0
            self.full_accept_rate += FULL_ACCEPT_EWMA_ALPHA * (outcome - self.full_accept_rate)
        self.allowed = self._depth_for(self.full_accept_rate)


# Under load, speculation competes for the stages' compute: a drafted row that is rejected is
# a row another request's token could have used. Below LOAD_SPECULATE_FULLY of stage 0's time
# busy, the stages have compute to spare and speculation runs as configured; from
# LOAD_SPECULATE_NEVER on, every row is taken and drafting stops; in between it shrinks.
LOAD_SPECULATE_FULLY = 0.5
LOAD_SPECULATE_NEVER = 0.9


def speculation_share(busy: float) -> float:
    """The share of its depth and drafts a request may use when stage 0 is ``busy`` (0..1)."""
    if busy <= LOAD_SPECULATE_FULLY:
        return 1.0
    if busy >= LOAD_SPECULATE_NEVER:
        return 0.0
    return (LOAD_SPECULATE_NEVER - busy) / (LOAD_SPECULATE_NEVER - LOAD_SPECULATE_FULLY)


def under_load(allowed: int, share: float) -> int:
    """``allowed`` (a depth, or drafts per window) cut to ``share``; at least one of a depth
    is kept by the caller, a share of 0 gives 0."""
    if share <= 0.0:
        return 0
    return max(1, math.floor(allowed * share + 0.5))
