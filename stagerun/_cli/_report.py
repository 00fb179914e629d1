"""Pictures for ``stagerun bench --png``: a hop-delay sweep and the requests' stage timeline.

The timeline is rebuilt from ``debug`` telemetry alone (the JSON lines every process of a
pipeline appends to one trace file), so what it shows is what an operator's own trace would
show: per stage, the spans of compute (``stage.binary_llama_decode``) and of forward writes
(``stage.binary_downstream_write``); the compute of verify windows that went stale (a later
window diverged first) or was stopped mid-way, which is wasted work; and, between them, the
time the stage spent waiting for something to do while the request was open on it.

Several requests go on one time origin (`requests_timeline`). A stage computes in ticks, one
batched forward over the ready work of every request, and traces that tick once per request
it covered: the same start and end in each. So a stage's busy time is the union of its
requests' compute spans, never their sum.

Building a `Timeline` needs nothing more; drawing one (`stagerun._cli._plots`) needs matplotlib
(``pip install 'stagerun[plot]'``).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from ..telemetry import Record

__all__ = [
    "RequestsTimeline",
    "Segment",
    "Timeline",
    "finished_requests",
    "load_trace",
    "request_timeline",
    "requests_timeline",
]

Kind = Literal["compute", "write", "wait", "stale"]
KINDS: tuple[Kind, ...] = ("compute", "write", "wait", "stale")
COLOURS: Mapping[Kind, str] = {
    "compute": "#3a6ea5",
    "write": "#f0a202",
    "wait": "#d9d9d9",
    "stale": "#c0392b",
}
BUSY: tuple[Kind, ...] = ("compute", "stale")  # what a stage's busy time counts
# One colour per request, in the order the requests began; none is the grey of waiting.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
_SUMMARY = "stage.openai_generation_summary"
_REQUEST = "llama_stage.request_id"
_STAGE = "llama_stage.stage_index"


@attrs.frozen
class Segment:
    """``kind`` on ``stage`` from ``start_ms`` to ``end_ms`` after the origin of its `Timeline`."""

    stage: int
    kind: Kind
    start_ms: float
    end_ms: float

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@attrs.frozen
class Timeline:
    """One request seen from every stage.

    Times are milliseconds after an origin: the request's own start, or, among others built
    with it by `requests_timeline`, the start of the first of them. The request began
    ``start_ms`` after the origin and ran ``elapsed_ms``.
    """

    request_id: int
    stages: int
    elapsed_ms: float
    segments: tuple[Segment, ...]
    windows: int
    stale_windows: int
    tokens: int = 0  # completion tokens
    start_ms: float = 0.0

    def totals(self) -> list[dict[str, float]]:
        """Milliseconds of each kind, per stage."""
        out = [dict.fromkeys(KINDS, 0.0) for _ in range(self.stages)]
        for segment in self.segments:
            out[segment.stage][segment.kind] += segment.ms
        return [{kind: round(ms, 3) for kind, ms in row.items()} for row in out]


@attrs.frozen
class RequestsTimeline:
    """Several requests seen from every stage, on one origin: the start of the first of them.

    ``timelines`` are in the order the requests began (then by id). That order picks each
    request's colour, so the same requests are always drawn the same way.
    """

    stages: int
    elapsed_ms: float  # from the origin to the end of the last request
    timelines: tuple[Timeline, ...]

    def colours(self) -> dict[int, str]:
        """Each request's colour in the pictures, by request id (the palette repeats after 8)."""
        return {t.request_id: PALETTE[i % len(PALETTE)] for i, t in enumerate(self.timelines)}

    def busy_ms(self) -> list[float]:
        """Per stage, the time it computed for any of the requests (stale work included).

        The union of the requests' compute spans, not their sum: one tick covers several.
        """
        out = []
        for stage in range(self.stages):
            spans = sorted(
                (s.start_ms, s.end_ms)
                for t in self.timelines
                for s in t.segments
                if s.stage == stage and s.kind in BUSY
            )
            out.append(round(_union_ms(spans), 3))
        return out

    def busy_fractions(self) -> list[float]:
        """Per stage, `busy_ms` as a fraction of ``elapsed_ms``."""
        elapsed = self.elapsed_ms
        return [ms / elapsed if elapsed > 0 else 0.0 for ms in self.busy_ms()]


def _union_ms(spans: Sequence[tuple[float, float]]) -> float:
    """How long the (start, end) ``spans``, sorted by start, cover: overlaps count once."""
    total, cursor = 0.0, -math.inf
    for start, end in spans:
        if end > cursor:
            total += end - max(start, cursor)
            cursor = end
    return total


