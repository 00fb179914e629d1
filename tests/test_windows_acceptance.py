"""The acceptance rule (every classification, EOG, budget), then what the controller commits.

The original's classic classifier tests are ported with one change: our verdict vector carries
the bonus token as its last entry, so a full accept commits ``k + 1`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagerun._decide import (
    Commit,
    Finish,
    NewEpoch,
    SpeculationController,
    Verdict,
    VerdictKind,
    VerifyWindow,
    accept_window,
    compose_target_predictions,
    speculation_timings,
)
from stagerun._errors import VerifyWindowError

FULL, STOP = VerdictKind.FULL_ACCEPT, VerdictKind.ACCEPTED_STOP
TAIL, EARLY, EARLY_STOP = (
    VerdictKind.TAIL_REJECT,
    VerdictKind.EARLY_REJECT,
    VerdictKind.EARLY_REJECT_STOP,
)


def test_full_accept_commits_drafts_and_bonus() -> None:
    verdict = accept_window([10, 11, 12], [10, 11, 12, 13], remaining=16)
    assert verdict == Verdict(kind=FULL, tokens=(10, 11, 12, 13), accepted=3, stop=False)
    assert not verdict.rejected


def test_tail_reject_commits_the_correction() -> None:
    verdict = accept_window([10, 11, 12], [10, 11, 42, 99], remaining=16)
    assert verdict == Verdict(kind=TAIL, tokens=(10, 11, 42), accepted=2, stop=False)
    assert verdict.rejected


def test_early_reject_commits_the_correction() -> None:
    verdict = accept_window([10, 11, 12, 13], [10, 42, 77, 88, 99], remaining=16)
    assert verdict == Verdict(kind=EARLY, tokens=(10, 42), accepted=1, stop=False)
    assert verdict.rejected


def test_reject_at_the_first_draft() -> None:
    verdict = accept_window([10, 11], [5, 6, 7], remaining=16)
    assert verdict == Verdict(kind=EARLY, tokens=(5,), accepted=0, stop=False)


def test_accepted_eog_stops_there() -> None:
    verdict = accept_window([10, 99, 12], [10, 99, 12, 13], remaining=16, eog={99})
    assert verdict == Verdict(kind=STOP, tokens=(10, 99), accepted=2, stop=True)
    assert not verdict.rejected


def test_early_reject_at_the_budget_stops() -> None:
    # The original: 2 generated of 4, so 2 tokens remain.
    verdict = accept_window([10, 11, 12], [10, 42, 77, 88], remaining=2)
    assert verdict == Verdict(kind=EARLY_STOP, tokens=(10, 42), accepted=1, stop=True)
    assert verdict.rejected


def test_a_correction_that_is_eog_stops_even_at_the_tail() -> None:
    verdict = accept_window([10, 11], [10, 99, 7], remaining=16, eog={99})
    assert verdict == Verdict(kind=EARLY_STOP, tokens=(10, 99), accepted=1, stop=True)


def test_budget_reached_on_an_accepted_draft_stops_before_the_bonus() -> None:
    assert accept_window([1, 2, 3], [1, 2, 3, 4], remaining=2) == Verdict(
        kind=STOP, tokens=(1, 2), accepted=2, stop=True
    )
    assert accept_window([1, 2, 3], [1, 2, 3, 4], remaining=3) == Verdict(
        kind=STOP, tokens=(1, 2, 3), accepted=3, stop=True
    )


def test_bonus_that_fills_the_budget_or_ends_generation_stops() -> None:
    assert accept_window([1, 2], [1, 2, 3], remaining=3) == Verdict(
        kind=FULL, tokens=(1, 2, 3), accepted=2, stop=True
    )
    assert accept_window([1, 2], [1, 2, 0], remaining=9, eog={0}) == Verdict(
        kind=FULL, tokens=(1, 2, 0), accepted=2, stop=True
    )


def test_no_drafts_is_a_plain_decode_step() -> None:
    assert accept_window([], [7], remaining=5) == Verdict(
        kind=FULL, tokens=(7,), accepted=0, stop=False
    )
    assert accept_window([], [7], remaining=1).stop


def test_an_eog_draft_the_target_rejects_does_not_stop() -> None:
    verdict = accept_window([99, 5], [4, 5, 6], remaining=9, eog={99})
    assert verdict == Verdict(kind=EARLY, tokens=(4,), accepted=0, stop=False)


@pytest.mark.parametrize(
    ("target", "word"), [([10, 11], "few"), ([], "few"), ([10, 11, 12, 13, 14], "many")]
)
def test_reply_of_the_wrong_length_is_refused(target: list[int], word: str) -> None:
    with pytest.raises(VerifyWindowError, match=f"verify window returned too {word} tokens"):
        accept_window([10, 11, 12], target, remaining=16)


def test_budget_must_leave_room_for_a_token() -> None:
    with pytest.raises(ValueError, match="at least 1, got 0"):
        accept_window([1], [1, 2], remaining=0)


def test_compose_target_predictions_prepends_the_boundary() -> None:
    assert compose_target_predictions(13, [14, 15, 16], 3) == (13, 14, 15, 16)
    assert compose_target_predictions(13, [14, 15, 16, 17], 3) == (13, 14, 15, 16)
    with pytest.raises(VerifyWindowError, match="too few tokens: 2 predictions"):
        compose_target_predictions(13, [14, 15], 3)


@given(
    pairs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=8),
    bonus=st.integers(0, 3),
    remaining=st.integers(1, 10),
    eog=st.frozensets(st.integers(0, 3), max_size=1),
)
def test_committed_tokens_are_always_the_targets_own(
    pairs: list[tuple[int, int]], bonus: int, remaining: int, eog: frozenset[int]
) -> None:
    proposal = [draft for draft, _ in pairs]
    target = [token for _, token in pairs] + [bonus]
    verdict = accept_window(proposal, target, remaining=remaining, eog=eog)
    tokens = verdict.tokens
    assert 1 <= len(tokens) <= min(remaining, len(target))
    assert list(tokens) == target[: len(tokens)]
    assert list(proposal[: verdict.accepted]) == target[: verdict.accepted]
    assert not any(token in eog for token in tokens[:-1])
    assert verdict.stop == (tokens[-1] in eog or len(tokens) == remaining)
    assert verdict.rejected == (verdict.accepted < len(tokens) and verdict.kind is not FULL)
    if verdict.rejected:
        assert len(tokens) == verdict.accepted + 1
        assert proposal[verdict.accepted] != tokens[-1]


# --- the controller, scenario by scenario ---------------------------------------------------------


def _controller(depth: int = 2, width: int = 2, adaptive: bool = False) -> SpeculationController:
    history = [1] * 100 + [5, 6, 7, 8, 10]  # prefill 100, then 5 generated; c = 10 at 104
    return SpeculationController(
        history, prompt_len=100, max_tokens=64, depth=depth, width=width, adaptive=adaptive
    )


def _open(controller: SpeculationController, drafts: Sequence[int]) -> VerifyWindow:
    send = controller.open_window(drafts, now_ms=0.0)
    assert send is not None
    return send.window


def test_window_layout_epoch_start_then_continuation() -> None:
    controller = _controller()
    request = controller.next_draft_request()
    assert request is not None and request.starts_epoch and request.max_drafts == 2
    first = _open(controller, [11, 12])
    assert (first.base_position, first.decode_step, first.inputs) == (104, 4, (10, 11, 12))
    assert (first.proposal, first.epoch, first.starts_epoch) == ((11, 12), 1, True)
    request = controller.next_draft_request()
    assert request is not None and not request.starts_epoch
    assert request.context[-3:] == (10, 11, 12) and request.position == 107
    second = _open(controller, [13, 14, 15])  # drafts beyond max_drafts are ignored
    assert (second.base_position, second.decode_step, second.inputs) == (107, 7, (13, 14))
    assert not second.starts_epoch and second.epoch == 1
    assert controller.next_draft_request() is None  # depth 2 is full


def test_full_accept_keeps_the_boundary_for_the_next_chunk() -> None:
    controller = _controller()
    _open(controller, [11, 12])
    _open(controller, [13, 14])
    assert controller.on_predictions(1, [11, 12, 13], now_ms=1.0) == [Commit(1, (11, 12))]
    assert controller.on_predictions(2, [14, 20], now_ms=2.0) == [Commit(2, (13, 14, 20))]
    assert controller.generated[-5:] == (11, 12, 13, 14, 20)
    stats = controller.stats()
    assert (stats.windows, stats.proposed, stats.accepted, stats.full_accept_windows) == (
        2,
        4,
        4,
        2,
    )


def test_divergence_cancels_later_windows_and_restarts_the_epoch() -> None:
    controller = _controller(depth=3)
    for drafts in ([11, 12], [13, 14], [15, 16]):
        _open(controller, drafts)
    commands = controller.on_predictions(1, [11, 40, 41], now_ms=1.0)
    assert commands[0] == Commit(1, (11, 40))
    assert isinstance(commands[1], NewEpoch)
    assert commands[1].cancel_window_ids == (2, 3)
    assert (commands[1].stale_epoch, commands[1].epoch, commands[1].restart_position) == (1, 2, 106)
    assert "window 1 diverged at position 106 (epoch 1)" in commands[1].reason
    new = _open(controller, [42])
    assert (new.base_position, new.inputs, new.epoch, new.starts_epoch) == (106, (40, 42), 2, True)
    assert controller.on_predictions(2, [0, 0], now_ms=2.0) == []  # stale reply: consumed
    # window 3 was dropped by Cancel: window 4's reply proves it
    assert controller.on_predictions(4, [42, 43], now_ms=3.0) == [Commit(4, (42, 43))]
    stats = controller.scheduler.stats(3.0)
    assert (stats.recovery_epochs, stats.stale_marked, stats.stale_discarded) == (1, 2, 2)
    assert (stats.opened_windows, stats.completed_windows) == (4, 4)


def test_cancelled_reply_accounts_for_windows_the_stages_dropped() -> None:
    controller = _controller(depth=3)
    for drafts in ([11, 12], [13, 14], [15, 16]):
        _open(controller, drafts)
    controller.on_predictions(1, [11, 40, 41], now_ms=0.0)  # windows 2 and 3 go stale
    assert controller.on_predictions(2, [0, 0], now_ms=0.0) == []  # answered before the Cancel
    assert controller.on_cancelled([2, 3], now_ms=0.0) == (3,)  # 2 was already accounted for
    assert controller.finish("cancelled")[0] == Finish(
        reason="cancelled", epoch=1, cancel_window_ids=(), pending_window_ids=()
    )
    assert controller.drained


def test_full_accept_whose_bonus_the_next_chunk_missed_starts_a_new_epoch() -> None:
    controller = _controller()
    _open(controller, [11, 12])
    _open(controller, [13, 14])
    commands = controller.on_predictions(1, [11, 12, 30], now_ms=1.0)
    assert commands[0] == Commit(1, (11, 12, 30))
    assert isinstance(commands[1], NewEpoch) and commands[1].cancel_window_ids == (2,)


def test_finish_marks_everything_stale_and_late_replies_are_consumed() -> None:
    controller = _controller(depth=3)
    _open(controller, [11, 12])
    _open(controller, [13, 14])
    assert controller.on_predictions(1, [11, 12, 13], now_ms=0.0) == [Commit(1, (11, 12))]
    assert controller.finish("stop") == [
        Finish(reason="stop", epoch=1, cancel_window_ids=(2,), pending_window_ids=(2,))
    ]
    assert controller.finish("cancelled") == []
    assert controller.next_draft_request() is None
    with pytest.raises(VerifyWindowError, match="no verify window may open now"):
        controller.open_window([1], now_ms=0.0)
    assert controller.on_predictions(2, [13, 14], now_ms=0.0) == []
    assert controller.scheduler.stats(0.0).stale_discarded == 1


def test_eog_and_budget_finish_generation() -> None:
    controller = SpeculationController([3, 4], prompt_len=1, max_tokens=4, eog={9}, depth=2)
    assert controller.next_draft_request().max_drafts == 2  # type: ignore[union-attr]
    _open(controller, [5, 9])
    assert controller.on_predictions(1, [5, 9, 1], now_ms=0.0) == [
        Commit(1, (5, 9)),
        Finish(reason="eog", epoch=1, cancel_window_ids=(), pending_window_ids=()),
    ]
    assert controller.generated == (4, 5, 9) and controller.finish_reason == "eog"
    short = SpeculationController([3, 4], prompt_len=1, max_tokens=2, depth=2, width=4)
    assert short.next_draft_request().max_drafts == 0  # type: ignore[union-attr]
    _open(short, [])
    assert short.on_predictions(1, [6], now_ms=0.0)[-1] == Finish(
        reason="length", epoch=1, cancel_window_ids=(), pending_window_ids=()
    )
    assert SpeculationController([3, 9], prompt_len=1, max_tokens=5, eog={9}).finished
    assert SpeculationController([3, 4], prompt_len=1, max_tokens=1).finish_reason == "length"


def test_horizon_miss_pauses_filling_until_the_next_reply() -> None:
    controller = _controller(depth=3)
    _open(controller, [11, 12])
    assert controller.open_window([], now_ms=0.0) is None
    assert controller.next_draft_request() is None
    controller.on_predictions(1, [11, 12, 13], now_ms=0.0)
    assert controller.next_draft_request() is not None
    _open(controller, [14])
    _open(controller, [15])
    stats = controller.scheduler.stats(0.0)
    assert (stats.horizon_refill_attempts, stats.horizon_refill_misses) == (2, 1)
    assert (stats.horizon_refill_successes, stats.horizon_refill_tokens) == (1, 1)


def test_replies_that_break_the_pipeline_are_refused() -> None:
    controller = _controller()
    _open(controller, [11, 12])
    _open(controller, [13, 14])
    with pytest.raises(VerifyWindowError, match="verify window pipeline depth exceeded"):
        controller.scheduler.open(0, 0, now_ms=0.0)
    with pytest.raises(VerifyWindowError, match="out of order: got 2, expected 1"):
        controller.on_predictions(2, [1, 2], now_ms=0.0)
    with pytest.raises(VerifyWindowError, match=r"window 1 \(epoch 1, position 104\) returned 2"):
        controller.on_predictions(1, [11, 12], now_ms=0.0)
    assert [w.id for w in controller.scheduler.in_flight] == [
        1,
        2,
    ]  # a refused reply changes nothing
    assert controller.generated == (5, 6, 7, 8, 10)
    fresh = _controller()
    with pytest.raises(VerifyWindowError, match="no in-flight window: got 9"):
        fresh.on_predictions(9, [1], now_ms=0.0)


def test_adaptive_width_shrinks_on_early_reject_and_grows_back() -> None:
    controller = _controller(depth=1, width=3, adaptive=True)
    _open(controller, [11, 12, 13])
    controller.on_predictions(1, [30, 31, 32, 33], now_ms=0.0)
    assert controller.width == 2
    _open(controller, [31, 32])
    controller.on_predictions(2, [31, 32, 33], now_ms=0.0)
    assert controller.width == 3 and controller.stats().width == 3


def test_speculation_timings_and_repr() -> None:
    controller = _controller()
    _open(controller, [11, 12])
    controller.on_predictions(1, [11, 40, 41], now_ms=0.0)
    assert speculation_timings(controller.stats()) == {
        "speculative_windows": 1,
        "speculative_proposed_n": 2,
        "speculative_accepted_n": 1,
        "speculative_rejected_n": 1,
        "speculative_accept_rate": 0.5,
        "speculative_accept_rate_by_position": [1.0, 0.0],
    }
    assert repr(controller) == (
        "<SpeculationController epoch=1 generated=7/64 in_flight=0 stale=0 width=2 finished=None>"
    )
    # a second window, fully accepted: position 1 has now been accepted once in two tries
    _open(controller, [41, 42, 43][: controller.width])
    controller.on_predictions(2, [41, 42, 43, 44][: controller.width + 1], now_ms=0.0)
    by_position = controller.stats().accept_rate_by_position
    assert by_position[0] == 1.0 and by_position[1] == 0.5


def test_constructor_refuses_a_history_without_a_generated_token() -> None:
    with pytest.raises(ValueError, match="first generated token"):
        SpeculationController([1, 2], prompt_len=2, max_tokens=4)
    with pytest.raises(ValueError, match="depth must be an int"):
        SpeculationController([1, 2], prompt_len=1, max_tokens=4, depth=0)
