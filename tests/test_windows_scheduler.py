"""VerifyWindowScheduler: the original's nine unit tests, ported, plus errors and epochs."""

from __future__ import annotations

import pytest

from stagerun._decide import (
    MAX_VERIFY_WINDOW_DEPTH,
    VerifyWindowScheduler,
    response_timings,
    telemetry_attributes,
)
from stagerun._errors import ProtocolError, VerifyWindowError

# --- ported from verify_window_scheduler.rs ----------------------------------------------------


def test_records_preferred_and_reverse_direct_return_paths() -> None:
    preferred = VerifyWindowScheduler(2)
    preferred.mark_direct_prediction_return(True)
    stats = preferred.stats(0.0)
    assert stats.direct_prediction_return
    assert stats.direct_prediction_return_upstream_opened
    assert not stats.direct_prediction_return_reverse_fallback

    reverse = VerifyWindowScheduler(2)
    reverse.mark_direct_prediction_return(False)
    timings = response_timings(reverse.stats(0.0))
    assert timings["verify_window_direct_prediction_return_reverse_fallback"] is True
    assert timings["verify_window_direct_prediction_return_upstream_opened"] is False


def test_bounds_depth_and_requires_fifo_reply_ids() -> None:
    scheduler = VerifyWindowScheduler(2)
    first = scheduler.open(10, 0, now_ms=0.0)
    second = scheduler.open(11, 1, now_ms=0.0)
    with pytest.raises(VerifyWindowError):
        scheduler.open(12, 2, now_ms=0.0)
    with pytest.raises(VerifyWindowError):
        scheduler.complete_next(second.id, now_ms=0.0)
    assert scheduler.in_flight_len() == 2
    assert scheduler.complete_next(first.id, now_ms=0.0) == first
    assert scheduler.complete_next(second.id, now_ms=0.0) == second
    assert first.id == 1
    stats = scheduler.stats(0.0)
    assert stats.depth == 2
    assert stats.opened_windows == 2
    assert stats.max_in_flight == 2
    assert not stats.direct_prediction_return


def test_depth_nine_keeps_the_first_window_restorable() -> None:
    scheduler = VerifyWindowScheduler(9)
    windows = [scheduler.open(10 + step, step, now_ms=0.0) for step in range(9)]
    assert scheduler.in_flight_len() == 9
    with pytest.raises(VerifyWindowError):
        scheduler.open(19, 9, now_ms=0.0)
    assert scheduler.stats(0.0).max_in_flight == 9
    for window in windows:
        assert scheduler.complete_next(window.id, now_ms=0.0) == window
    assert scheduler.in_flight_len() == 0


def test_discards_stale_windows_after_divergence() -> None:
    scheduler = VerifyWindowScheduler(3)
    for step in range(3):
        scheduler.open(10 + step, step, now_ms=0.0)
    assert scheduler.discard_stale(now_ms=0.0) == 3
    assert scheduler.in_flight_len() == 0
    assert scheduler.stats(0.0).stale_discarded == 3


def test_stale_recovery_tracks_marked_and_completed_work_separately() -> None:
    scheduler = VerifyWindowScheduler(3)
    first = scheduler.open(10, 0, now_ms=0.0)
    second = scheduler.open(11, 1, now_ms=0.0)
    third = scheduler.open(12, 2, now_ms=0.0)
    scheduler.complete_next(first.id, now_ms=0.0)
    scheduler.mark_recovery_epoch(2)
    scheduler.complete_next(second.id, now_ms=0.0)
    scheduler.record_stale_execution(3.0, 4.0, 5.0, 6.0, 15.0)
    scheduler.complete_next(third.id, now_ms=0.0)
    scheduler.record_stale_execution(7.0, 8.0, 9.0, 10.0, 27.0)
    stats = scheduler.stats(0.0)
    assert stats.recovery_epochs == 1
    assert stats.stale_marked == 2
    assert stats.stale_discarded == 2
    assert stats.stale_drain_ms == 10.0
    assert stats.stale_stage0_compute_ms == 12.0
    assert stats.stale_forward_write_ms == 14.0
    assert stats.stale_downstream_wait_ms == 16.0
    assert stats.stale_verify_elapsed_ms == 42.0


def test_configured_depth_is_the_fill_target() -> None:
    scheduler = VerifyWindowScheduler(8)
    assert scheduler.supports_pipelining(4)
    assert scheduler.depth == 8
    for position in range(8):
        scheduler.open(100 + position, position, now_ms=0.0)
    assert not scheduler.has_capacity()
    with pytest.raises(VerifyWindowError):
        scheduler.open(108, 8, now_ms=0.0)


def test_pipeline_depth_one_never_admits_dependent_work() -> None:
    assert not VerifyWindowScheduler(1).supports_pipelining(2)


