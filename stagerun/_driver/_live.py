"""What stage 0 keeps of its latest requests for the web page's live timeline.

Theory of operation: a request records its own life as it runs (`LiveRequest`): when it
began and ended, each verify window it opened and how that window settled, each recovery.
`RequestLog` holds the records of the requests running and of the last `KEEP_FINISHED` that
ended, so the page can show the request in flight (or the one that just ended) without
holding anything per request once it is gone. Every list is bounded (`MAX_WINDOWS`,
`MAX_RECOVERIES`); times are `time.perf_counter_ns` readings, the clock `StageWork` spans
are mapped onto. Requests are numbered in the order they began (`LiveRequest.number`): the
page shows that number, never the request's wire id.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Final, Literal

import attrs

__all__ = ["KEEP_FINISHED", "LiveRequest", "LiveWindow", "RequestLog"]

KEEP_FINISHED: Final = 8
MAX_WINDOWS: Final = 256  # the latest windows of one request
MAX_RECOVERIES: Final = 32

Outcome = Literal["open", "verified", "stale", "cancelled"]


@attrs.define
class LiveWindow:
    """A verify window: opened at ``opened_ns``; settled at ``settled_ns`` (0 while open)
    as ``outcome``, with ``accepted`` of its ``drafts`` drafts taken. ``attempt``: the
    recoveries before it (each attempt numbers its windows from 1 again)."""

    window_id: int
    opened_ns: int
    drafts: int
    attempt: int = 0
    settled_ns: int = 0
    outcome: Outcome = "open"
    accepted: int = 0


@attrs.define(eq=False)
class LiveRequest:
    """One request's record, written by the request as it runs (see the module docstring)."""

    request_id: int
    number: int = 0  # given by the `RequestLog` it is entered in
    started_ns: int = attrs.field(factory=time.perf_counter_ns)
    ended_ns: int = 0  # 0 while it runs
    windows: collections.deque[LiveWindow] = attrs.field(
        factory=lambda: collections.deque(maxlen=MAX_WINDOWS)
    )
    recoveries: collections.deque[int] = attrs.field(
        factory=lambda: collections.deque(maxlen=MAX_RECOVERIES)
    )
    attempts: int = 0  # recoveries so far (``recoveries`` keeps the latest moments only)
    _open: dict[int, LiveWindow] = attrs.field(factory=dict, repr=False)

    @property
    def running(self) -> bool:
        return self.ended_ns == 0

    def opened(self, window_id: int, drafts: int) -> None:
        """Window ``window_id`` was sent with ``drafts`` drafts."""
        window = LiveWindow(window_id, time.perf_counter_ns(), drafts, self.attempts)
        self.windows.append(window)
        self._open[window_id] = window

    def settled(self, window_ids: tuple[int, ...], outcome: Outcome, accepted: int = 0) -> None:
        """The windows ``window_ids`` settled: ``verified`` (``accepted`` drafts taken),
        ``stale`` (its answer came after an earlier window diverged), ``cancelled``."""
        now = time.perf_counter_ns()
        for window_id in window_ids:
            window = self._open.pop(window_id, None)
            if window is not None:
                window.settled_ns, window.outcome, window.accepted = now, outcome, accepted
        if len(self._open) > MAX_WINDOWS:  # windows that never settled (a recovery)
            for window_id in sorted(self._open)[: len(self._open) - MAX_WINDOWS]:
                del self._open[window_id]

    def recovered(self) -> None:
        """The request's lane failed and it recovered on another: the windows it had in
        flight there are lost (``cancelled``), and the next attempt numbers its own."""
        now = time.perf_counter_ns()
        for window in self._open.values():
            window.settled_ns, window.outcome = now, "cancelled"
        self._open.clear()
        self.recoveries.append(now)
        self.attempts += 1


class RequestLog:
    """The `LiveRequest` of every running request and of the last `KEEP_FINISHED` ended."""

    def __init__(self) -> None:
        self._running: dict[int, LiveRequest] = {}
        self._finished: collections.deque[LiveRequest] = collections.deque(maxlen=KEEP_FINISHED)
        self._numbers = itertools.count(1)

    def __repr__(self) -> str:
        return f"<RequestLog running={len(self._running)} finished={len(self._finished)}>"

    def begin(self, record: LiveRequest) -> None:
        """Enter a request's record, as it starts; it runs until `end`."""
        record.number, record.started_ns = next(self._numbers), time.perf_counter_ns()
        self._running[record.request_id] = record

    def end(self, record: LiveRequest) -> None:
        if self._running.pop(record.request_id, None) is record:
            record.ended_ns = time.perf_counter_ns()
            self._finished.append(record)

    def latest(self) -> LiveRequest | None:
        """The request that began last among those running, else the one that ended last."""
        if self._running:
            return max(self._running.values(), key=lambda r: r.started_ns)
        return self._finished[-1] if self._finished else None
