"""The speculation controller's policy, table by table: depth, drafts, load and switch-off.

Pure tests: the controller is fed replies, load readings and times by hand, as the Trio shell
(`stagerun._driver._speculative`) feeds it; nothing here runs Trio or reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stagerun._decide import (
    Commit,
    DraftRequest,
    NewEpoch,
    SpeculationController,
    SpeculationStats,
)
from stagerun._decide._pace import (
    ADAPTIVE_MIN_WINDOWS,
    SpeculationPolicy,
    speculation_share,
    under_load,
)

PROMPT = [1] * 10


def _controller(
    *, depth: int = 8, width: int = 4, adaptive: bool = True, max_tokens: int = 200
) -> SpeculationController:
    return SpeculationController(
        [*PROMPT, 5],
        prompt_len=len(PROMPT),
        max_tokens=max_tokens,
        depth=depth,
        width=width,
        adaptive=adaptive,
    )


def _request(controller: SpeculationController) -> DraftRequest:
    request = controller.next_draft_request()
    assert request is not None
    return request


def _fill(controller: SpeculationController, now_ms: float = 0.0) -> list[DraftRequest]:
    """Open windows as the shell does, each with as many drafts as asked (all of them 7)."""
    asked: list[DraftRequest] = []
    while (request := controller.next_draft_request()) is not None:
        asked.append(request)
        if controller.open_window([7] * request.drafts, now_ms=now_ms) is None:
            break
    return asked


def _one_window(
    controller: SpeculationController, *, right: bool, opened_ms: float, replied_ms: float
) -> None:
    """One epoch-start window alone in flight, its drafts all right or the first one wrong."""
    request = _request(controller)
    assert request.starts_epoch
    c = controller.history[-1]
    drafts = [c + 1 + i for i in range(request.drafts)]
    send = controller.open_window(drafts, now_ms=opened_ms)
    assert send is not None
    window = send.window
    if right:  # the target predicts every draft, then a bonus token
        predictions = [*drafts, drafts[-1] + 1 if drafts else c + 1]
    else:  # the target disagrees from the first draft on
        predictions = [d + 100 for d in (c, *drafts)]
    commands = controller.on_predictions(window.id, predictions, now_ms=replied_ms)
    assert isinstance(commands[0], Commit)
    assert all(not isinstance(cmd, NewEpoch) or not cmd.cancel_window_ids for cmd in commands)


# --- load -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("busy", "share"),
    [(0.0, 1.0), (0.5, 1.0), (0.6, 0.75), (0.7, 0.5), (0.8, 0.25), (0.9, 0.0), (1.0, 0.0)],
)
def test_the_load_share_falls_linearly_from_half_busy_to_ninety_percent(
    busy: float, share: float
) -> None:
    assert speculation_share(busy) == pytest.approx(share)


@pytest.mark.parametrize(
    ("allowed", "share", "cut"),
    [(5, 1.0, 5), (5, 0.75, 4), (5, 0.5, 3), (5, 0.25, 1), (4, 0.125, 1), (4, 0.0, 0)],
)
def test_under_load_rounds_the_share_and_keeps_one_until_the_share_is_gone(
    allowed: int, share: float, cut: int
) -> None:
    assert under_load(allowed, share) == cut


@pytest.mark.parametrize(
    ("busy", "window_limit", "drafts", "windows_opened"),
    [
        (0.0, 5, 4, 5),  # the prior (p = 0.7) allows depth 5 of 8; the full width
        (0.5, 5, 4, 5),
        (0.6, 4, 3, 4),
        (0.7, 3, 2, 3),
        (0.8, 1, 1, 1),
        (0.95, 1, 0, 1),  # no drafts: one one-token window, which is plain decoding
    ],
)
def test_under_load_an_adaptive_request_opens_fewer_and_narrower_windows(
    busy: float, window_limit: int, drafts: int, windows_opened: int
) -> None:
    controller = _controller()
    controller.observe_load(busy, now_ms=0.0)
    assert controller.window_limit == window_limit
    asked = _fill(controller)
    assert asked[0].max_drafts == 4 and asked[0].drafts == drafts
    assert all(request.drafts == drafts for request in asked if request.drafts)
    live = [window for window in controller.scheduler.in_flight if not window.stale]
    assert len(live) == windows_opened
    assert all(len(window.proposal) == drafts for window in live)


def test_as_the_load_falls_depth_and_drafts_grow_back() -> None:
    controller = _controller()
    readings = [(0.0, 5, 4), (0.95, 1, 0), (0.7, 3, 2), (0.2, 5, 4)]
    for busy, window_limit, drafts in readings:
        controller.observe_load(busy, now_ms=0.0)
        assert (controller.window_limit, _request(controller).drafts) == (window_limit, drafts)


@pytest.mark.parametrize("adaptive", [True, False])
def test_the_drafter_is_not_asked_for_drafts_a_window_cannot_carry(adaptive: bool) -> None:
    controller = _controller(adaptive=adaptive, max_tokens=2)  # one token left to generate
    request = _request(controller)
    assert (request.max_drafts, request.drafts) == (0, 0)
    assert [(w, SpeculationPolicy(4, adaptive=adaptive).drafts_for(w)) for w in (0, 1, 3)] == [
        (0, 0),
        (1, 1),
        (3, 3),
    ]


def test_without_adaptive_the_load_changes_nothing() -> None:
    controller = _controller(depth=3, adaptive=False)
    for busy in (0.0, 0.7, 1.0):
        controller.observe_load(busy, now_ms=0.0)
        assert (controller.window_limit, _request(controller).drafts) == (3, 4)
    assert len(_fill(controller)) == 3


# --- depth ----------------------------------------------------------------------------------------


# The full-accept rate p is an EWMA (weight 0.3) starting at 0.7; the depth is the most windows
# whose chain of full accepts keeps a chance of at least 0.2 (depth 8 at most here).
DEPTH_AFTER = [
    (False, 3),  # p = 0.49
    (False, 2),  # p = 0.343
    (False, 2),  # p = 0.240
    (False, 1),  # p = 0.168: below 0.2, no continuation windows
    (True, 2),  # p = 0.418
    (True, 4),  # p = 0.592
    (True, 5),  # p = 0.715
    (True, 8),  # p = 0.800
]


def test_depth_follows_the_full_accept_rate_down_and_grows_back() -> None:
    controller = _controller(width=2)
    assert controller.window_limit == 5
    now = 0.0
    for right, window_limit in DEPTH_AFTER:
        _one_window(controller, right=right, opened_ms=now, replied_ms=now + 10.0)
        now += 10.0
        assert controller.window_limit == window_limit, (right, window_limit)


def test_a_window_without_drafts_says_nothing_about_depth() -> None:
    controller = _controller(max_tokens=200)
    controller.observe_load(0.95, now_ms=0.0)  # no drafts at all
    for step in range(3):
        _one_window(controller, right=True, opened_ms=step, replied_ms=step + 1.0)
    controller.observe_load(0.0, now_ms=3.0)
    assert controller.window_limit == 5  # still the prior's depth


def test_a_fixed_depth_stays_fixed() -> None:
    controller = _controller(depth=4, adaptive=False)
    for step in range(6):
        _one_window(controller, right=False, opened_ms=step, replied_ms=step + 1.0)
    assert controller.window_limit == 4


# --- switch-off -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcomes", "round_trips_ms", "drafting"),
    [
        # every draft wrong: the accept rate is 0, drafting stops after the 4th window
        ([False] * 3, [10.0] * 3, True),
        ([False] * 4, [10.0] * 4, False),
        # every draft right and windows as fast as a plain step: it pays
        ([True] * 8, [10.0] * 8, True),
        # every draft right but windows ten times a plain step (the first quartile of the
        # round trips): 3 tokens per 100 ms against 1.1 per 10 ms is slower than plain decoding
        ([True] * 3, [10.0, 10.0, 100.0], True),
        ([True] * 4, [10.0, 10.0, 100.0, 100.0], False),
        # ... but one short round trip among four is a lull, not a plain step
        ([True] * 4, [10.0, 100.0, 100.0, 100.0], True),
        # right half the time (accept rate 0.5 > 0.15) at the pace of plain steps: it pays
        ([True, False] * 4, [10.0] * 8, True),
    ],
)
def test_drafting_is_switched_off_after_enough_windows_that_do_not_pay(
    outcomes: Sequence[bool], round_trips_ms: Sequence[float], drafting: bool
) -> None:
    controller = _controller(depth=1, width=2)
    now = 0.0
    for right, round_trip in zip(outcomes, round_trips_ms, strict=True):
        controller.observe_load(0.0, now_ms=now)
        assert controller.drafting
        _one_window(controller, right=right, opened_ms=now, replied_ms=now + round_trip)
        now += round_trip
    controller.observe_load(0.0, now_ms=now)
    assert controller.drafting is drafting
    request = _request(controller)
    assert request.max_drafts == controller.width
    assert request.drafts == (controller.width if drafting else 0)
    timings = controller.timings(now)
    assert timings["speculative_drafting_switched_off"] is not drafting
    assert timings["speculative_shortest_window_ms"] == min(round_trips_ms)


def test_once_switched_off_drafting_stays_off() -> None:
    controller = _controller(depth=1, width=2)
    now = 0.0
    for _ in range(ADAPTIVE_MIN_WINDOWS):
        _one_window(controller, right=False, opened_ms=now, replied_ms=now + 10.0)
        now += 10.0
    controller.observe_load(0.0, now_ms=now)
    assert not controller.drafting
    for _ in range(6):  # plain steps, each accepted: drafting does not come back
        _one_window(controller, right=True, opened_ms=now, replied_ms=now + 1.0)
        now += 1.0
        controller.observe_load(0.0, now_ms=now)
        assert not controller.drafting and _request(controller).drafts == 0


def test_a_request_that_does_not_adapt_never_stops_drafting() -> None:
    controller = _controller(depth=1, width=2, adaptive=False)
    for step in range(8):
        _one_window(controller, right=False, opened_ms=step, replied_ms=step + 100.0)
        controller.observe_load(1.0, now_ms=step + 100.0)
    assert controller.drafting and _request(controller).drafts == 2


@pytest.mark.parametrize(
    ("generated", "drafting"),
    [
        (50, True),  # fewer than 4 drafted windows: no verdict yet
        (60, False),  # 10 tokens in 100 ms, where plain steps of 10 ms would give 11
        (62, True),  # 12 tokens: faster than plain
    ],
)
def test_the_pace_counts_only_tokens_committed_since_the_first_window(
    generated: int, drafting: bool
) -> None:
    policy = SpeculationPolicy(4, adaptive=True, generated=50)
    assert (policy.window_limit(), policy.drafts_for(4), policy.drafting) == (4, 4, True)
    policy.pace.opened(1, 0.0)
    assert policy.pace.replied(1, 10.0) == 10.0
    windows = ADAPTIVE_MIN_WINDOWS if generated > 50 else ADAPTIVE_MIN_WINDOWS - 1
    stats = SpeculationStats(
        windows=windows,
        proposed=windows,
        accepted=windows,
        full_accept_windows=windows,
        proposed_by_position=(windows,),
        accepted_by_position=(windows,),
    )
    assert policy.judge_drafting(stats, generated, 100.0) is drafting
    assert repr(policy) == (
        f"<SpeculationPolicy adaptive=True allowed=4 share=1.00 window_limit=4 drafting={drafting}>"
    )


# --- the start, and what stale windows cost -------------------------------------------------------


@pytest.mark.parametrize(
    ("adaptive", "width", "first_width"), [(True, 4, 2), (True, 1, 1), (False, 4, 4)]
)
def test_an_adaptive_request_starts_narrow(adaptive: bool, width: int, first_width: int) -> None:
    controller = SpeculationController.for_request(
        [*PROMPT, 5],
        prompt_len=len(PROMPT),
        max_tokens=20,
        depth=4,
        width=width,
        adaptive=adaptive,
    )
    assert controller.width == first_width
    assert _request(controller).max_drafts == first_width


def test_a_stale_windows_round_trip_is_counted_as_its_verify_time() -> None:
    controller = _controller(depth=3, width=2, adaptive=False)
    first = controller.open_window([6, 7], now_ms=0.0)
    second = controller.open_window([8, 9], now_ms=5.0)
    assert first is not None and second is not None
    commands = controller.on_predictions(first.window.id, [6, 40, 41], now_ms=20.0)
    assert isinstance(commands[-1], NewEpoch)
    assert commands[-1].cancel_window_ids == (second.window.id,)
    assert controller.on_predictions(second.window.id, [0, 0], now_ms=30.0) == []
    stats = controller.scheduler.stats(30.0)
    assert stats.stale_verify_elapsed_ms == 25.0
    assert (stats.stale_drain_ms, stats.stale_stage0_compute_ms) == (0.0, 0.0)
    assert controller.shortest_round_trip_ms == 20.0
