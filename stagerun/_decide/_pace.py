"""How deep and how wide one request speculates, and whether it drafts at all.

The speculation policy of one request, owned by its `SpeculationController`: adaptive depth
(`DepthControl`), pace against plain decoding (`PaceCheck`), the share of depth and drafts left
under load (`speculation_share`, `under_load`), and the switch-off of drafting that doesn't
pay, all gathered in `SpeculationPolicy`. Pure bookkeeping over timestamps, readings and
counters that the caller passes in; no clock is read here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from ._verdict import SpeculationStats

# Drafting stops for a request, after this many windows with drafts, when its acceptance is
# below ADAPTIVE_MIN_ACCEPT_RATE or it commits tokens slower than PACE_MARGIN times the measured
# rate of plain decoding (see PaceCheck).
ADAPTIVE_MIN_WINDOWS = 4
ADAPTIVE_MIN_ACCEPT_RATE = 0.15
PACE_MARGIN = 1.1
PACE_TRIPS = 64  # the latest round trips a plain step's cost is read from (`PaceCheck`)


class PaceCheck:
    """Whether speculation is measured slower than plain decoding for one request.

    A plain decoding step costs one round trip of a one-token window, and no window costs
    much less, so a short round trip of the request's windows stands for it: the first quartile
    of its last `PACE_TRIPS` (one in four, two in eight, ... are shorter; the shortest of fewer
    than four). Not the shortest: the stages' load moves the round trips, and requests that
    start together see a few of 110-130 ms while the pipeline fills, then 300 ms once it is
    full; against the shortest, 13 of 16 such requests over 20 ms links judged their drafting
    slower than plain and switched it off, then took 14-16 s for 64 tokens where the others
    took 4-8. Speculation is slower when the tokens committed since the first window come
    slower than ``PACE_MARGIN`` tokens per such round trip.
    """

    def __init__(self) -> None:
        self._opened: dict[int, float] = {}
        self.first_opened_ms: float | None = None
        self.shortest_round_trip_ms = math.inf  # of the whole request (reported)
        self._trips: deque[float] = deque(maxlen=PACE_TRIPS)

    def opened(self, window_id: int, now_ms: float) -> None:
        self._opened[window_id] = now_ms
        if self.first_opened_ms is None:
            self.first_opened_ms = now_ms

    def replied(self, window_id: int, now_ms: float) -> float | None:
        """Take a reply for ``window_id``; return its round trip (None for a window not seen)."""
        opened = self._opened.pop(window_id, None)
        if opened is None:
            return None
        round_trip = now_ms - opened
        self.shortest_round_trip_ms = min(self.shortest_round_trip_ms, round_trip)
        self._trips.append(round_trip)
        return round_trip

    def forget(self, window_ids: Sequence[int]) -> None:
        for window_id in window_ids:
            self._opened.pop(window_id, None)

    def plain_step_ms(self) -> float:
        """What a plain step is taken to cost: the first quartile of the recent round trips,
        the shortest of fewer than four (infinite before the first reply)."""
        if not self._trips:
            return math.inf
        return sorted(self._trips)[len(self._trips) // 4]

    def slower_than_plain(self, committed: int, now_ms: float) -> bool:
        plain_ms = self.plain_step_ms()
        if self.first_opened_ms is None or math.isinf(plain_ms):
            return False
        elapsed = now_ms - self.first_opened_ms
        return committed * plain_ms < PACE_MARGIN * elapsed


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

    The depth is the most windows ``k`` (up to the configured depth) for which the chance that
    every window ahead of the last one is accepted in full, ``p**(k-1)``, is still at least
    ``MIN_CHAIN_PROBABILITY``. With the prior (p = 0.7) a request starts at depth 5 (p = 0.5
    allows 3, p = 0.8 allows 8); windows accepted in full raise the estimate and the depth,
    rejections lower it, to 1 once p falls below 0.2. Without ``adaptive`` the configured depth
    always applies.
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


class SpeculationPolicy:
    """One request's speculation policy: depth, drafts per window, and whether it drafts.

    The `SpeculationController` owns it and feeds it: every window opened and every reply (for
    the pace), every judged window (for the depth), and each load reading. Without
    ``adaptive`` the configured depth and width always apply and drafting never stops.

    Args:
        depth: the configured depth (windows in flight at most).
        adaptive: let depth follow acceptance and load, and switch off drafting that doesn't pay.
        generated: tokens generated before the first window (the pace counts those after).
    """

    def __init__(self, depth: int, *, adaptive: bool, generated: int = 0) -> None:
        self.adaptive = adaptive
        self.depth = DepthControl(depth, adaptive=adaptive)
        self.pace = PaceCheck()
        self.share = 1.0
        self.drafting = True
        self._generated_at_start = generated

    def __repr__(self) -> str:
        return (
            f"<SpeculationPolicy adaptive={self.adaptive} allowed={self.depth.allowed} "
            f"share={self.share:.2f} window_limit={self.window_limit()} "
            f"drafting={self.drafting}>"
        )

    def window_limit(self) -> int:
        """Live windows the request may keep in flight now: its depth cut to the load share,
        at least one."""
        return max(1, under_load(self.depth.allowed, self.share))

    def drafts_for(self, max_drafts: int) -> int:
        """How many drafts to ask the drafter for, for a window that may carry ``max_drafts``:
        cut to the load share; 0 once drafting is switched off (or from 90% busy on)."""
        if not self.drafting:
            return 0
        # under_load keeps at least one of anything, but a window that may carry no drafts
        # (the budget's last token) gets none: the drafter is not asked for them.
        return min(max_drafts, under_load(max_drafts, self.share))

    def observe_load(self, busy: float) -> None:
        """Take a reading of how busy stage 0 has been lately (0..1); adaptive requests only."""
        self.share = speculation_share(busy) if self.adaptive else 1.0

    def observe_windows(self, before: SpeculationStats, after: SpeculationStats) -> None:
        """Take the windows judged between two snapshots of the request's counters."""
        self.depth.observe(before, after)

    def judge_drafting(self, stats: SpeculationStats, generated: int, now_ms: float) -> bool:
        """Switch drafting off for good once it is measured not to pay; True if it is still on.

        After ``ADAPTIVE_MIN_WINDOWS`` windows with drafts, drafting stops when the accept rate
        is below ``ADAPTIVE_MIN_ACCEPT_RATE`` or the tokens committed since the first window
        (``generated`` counts all of them) come slower than plain decoding (`PaceCheck`).
        """
        if self.drafting and self._not_paying(stats, generated, now_ms):
            self.drafting = False  # plain decoding through one-token windows from now on
        return self.drafting

    def _not_paying(self, stats: SpeculationStats, generated: int, now_ms: float) -> bool:
        if not self.adaptive or sum(stats.proposed_by_position[:1]) < ADAPTIVE_MIN_WINDOWS:
            return False
        committed = generated - self._generated_at_start
        return stats.accept_rate < ADAPTIVE_MIN_ACCEPT_RATE or self.pace.slower_than_plain(
            committed, now_ms
        )