def test_fixed_fill_counters_are_exposed_in_response_timings() -> None:
    scheduler = VerifyWindowScheduler(2)
    assert scheduler.supports_pipelining(2)
    scheduler.record_horizon_refill(7)
    scheduler.record_horizon_refill(0)
    timings = response_timings(scheduler.stats(0.0))
    assert timings["verify_window_horizon_refill_attempts"] == 2
    assert timings["verify_window_horizon_refill_successes"] == 1
    assert timings["verify_window_horizon_refill_tokens"] == 7
    assert timings["verify_window_horizon_refill_misses"] == 1
    attrs = telemetry_attributes(scheduler.stats(0.0))
    assert attrs["llama_stage.verify_window.horizon_refill_attempts"] == 2
    assert attrs["llama_stage.verify_window.horizon_refill_successes"] == 1
    assert attrs["llama_stage.verify_window.horizon_refill_tokens"] == 7
    assert attrs["llama_stage.verify_window.horizon_refill_misses"] == 1


def test_occupancy_timings_measure_parallel_and_full_depth_time() -> None:
    # The original back-dates its Instant by 2, 3 and 4 ms; here the caller owns the clock.
    scheduler = VerifyWindowScheduler(2, now_ms=100.0)
    first = scheduler.open(10, 0, now_ms=102.0)
    second = scheduler.open(11, 1, now_ms=105.0)
    stats = scheduler.stats(109.0)
    assert stats.occupancy_ms_by_depth == (2.0, 3.0, 4.0)
    assert stats.occupancy_total_ms == 9.0
    assert stats.occupancy_parallel_ms == 4.0
    assert stats.occupancy_full_ms == 4.0
    assert stats.occupancy_parallel_fraction == pytest.approx(4 / 9)
    assert stats.occupancy_full_fraction == pytest.approx(4 / 9)
    assert stats.occupancy_average_in_flight == pytest.approx((3.0 + 2 * 4.0) / 9)
    assert stats.occupancy_average_in_flight > 1.0
    assert scheduler.complete_next(first.id, now_ms=110.0) == first
    assert scheduler.complete_next(second.id, now_ms=110.0) == second


# --- errors and configuration ------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, -1, MAX_VERIFY_WINDOW_DEPTH + 1, 2.0, True])
def test_depth_out_of_range_is_refused(depth: object) -> None:
    with pytest.raises(ValueError, match=r"depth must be an int in \[1, 64\]"):
        VerifyWindowScheduler(depth)  # type: ignore[arg-type]


def test_max_depth_is_accepted() -> None:
    scheduler = VerifyWindowScheduler(MAX_VERIFY_WINDOW_DEPTH)
    for step in range(MAX_VERIFY_WINDOW_DEPTH):
        scheduler.open(step, step, now_ms=0.0)
    assert not scheduler.has_capacity()


def test_error_messages_name_the_state() -> None:
    scheduler = VerifyWindowScheduler(2)
    with pytest.raises(
        VerifyWindowError, match="verify window reply arrived with no in-flight window: got 5"
    ):
        scheduler.complete_next(5, now_ms=0.0)
    scheduler.open(10, 0, now_ms=0.0)
    scheduler.open(11, 1, now_ms=0.0)
    with pytest.raises(VerifyWindowError, match="verify window pipeline depth exceeded: 2 of 2"):
        scheduler.open(12, 2, now_ms=0.0)
    with pytest.raises(
        VerifyWindowError, match="verify window reply out of order: got 2, expected 1"
    ):
        scheduler.complete_next(2, now_ms=0.0)
    assert issubclass(VerifyWindowError, ProtocolError)


def test_repr_reports_live_state() -> None:
    scheduler = VerifyWindowScheduler(3)
    scheduler.open(10, 0, now_ms=0.0, epoch=1)
    scheduler.open(11, 1, now_ms=0.0, epoch=1)
    scheduler.mark_epoch_stale(1)
    assert repr(scheduler) == "<VerifyWindowScheduler depth=3 in_flight=2 stale=2 next_id=3>"


def test_response_and_telemetry_keys_are_exactly_the_originals() -> None:
    stats = VerifyWindowScheduler(4).stats(0.0)
    suffixes = [
        "depth",
        "direct_prediction_return",
        "direct_prediction_return_upstream_opened",
        "direct_prediction_return_reverse_fallback",
        "opened",
        "max_in_flight",
        "recovery_epochs",
        "stale_marked",
        "stale_discarded",
        "stale_drain_ms",
        "stale_stage0_compute_ms",
        "stale_forward_write_ms",
        "stale_downstream_wait_ms",
        "stale_verify_elapsed_ms",
        "horizon_refill_attempts",
        "horizon_refill_successes",
        "horizon_refill_tokens",
        "horizon_refill_misses",
        "occupancy_ms_by_depth",
        "occupancy_total_ms",
        "occupancy_parallel_ms",
        "occupancy_parallel_fraction",
        "occupancy_full_ms",
        "occupancy_full_fraction",
        "occupancy_average_in_flight",
    ]
    timings = response_timings(stats)
    assert list(timings) == [f"verify_window_{suffix}" for suffix in suffixes]
    assert timings["verify_window_occupancy_ms_by_depth"] == [0.0] * 5
    assert timings["verify_window_occupancy_parallel_fraction"] == 0.0
    assert sorted(telemetry_attributes(stats)) == sorted(
        f"llama_stage.verify_window.{suffix}"
        for suffix in (
            "direct_return_upstream_opened",
            "direct_return_reverse_fallback",
            "horizon_refill_attempts",
            "horizon_refill_successes",
            "horizon_refill_tokens",
            "horizon_refill_misses",
        )
    )


