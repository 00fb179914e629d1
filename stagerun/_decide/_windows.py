"""The verify-window scheduler: the FIFO of speculative windows a request keeps in flight.

Theory of operation
-------------------
A *verify window* is one traversal of the pipeline by a contiguous span of tokens (a base token
and draft tokens, or a continuation chunk of drafts). Stage 0 may keep up to ``depth`` windows in
flight at once so the hops of one window overlap the compute of the next; depth 1 is serial
decoding and never pipelines. ``depth`` is the request's configured depth, bounded by
:data:`MAX_VERIFY_WINDOW_DEPTH`: the scheduler never holds more, stale windows included. How
many live windows an adaptive request keeps below it is the speculation policy's decision
(`SpeculationPolicy.window_limit` in ``_pace``), not the scheduler's.

Window ids start at 1 and grow by one per :meth:`~VerifyWindowScheduler.open`; replies must come
back in the order the windows were opened (:meth:`~VerifyWindowScheduler.complete_next` checks
the reply against the oldest window). Every window carries the *epoch* (optimistic branch) it
belongs to and a *stale* flag: after a divergence :meth:`~VerifyWindowScheduler.mark_epoch_stale`
flags every later window of the epoch, and the caller counts them with
:meth:`~VerifyWindowScheduler.mark_recovery_epoch` (a divergence) or
:meth:`~VerifyWindowScheduler.mark_stale` (generation ended). Stale windows still leave the FIFO
in order: either their reply arrives and is drained (:meth:`record_stale_execution`), or the
stages dropped them on ``Cancel`` and the last stage's ``Cancelled`` lists them
(:meth:`discard_cancelled`) or a later reply proves it (:meth:`discard_stale_before`).

Occupancy accounting keeps one bucket of milliseconds per in-flight count (``depth + 1``
buckets): at every change of the in-flight count, the time since the previous change goes to the
bucket of the count that held during it. The scheduler never reads a clock: every method that
changes or reports occupancy takes ``now_ms`` from the caller (any monotonic clock in ms; a
timestamp earlier than the last one counts as no time passing), which is also what lets tests
back-date events exactly.

:func:`response_timings` and :func:`telemetry_attributes` render a :class:`VerifyWindowStats`
under the original's ``verify_window_*`` and ``llama_stage.verify_window.*`` keys.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Final, TypeAlias

import attrs

from .._errors import VerifyWindowError

MAX_VERIFY_WINDOW_DEPTH: Final = 64
"""Most windows one request may keep in flight (the original's checkpoint retention)."""


@attrs.frozen
class VerifyWindow:
    """One window in flight, as stage 0 opened it.

    Attributes:
        id: window id, from 1 in opening order; echoed by the reply.
        base_position: absolute position of ``inputs[0]``; authoritative for every stage's KV.
        decode_step: ``base_position`` minus the prompt length.
        epoch: the optimistic branch the window belongs to.
        inputs: the tokens the window feeds the model (``[c, d1..dk]`` when it starts an
            epoch, ``[d..]`` for a continuation chunk).
        proposal: the draft tokens this window verifies (``inputs[1:]`` or ``inputs``).
        starts_epoch: whether ``inputs[0]`` is the committed token that starts a branch.
        stale: set once a divergence or the end of generation made the window useless.
    """

    id: int
    base_position: int
    decode_step: int
    epoch: int = 0
    inputs: tuple[int, ...] = ()
    proposal: tuple[int, ...] = ()
    starts_epoch: bool = True
    stale: bool = False


@attrs.frozen
class VerifyWindowStats:
    """A snapshot of a scheduler's counters and occupancy (times in milliseconds).

    The ``stale_*_ms`` times are what stale windows whose reply still came cost
    (:meth:`VerifyWindowScheduler.record_stale_execution`). The speculation controller
    measures a stale window's round trip itself, as ``stale_verify_elapsed_ms``; the drain,
    stage 0 compute, forward write and downstream wait times come only from a caller that
    passes them (`WindowTimings`), and stay 0 otherwise. Windows dropped on ``Cancel`` cost 0.
    """

    depth: int
    direct_prediction_return: bool = False
    direct_prediction_return_upstream_opened: bool = False
    direct_prediction_return_reverse_fallback: bool = False
    opened_windows: int = 0
    completed_windows: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    recovery_epochs: int = 0
    stale_marked: int = 0
    stale_discarded: int = 0
    stale_drain_ms: float = 0.0
    stale_stage0_compute_ms: float = 0.0
    stale_forward_write_ms: float = 0.0
    stale_downstream_wait_ms: float = 0.0
    stale_verify_elapsed_ms: float = 0.0
    horizon_refill_attempts: int = 0
    horizon_refill_successes: int = 0
    horizon_refill_tokens: int = 0
    horizon_refill_misses: int = 0
    occupancy_ms_by_depth: tuple[float, ...] = ()
    occupancy_total_ms: float = 0.0
    occupancy_parallel_ms: float = 0.0
    occupancy_parallel_fraction: float = 0.0
    occupancy_full_ms: float = 0.0
    occupancy_full_fraction: float = 0.0
    occupancy_average_in_flight: float = 0.0


@attrs.define
class _Tally:
    """The scheduler's running counters (copied into each stats snapshot)."""

    opened_windows: int = 0
    completed_windows: int = 0
    max_in_flight: int = 0
    recovery_epochs: int = 0
    stale_marked: int = 0
    stale_discarded: int = 0
    stale_drain_ms: float = 0.0
    stale_stage0_compute_ms: float = 0.0
    stale_forward_write_ms: float = 0.0
    stale_downstream_wait_ms: float = 0.0
    stale_verify_elapsed_ms: float = 0.0
    horizon_refill_attempts: int = 0
    horizon_refill_successes: int = 0
    horizon_refill_tokens: int = 0
    horizon_refill_misses: int = 0


def _fraction(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


class VerifyWindowScheduler:
    """The FIFO of one request's verify windows, with the original's counters.

    Args:
        depth: windows kept in flight at most, in ``[1, MAX_VERIFY_WINDOW_DEPTH]``.
        now_ms: the time occupancy accounting starts from.

    Raises:
        ValueError: ``depth`` is out of range.
    """

    def __init__(self, depth: int, *, now_ms: float = 0.0) -> None:
        if type(depth) is not int or not 1 <= depth <= MAX_VERIFY_WINDOW_DEPTH:
            raise ValueError(
                f"verify window pipeline depth must be an int in [1, {MAX_VERIFY_WINDOW_DEPTH}], "
                f"got {depth!r}"
            )
        self._depth = depth
        self._next_id = 1
        self._in_flight: deque[VerifyWindow] = deque()
        self._occupancy = [0.0] * (depth + 1)
        self._changed_ms = now_ms
        self._tally = _Tally()
        self._direct_return: bool | None = None

    def __repr__(self) -> str:
        stale = sum(window.stale for window in self._in_flight)
        return (
            f"<VerifyWindowScheduler depth={self._depth} in_flight={len(self._in_flight)} "
            f"stale={stale} next_id={self._next_id}>"
        )

    # --- state ---------------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """The configured depth: the most windows in flight, stale ones included."""
        return self._depth

    @property
    def in_flight(self) -> tuple[VerifyWindow, ...]:
        """The windows awaiting a reply, oldest first."""
        return tuple(self._in_flight)

    def in_flight_len(self) -> int:
        return len(self._in_flight)

    def has_capacity(self) -> bool:
        return len(self._in_flight) < self._depth

    def supports_pipelining(self, width: int) -> bool:
        """Whether windows of ``width`` drafts may overlap: depth above 1 and a non-empty width."""
        return self._depth > 1 and width > 0

    # --- opening and completing ----------------------------------------------------------------

    def open(
        self,
        base_position: int,
        decode_step: int,
        *,
        now_ms: float,
        epoch: int = 0,
        inputs: tuple[int, ...] = (),
        proposal: tuple[int, ...] = (),
        starts_epoch: bool = True,
    ) -> VerifyWindow:
        """Open the next window at the back of the FIFO and return it.

        Raises:
            VerifyWindowError: ``depth`` windows are already in flight.
        """
        if not self.has_capacity():
            raise VerifyWindowError(
                f"verify window pipeline depth exceeded: {len(self._in_flight)} of "
                f"{self._depth} windows in flight, next id {self._next_id}"
            )
        window = VerifyWindow(
            id=self._next_id,
            base_position=base_position,
            decode_step=decode_step,
            epoch=epoch,
            inputs=tuple(inputs),
            proposal=tuple(proposal),
            starts_epoch=starts_epoch,
        )
        self._next_id += 1
        self._record_occupancy(now_ms)
        self._in_flight.append(window)
        self._tally.opened_windows += 1
        self._tally.max_in_flight = max(self._tally.max_in_flight, len(self._in_flight))
        return window

    def complete_next(self, window_id: int, *, now_ms: float) -> VerifyWindow:
        """Take the oldest window out of the FIFO for its reply ``window_id``.

        Raises:
            VerifyWindowError: nothing is in flight, or the reply is not for the oldest window.
        """
        self._check_reply(window_id, 0)
        self._record_occupancy(now_ms)
        self._tally.completed_windows += 1
        return self._in_flight.popleft()

    def peek_reply(self, window_id: int) -> VerifyWindow:
        """The window a reply for ``window_id`` completes, past the stale windows before it.

        Changes nothing; :meth:`discard_stale_before` then :meth:`complete_next` carry it out.

        Raises:
            VerifyWindowError: as :meth:`complete_next` would, once the stale windows are gone.
        """
        skip = 0
        for window in self._in_flight:
            if not (window.stale and window.id < window_id):
                break
            skip += 1
        return self._check_reply(window_id, skip)

    def _check_reply(self, window_id: int, skip: int) -> VerifyWindow:
        if len(self._in_flight) <= skip:
            raise VerifyWindowError(
                f"verify window reply arrived with no in-flight window: got {window_id}, "
                f"next id {self._next_id}"
            )
        window = self._in_flight[skip]
        if window_id != window.id:
            raise VerifyWindowError(
                f"verify window reply out of order: got {window_id}, expected {window.id} "
                f"({len(self._in_flight) - skip} in flight)"
            )
        return window

    def discard_stale_before(self, window_id: int, *, now_ms: float) -> tuple[VerifyWindow, ...]:
        """Drop the stale windows ahead of ``window_id``: the stages cancelled them.

        Replies travel in FIFO order, so a reply for ``window_id`` proves that no reply will come
        for the stale windows opened before it. Stops at the first live window (whose reply must
        still arrive, and which :meth:`complete_next` will then insist on).
        """
        dropped: list[VerifyWindow] = []
        while self._in_flight and self._in_flight[0].stale and self._in_flight[0].id < window_id:
            self._record_occupancy(now_ms)
            dropped.append(self._in_flight.popleft())
        self._tally.completed_windows += len(dropped)
        self.record_stale_discarded(len(dropped), 0.0)
        return tuple(dropped)

    def discard_cancelled(
        self, window_ids: Sequence[int], *, now_ms: float
    ) -> tuple[VerifyWindow, ...]:
        """Drop the windows the last stage says it will never answer (its ``Cancelled``).

        Ids no longer in flight are ignored (already accounted for).

        Raises:
            VerifyWindowError: a listed window is live: only stale windows are ever cancelled.
        """
        listed = set(window_ids)
        dropped = tuple(window for window in self._in_flight if window.id in listed)
        live = [window.id for window in dropped if not window.stale]
        if live:
            raise VerifyWindowError(
                f"the last stage cancelled window {live[0]}, which is not stale "
                f"(in flight: {[window.id for window in self._in_flight]})"
            )
        if dropped:
            self._record_occupancy(now_ms)
            self._in_flight = deque(w for w in self._in_flight if w.id not in listed)
            self._tally.completed_windows += len(dropped)
            self.record_stale_discarded(len(dropped), 0.0)
        return dropped

    def discard_stale(self, *, now_ms: float) -> int:
        """Give up on every window in flight (end of a request); returns how many."""
        discarded = len(self._in_flight)
        self._record_occupancy(now_ms)
        self._in_flight.clear()
        self._tally.completed_windows += discarded
        self.record_stale_discarded(discarded, 0.0)
        return discarded

    # --- staleness and recovery ----------------------------------------------------------------

    def mark_epoch_stale(self, epoch: int) -> tuple[VerifyWindow, ...]:
        """Flag every live in-flight window of ``epoch`` as stale; return them (now stale).

        Counting is left to the caller: :meth:`mark_recovery_epoch` after a divergence,
        :meth:`mark_stale` when generation ends.
        """
        marked: list[VerifyWindow] = []
        for index, window in enumerate(self._in_flight):
            if window.epoch == epoch and not window.stale:
                self._in_flight[index] = attrs.evolve(window, stale=True)
                marked.append(self._in_flight[index])
        return tuple(marked)

    def mark_recovery_epoch(self, stale_count: int) -> None:
        """Count a divergence that started a new epoch and left ``stale_count`` windows stale."""
        self._tally.recovery_epochs += 1
        self.mark_stale(stale_count)

    def mark_stale(self, stale_count: int) -> None:
        self._tally.stale_marked += max(stale_count, 0)

    def record_stale_discarded(self, count: int, drain_ms: float) -> None:
        self._tally.stale_discarded += max(count, 0)
        self._tally.stale_drain_ms += max(drain_ms, 0.0)

    def record_stale_execution(
        self,
        drain_ms: float,
        stage0_compute_ms: float,
        forward_write_ms: float,
        downstream_wait_ms: float,
        verify_elapsed_ms: float,
    ) -> None:
        """Count one stale window whose reply was drained, with what it cost (negatives -> 0)."""
        self.record_stale_discarded(1, drain_ms)
        self._tally.stale_stage0_compute_ms += max(stage0_compute_ms, 0.0)
        self._tally.stale_forward_write_ms += max(forward_write_ms, 0.0)
        self._tally.stale_downstream_wait_ms += max(downstream_wait_ms, 0.0)
        self._tally.stale_verify_elapsed_ms += max(verify_elapsed_ms, 0.0)

    # --- other counters ------------------------------------------------------------------------

    def mark_direct_prediction_return(self, upstream_opened: bool) -> None:
        """Record how predictions reach stage 0: a return path it opened, or a reverse dial."""
        self._direct_return = upstream_opened

    def record_horizon_refill(self, appended_tokens: int) -> None:
        """Count one attempt to extend the optimistic horizon with more drafts."""
        self._tally.horizon_refill_attempts += 1
        if appended_tokens <= 0:
            self._tally.horizon_refill_misses += 1
            return
        self._tally.horizon_refill_successes += 1
        self._tally.horizon_refill_tokens += appended_tokens

    # --- reporting -----------------------------------------------------------------------------

    def stats(self, now_ms: float) -> VerifyWindowStats:
        """A snapshot, with the interval since the last change counted up to ``now_ms``."""
        buckets = list(self._occupancy)
        buckets[len(self._in_flight)] += max(now_ms - self._changed_ms, 0.0)
        total = sum(buckets)
        parallel = sum(buckets[2:])
        full = buckets[self._depth]
        weighted = sum(count * ms for count, ms in enumerate(buckets))
        direct = self._direct_return
        return VerifyWindowStats(
            depth=self._depth,
            direct_prediction_return=direct is not None,
            direct_prediction_return_upstream_opened=direct is True,
            direct_prediction_return_reverse_fallback=direct is False,
            in_flight=len(self._in_flight),
            occupancy_ms_by_depth=tuple(buckets),
            occupancy_total_ms=total,
            occupancy_parallel_ms=parallel,
            occupancy_parallel_fraction=_fraction(parallel, total),
            occupancy_full_ms=full,
            occupancy_full_fraction=_fraction(full, total),
            occupancy_average_in_flight=_fraction(weighted, total),
            **attrs.asdict(self._tally),
        )

    def _record_occupancy(self, now_ms: float) -> None:
        self._occupancy[len(self._in_flight)] += max(now_ms - self._changed_ms, 0.0)
        self._changed_ms = max(now_ms, self._changed_ms)


TimingValue: TypeAlias = bool | int | float | list[float]
"""A value of a timings or telemetry map (JSON-ready)."""

# The original's insert_response_timings keys follow the stats fields in order, named after
# them except where the original's key differs; the two counters it lacks stay out.
_RESPONSE_FIELDS: Final = tuple(
    field.name
    for field in attrs.fields(VerifyWindowStats)
    if field.name not in {"completed_windows", "in_flight"}
)
_RESPONSE_RENAMES: Final = {"opened_windows": "opened"}

_TELEMETRY_KEYS: Final = (
    ("direct_return_upstream_opened", "direct_prediction_return_upstream_opened"),
    ("direct_return_reverse_fallback", "direct_prediction_return_reverse_fallback"),
    ("horizon_refill_attempts", "horizon_refill_attempts"),
    ("horizon_refill_successes", "horizon_refill_successes"),
    ("horizon_refill_tokens", "horizon_refill_tokens"),
    ("horizon_refill_misses", "horizon_refill_misses"),
)


def _json_ready(value: object) -> TimingValue:
    if isinstance(value, tuple):
        return list(value)
    assert isinstance(value, bool | int | float), value
    return value


def response_timings(stats: VerifyWindowStats) -> dict[str, TimingValue]:
    """The ``verify_window_*`` entries of a response's ``timings`` map."""
    return {
        f"verify_window_{_RESPONSE_RENAMES.get(field, field)}": _json_ready(getattr(stats, field))
        for field in _RESPONSE_FIELDS
    }


def telemetry_attributes(stats: VerifyWindowStats) -> dict[str, TimingValue]:
    """The ``llama_stage.verify_window.*`` attributes of a request's telemetry span."""
    return {
        f"llama_stage.verify_window.{suffix}": _json_ready(getattr(stats, field))
        for suffix, field in _TELEMETRY_KEYS
    }
