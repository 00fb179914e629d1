"""The live timeline of the web page's pipeline view: one request's work on every stage.

Theory of operation: stage 0 keeps a record of each of its latest requests
(`stagerun._driver._live.LiveRequest`: its verify windows as they open and settle, its
recoveries), and every stage, stage 0 included, a ring of its latest computes
(`stagerun._engine._recent.RecentWork`), which a probe naming the request brings back on stage
0's clock (`StageWork`). `timeline` joins the two into the document the page draws: per stage
the request's computes (a verify window's work drawn as stale on every stage once stage 0
knows it went stale or was cancelled; a recovery starts the window numbers again, so a
compute is matched with the windows of the attempt it ran in), its windows from sent to
settled, its recoveries. All times are milliseconds before the snapshot (negative), over the
last `HORIZON_MS` of the request at most; each list is bounded by the records it comes from.
The request is shown by its number on this server, never by its wire id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from .._driver._live import LiveRequest
from .._driver._values import StageHealth

__all__ = ["HORIZON_MS", "WASTED", "recent_batches", "timeline"]

#: How much of a request the timeline shows: its last this many milliseconds.
HORIZON_MS: Final = 10_000.0
#: Window outcomes whose work was wasted on every stage.
WASTED: Final = frozenset({"stale", "cancelled"})
_KINDS: Final = ("compute", "stale")


def _ms(ns: int, now_ns: int) -> float:
    return round((ns - now_ns) / 1e6, 3)


def timeline(
    record: LiveRequest | None, health: Sequence[StageHealth], now_ns: int
) -> dict[str, Any] | None:
    """The timeline of ``record``'s request as of ``now_ns`` (see the module docstring), from
    the stages' latest probes ``health``; None without a request."""
    if record is None:
        return None
    end_ns = record.ended_ns or now_ns
    since_ns = max(record.started_ns, end_ns - int(HORIZON_MS * 1e6))
    wasted = {(w.attempt, w.window_id) for w in record.windows if w.outcome in WASTED}

    def attempt(at_ns: int) -> int:  # which attempt a compute that began then was part of
        return record.attempts - sum(1 for r in record.recoveries if r > at_ns)

    stages: list[list[list[Any]]] = []
    for stage in health:
        spans = stage.work.spans if stage.work is not None else ()
        stages.append(
            [
                [
                    _ms(start, now_ns),
                    _ms(end, now_ns),
                    "stale" if window and (attempt(start), window) in wasted else _KINDS[kind],
                    window,
                    batch,
                ]
                for start, end, window, kind, batch in spans
                if end >= since_ns
            ]
        )
    windows = [
        [
            w.window_id,
            _ms(w.opened_ns, now_ns),
            _ms(w.settled_ns, now_ns) if w.settled_ns else None,
            w.outcome,
            w.drafts,
            w.accepted,
            w.attempt,
        ]
        for w in record.windows
        if (w.settled_ns or now_ns) >= since_ns
    ]
    return {
        "request": record.number,
        "running": record.running,
        "start_ms": _ms(record.started_ns, now_ns),
        "end_ms": None if record.running else _ms(record.ended_ns, now_ns),
        "since_ms": _ms(since_ns, now_ns),
        "stages": stages,
        "windows": windows,
        "recoveries": [_ms(at, now_ns) for at in record.recoveries if at >= since_ns],
    }


def recent_batches(
    before: Sequence[StageHealth] | None, after: Sequence[StageHealth]
) -> dict[int, float]:
    """Each stage's mean forwards per tick between two probes (stages that ticked)."""
    out: dict[int, float] = {}
    earlier = {h.stage.index: h.work for h in before or ()}
    for h in after:
        then, now = earlier.get(h.stage.index), h.work
        if then is None or now is None or now.ticks <= then.ticks:
            continue
        out[h.stage.index] = round((now.tick_items - then.tick_items) / (now.ticks - then.ticks), 3)
    return out