# --- epochs, stale windows and clocks ----------------------------------------------------------


def test_windows_carry_epoch_inputs_and_stale_flag() -> None:
    scheduler = VerifyWindowScheduler(4)
    first = scheduler.open(104, 4, now_ms=0.0, epoch=1, inputs=(10, 11, 12), proposal=(11, 12))
    second = scheduler.open(
        107, 7, now_ms=0.0, epoch=1, inputs=(13, 14), proposal=(13, 14), starts_epoch=False
    )
    assert (len(first.proposal), len(second.proposal)) == (2, 2)  # what each would advance
    assert not first.stale and first.starts_epoch and not second.starts_epoch
    scheduler.complete_next(first.id, now_ms=0.0)
    third = scheduler.open(106, 6, now_ms=0.0, epoch=2, inputs=(20,))
    marked = scheduler.mark_epoch_stale(1)
    assert [window.id for window in marked] == [second.id]
    assert all(window.stale for window in marked)
    assert [window.stale for window in scheduler.in_flight] == [True, False]
    assert scheduler.mark_epoch_stale(1) == ()  # already stale: not marked twice
    assert scheduler.in_flight[1] == third


def test_cancelled_stale_windows_are_discarded_when_a_later_reply_arrives() -> None:
    scheduler = VerifyWindowScheduler(4)
    for step in range(3):
        scheduler.open(10 + step, step, now_ms=0.0, epoch=1)
    scheduler.complete_next(1, now_ms=0.0)
    scheduler.mark_epoch_stale(1)
    scheduler.mark_recovery_epoch(2)
    live = scheduler.open(11, 1, now_ms=0.0, epoch=2)
    dropped = scheduler.discard_stale_before(live.id, now_ms=0.0)
    assert [window.id for window in dropped] == [2, 3]
    assert scheduler.complete_next(live.id, now_ms=0.0) == live
    stats = scheduler.stats(0.0)
    assert (stats.stale_marked, stats.stale_discarded) == (2, 2)
    assert (stats.opened_windows, stats.completed_windows, stats.in_flight) == (4, 4, 0)


def test_discard_stale_before_never_skips_a_live_window() -> None:
    scheduler = VerifyWindowScheduler(3)
    scheduler.open(10, 0, now_ms=0.0)
    scheduler.open(11, 1, now_ms=0.0)
    assert scheduler.discard_stale_before(2, now_ms=0.0) == ()
    with pytest.raises(VerifyWindowError, match="got 2, expected 1"):
        scheduler.complete_next(2, now_ms=0.0)


def test_stale_execution_clamps_negative_times() -> None:
    scheduler = VerifyWindowScheduler(2)
    scheduler.record_stale_execution(-1.0, -2.0, 3.0, -4.0, -5.0)
    stats = scheduler.stats(0.0)
    assert stats.stale_discarded == 1
    assert (stats.stale_drain_ms, stats.stale_stage0_compute_ms) == (0.0, 0.0)
    assert (stats.stale_forward_write_ms, stats.stale_downstream_wait_ms) == (3.0, 0.0)
    assert stats.stale_verify_elapsed_ms == 0.0


def test_a_clock_going_backwards_counts_no_time() -> None:
    scheduler = VerifyWindowScheduler(2, now_ms=50.0)
    scheduler.open(10, 0, now_ms=40.0)
    assert scheduler.stats(45.0).occupancy_total_ms == 0.0
    assert scheduler.stats(60.0).occupancy_ms_by_depth == (0.0, 10.0, 0.0)


def test_cancelled_windows_leave_the_fifo_wherever_they_are() -> None:
    scheduler = VerifyWindowScheduler(4, now_ms=0.0)
    for step in range(3):
        scheduler.open(10 + step, step, now_ms=0.0, epoch=1)
    scheduler.complete_next(1, now_ms=1.0)
    scheduler.mark_epoch_stale(1)
    scheduler.mark_recovery_epoch(2)
    live = scheduler.open(11, 1, now_ms=2.0, epoch=2)
    dropped = scheduler.discard_cancelled([3, 2, 99], now_ms=4.0)  # 99: already gone, ignored
    assert [window.id for window in dropped] == [2, 3]
    assert scheduler.in_flight == (live,)
    assert scheduler.discard_cancelled([2], now_ms=4.0) == ()
    stats = scheduler.stats(4.0)
    assert (stats.stale_discarded, stats.completed_windows, stats.in_flight) == (2, 3, 1)
    assert stats.occupancy_ms_by_depth == (0.0, 0.0, 1.0, 3.0, 0.0)


def test_a_cancellation_of_a_live_window_is_refused() -> None:
    scheduler = VerifyWindowScheduler(2)
    scheduler.open(10, 0, now_ms=0.0)
    with pytest.raises(VerifyWindowError, match="cancelled window 1, which is not stale"):
        scheduler.discard_cancelled([1], now_ms=0.0)
    assert scheduler.in_flight_len() == 1