def load_trace(path: str | pathlib.Path) -> list[Record]:
    """The records of a JSON-lines trace (what `telemetry.JsonLinesSink` writes).

    Raises:
        ValueError: the file cannot be read, or a line is not a record.
    """
    records = []
    try:
        lines = open(path, encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    with lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                records.append(
                    Record(
                        raw["event"],
                        int(raw["start_time_unix_nanos"]),
                        int(raw["end_time_unix_nanos"]),
                        raw["attributes"],
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a telemetry record ({exc})") from None
    return records


def request_timeline(records: Iterable[Record], request_id: int | str | None = None) -> Timeline:
    """Build the timeline of ``request_id`` (default: the last request that finished).

    ``request_id`` is stage 0's request id (``llama_stage.request_id``, an int) or the label
    the request was given: the HTTP ``x-request-id`` of a served request
    (``stagerun.request_label``).

    A request that recovered onto a new lane (see docs/reliability.md) carries a new id from
    then on: its timeline is the stretch under the id its summary names, the last one, and
    starts where that stretch does.

    Raises:
        ValueError: the trace has no finished request, or lacks the ``debug`` spans.
    """
    records = list(records)
    summary = _pick(_summaries(records), request_id)
    request_id = int(summary.attributes[_REQUEST])
    mine = [r for r in records if r.attributes.get(_REQUEST) == request_id]
    return _timeline(summary, mine, summary.start_ns)


def requests_timeline(
    records: Iterable[Record], request_ids: Sequence[int | str] | None = None
) -> RequestsTimeline:
    """Build the timelines of ``request_ids`` (default: every finished request) on one origin.

    Each of ``request_ids`` is what `request_timeline` takes, an id or a label, and each
    `Timeline` is the one `request_timeline` builds, moved to the common origin: the start of
    the first of the requests to begin.

    Raises:
        ValueError: the trace has no finished request, lacks one of ``request_ids``, or lacks
            the ``debug`` spans.
    """
    records = list(records)
    picked = _picked(_summaries(records), request_ids)
    if not picked:
        raise ValueError("the trace holds no finished request (stage.openai_generation_summary)")
    mine: dict[int, list[Record]] = {request_id: [] for request_id in picked}
    for r in records:
        request_id = r.attributes.get(_REQUEST)
        if isinstance(request_id, int) and request_id in mine:
            mine[request_id].append(r)
    origin = min(summary.start_ns for summary in picked.values())
    timelines = sorted(
        (_timeline(summary, mine[request_id], origin) for request_id, summary in picked.items()),
        key=lambda t: (t.start_ms, t.request_id),
    )
    return RequestsTimeline(
        stages=max(t.stages for t in timelines),
        elapsed_ms=_ms(max(summary.end_ns for summary in picked.values()), origin),
        timelines=tuple(timelines),
    )


def finished_requests(records: Iterable[Record]) -> list[int]:
    """The ids of the requests that finished in the trace, in the order they finished."""
    latest = _picked(_summaries(list(records)), None)
    return sorted(latest, key=lambda request_id: latest[request_id].end_ns)


def _timeline(summary: Record, mine: Sequence[Record], origin: int) -> Timeline:
    """The timeline of the request ``summary`` closes, from its records ``mine``.

    Times are milliseconds after ``origin`` (nanoseconds): the request's start, or an earlier
    one shared with other requests.
    """
    request_id = int(summary.attributes[_REQUEST])
    stages = int(summary.attributes.get("llama_stage.stages", 1))
    windows = [r for r in mine if r.name == "stage.openai_decode_verify_window"]
    stale_ids = {
        r.attributes["llama_stage.verify_window_id"]
        for r in windows
        if r.attributes.get("llama_stage.verify_window_stale")
        or r.attributes.get("llama_stage.verify_window_cancelled")
    }
    busy = _busy(mine, stages, stale_ids, origin)
    if not any(busy):
        raise ValueError(
            f"request {request_id} has no compute spans: record the trace at the debug level"
        )
    extents = _extents(summary, mine, origin)
    opened = (_ms(summary.start_ns, origin), _ms(summary.end_ns, origin))
    segments: list[Segment] = []
    for stage, spans in enumerate(busy):
        spans.sort(key=lambda s: s.start_ms)
        segments.extend(spans)
        begin, end = extents.get(stage, opened)
        segments.extend(_gaps(stage, spans, begin, end))
    return Timeline(
        request_id=request_id,
        stages=stages,
        elapsed_ms=(summary.end_ns - summary.start_ns) / 1e6,
        segments=tuple(sorted(segments, key=lambda s: (s.stage, s.start_ms))),
        windows=len(windows),
        stale_windows=len(stale_ids),
        tokens=int(summary.attributes.get("llama_stage.completion_token_count", 0)),
        start_ms=opened[0],
    )


def _ms(ns: int, t0: int) -> float:
    """Milliseconds from ``t0`` to ``ns``."""
    return (ns - t0) / 1e6


def _summaries(records: Sequence[Record]) -> list[Record]:
    """The generation summaries in ``records``: one per finished request."""
    return [r for r in records if r.name == _SUMMARY]


def _pick(summaries: Sequence[Record], request_id: int | str | None) -> Record:
    """The summary of ``request_id`` (an id or a label), else the last to finish."""
    if request_id is not None:
        key = _REQUEST if isinstance(request_id, int) else "stagerun.request_label"
        summaries = [r for r in summaries if r.attributes.get(key) == request_id]
        if not summaries:
            raise ValueError(f"the trace holds no finished request {request_id}")
    if not summaries:
        raise ValueError("the trace holds no finished request (stage.openai_generation_summary)")
    return max(summaries, key=lambda r: r.end_ns)


def _picked(
    summaries: Sequence[Record], request_ids: Sequence[int | str] | None
) -> dict[int, Record]:
    """By request id, the summary of each of ``request_ids`` (default: every request's)."""
    latest: dict[int, Record] = {}
    for summary in sorted(summaries, key=lambda r: r.end_ns):
        latest[int(summary.attributes[_REQUEST])] = summary
    if request_ids is None:
        return latest
    picked: dict[int, Record] = {}
    for wanted in request_ids:
        found = latest.get(wanted) if isinstance(wanted, int) else None
        summary = found if found is not None else _pick(summaries, wanted)  # raises if absent
        picked[int(summary.attributes[_REQUEST])] = summary
    return picked


def _busy(mine: Sequence[Record], stages: int, stale_ids: set[Any], t0: int) -> list[list[Segment]]:
    """Per stage, the request's compute (or wasted, ``stale``) and forward-write spans."""
    busy: list[list[Segment]] = [[] for _ in range(stages)]
    for r in mine:
        stage = r.attributes.get(_STAGE)
        if not isinstance(stage, int) or not 0 <= stage < stages:
            continue
        if r.name == "stage.binary_llama_decode":
            wasted = (
                r.attributes.get("llama_stage.compute_stopped", False)
                or r.attributes.get("llama_stage.verify_window_id", -1) in stale_ids
            )
            kind: Kind = "stale" if wasted else "compute"
        elif r.name == "stage.binary_downstream_write":
            kind = "write"
        else:
            continue
        busy[stage].append(Segment(stage, kind, _ms(r.start_ns, t0), _ms(r.end_ns, t0)))
    return busy


def _extents(summary: Record, mine: Sequence[Record], t0: int) -> dict[int, tuple[float, float]]:
    """How long the request was open on each stage: stage 0's summary, the stages' own.

    After a recovery, stage 0's row starts at the first record under the final id: what came
    before (the failed lane, detection, backoff) belongs to ids this timeline doesn't show.
    """
    begin0 = summary.start_ns
    if summary.attributes.get("llama_stage.recoveries", 0):
        spanning = (_SUMMARY, "stage.openai_decode")
        begin0 = min(
            (r.start_ns for r in mine
             if r.name not in spanning and r.attributes.get(_STAGE, 0) == 0),
            default=begin0,
        )  # fmt: skip
    extents = {0: (_ms(begin0, t0), _ms(summary.end_ns, t0))}
    for r in mine:
        if r.name == "stage.binary_request_summary" and isinstance(r.attributes.get(_STAGE), int):
            extents[r.attributes[_STAGE]] = (_ms(r.start_ns, t0), _ms(r.end_ns, t0))
    return extents


def _gaps(stage: int, spans: Sequence[Segment], begin: float, end: float) -> list[Segment]:
    """The stretches of [begin, end] that no span covers: the stage's waiting."""
    gaps, cursor = [], begin
    for span in spans:
        if span.start_ms > cursor:
            gaps.append(Segment(stage, "wait", cursor, min(span.start_ms, end)))
        cursor = max(cursor, span.end_ms)
    if end > cursor:
        gaps.append(Segment(stage, "wait", cursor, end))
    return [gap for gap in gaps if gap.end_ms > gap.start_ms]
