"""Drawing for ``stagerun bench --png``: the stage timeline and the hop-delay sweep.

What is drawn is built in `stagerun._cli._report` from telemetry alone; this module only
draws it. It needs matplotlib (``pip install 'stagerun[plot]'``), imported on first use, on
the file-only Agg backend.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import StagerunError
from ._report import COLOURS, KINDS, Kind, RequestsTimeline, Timeline

__all__ = ["plot_hop_sweep", "plot_requests_timeline", "plot_timeline", "require_matplotlib"]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        StagerunError: matplotlib is not installed (it is the optional ``plot`` extra).
    """
    try:
        import matplotlib
    except ImportError:
        raise StagerunError(
            "writing a PNG needs matplotlib: pip install 'stagerun[plot]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(timeline: Timeline, path: str | pathlib.Path, *, title: str = "") -> None:
    """One row per stage: compute, forward writes, waiting and stale work, in milliseconds."""
    plt = require_matplotlib()
    height = 1.5 + 0.55 * timeline.stages
    figure, axes = plt.subplots(figsize=(11, height), dpi=120, layout="constrained")
    try:
        for kind in KINDS:
            for stage in range(timeline.stages):
                bars = [
                    (s.start_ms, s.ms)
                    for s in timeline.segments
                    if s.stage == stage and s.kind == kind
                ]
                if bars:
                    axes.broken_barh(
                        bars, (stage - 0.38, 0.76), facecolors=COLOURS[kind], linewidth=0
                    )
        axes.set_yticks(range(timeline.stages))
        axes.set_yticklabels([f"stage {i}" for i in range(timeline.stages)])
        axes.invert_yaxis()
        axes.set_xlim(timeline.start_ms, timeline.start_ms + timeline.elapsed_ms)
        axes.set_xlabel("milliseconds since the request began")
        totals = timeline.totals()
        stale = sum(row["stale"] for row in totals)
        axes.set_title(
            title
            or f"request {timeline.request_id}: {timeline.windows} verify windows, "
            f"{timeline.stale_windows} stale ({stale:.0f} ms of stale compute)",
            fontsize=10,
        )
        handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in KINDS]
        figure.legend(handles, KINDS, loc="outside lower center", ncol=4, frameon=False)
        figure.savefig(path)
    finally:
        plt.close(figure)


def plot_requests_timeline(
    shared: RequestsTimeline, path: str | pathlib.Path, *, title: str = ""
) -> None:
    """Per stage a group of rows, one per request in its colour, on the requests' common clock.

    Compute is solid, forward writes pale, stale work hatched and waiting grey. Bars that line
    up across a stage's rows are one tick computing those requests together.
    """
    plt = require_matplotlib()
    n, stages = len(shared.timelines), shared.stages
    pitch = n + 0.6  # a stage's rows, then a gap before the next stage's
    row_inches = min(0.3, 14 / (stages * pitch))
    figure, axes = plt.subplots(
        figsize=(11, 1.8 + row_inches * stages * pitch), dpi=120, layout="constrained"
    )
    colours = shared.colours()
    try:
        for row, timeline in enumerate(shared.timelines):
            for stage in range(stages):
                _draw_row(axes, timeline, stage, stage * pitch + row, colours[timeline.request_id])
        busy = shared.busy_fractions()
        axes.set_yticks([stage * pitch + (n - 1) / 2 for stage in range(stages)])
        axes.set_yticklabels([f"stage {i}\n{busy[i]:.0%} busy" for i in range(stages)])
        for stage in range(1, stages):
            axes.axhline(stage * pitch - 0.8, color="#808080", linewidth=0.6)
        axes.invert_yaxis()
        axes.set_xlim(0, shared.elapsed_ms)
        axes.set_xlabel("milliseconds since the first request began")
        axes.set_title(title or f"{n} requests, {stages} stages", fontsize=10)
        handles = [
            plt.Rectangle((0, 0), 1, 1, color=colours[t.request_id]) for t in shared.timelines
        ]
        labels = [f"request {t.request_id}" for t in shared.timelines]
        handles += [plt.Rectangle((0, 0), 1, 1, **_style(k, "#404040")) for k in KINDS]
        labels += ["compute", "write (pale)", "wait", "stale (hatched)"]
        columns = 1 + len(labels) // 24  # a column beside the rows, however long the ids
        figure.legend(handles, labels, loc="outside right upper", ncol=columns, frameon=False)
        figure.savefig(path)
    finally:
        plt.close(figure)


def _style(kind: Kind, colour: str) -> dict[str, Any]:
    """How a segment of ``kind`` is drawn in its request's ``colour``; waiting is always grey."""
    if kind == "wait":
        return {"facecolor": COLOURS["wait"]}
    extra: dict[str, dict[str, Any]] = {
        "write": {"alpha": 0.4},
        "stale": {"hatch": "////", "edgecolor": "white"},
    }
    return {"facecolor": colour, **extra.get(kind, {})}


def _draw_row(axes: Any, timeline: Timeline, stage: int, y: float, colour: str) -> None:
    """``timeline``'s segments on ``stage`` as one row of bars at ``y``, in ``colour``."""
    for kind in KINDS:
        bars = [
            (s.start_ms, s.ms) for s in timeline.segments if s.stage == stage and s.kind == kind
        ]
        if bars:
            axes.broken_barh(bars, (y - 0.4, 0.8), linewidth=0, **_style(kind, colour))


def plot_hop_sweep(
    sweep: Sequence[Mapping[str, Any]], path: str | pathlib.Path, *, title: str = ""
) -> None:
    """Tokens/s against hop delay, a line per configuration (plain, depth 1, depth D...).

    ``sweep``: one ``{"hop_delay_ms": ..., "tokens_per_second": {name: rate}}`` per delay.
    """
    plt = require_matplotlib()
    rows = sorted(sweep, key=lambda row: row["hop_delay_ms"])
    delays = [row["hop_delay_ms"] for row in rows]
    names = list(rows[0]["tokens_per_second"])
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120, layout="constrained")
    try:
        for name in names:
            rates = [row["tokens_per_second"][name] for row in rows]
            style = "--" if name == "always_wrong" else "-"
            axes.plot(delays, rates, style, marker="o", label=_config_label(name, names))
        axes.set_xticks(delays)
        axes.set_xlabel("emulated delay per hop (ms)")
        axes.set_ylabel("tokens/s")
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend(frameon=False)
        axes.set_title(title or "decode throughput against hop delay", fontsize=10)
        figure.savefig(path)
    finally:
        plt.close(figure)


def _config_label(name: str, names: Sequence[str]) -> str:
    """``depth4`` -> ``speculative, depth 4``; ``always_wrong`` names the depth it ran at."""
    depths = [int(n.removeprefix("depth")) for n in names if n.removeprefix("depth").isdigit()]
    if name == "plain":
        return "plain decoding"
    if name == "always_wrong":
        return f"depth {max(depths, default=1)}, drafts always wrong"
    if name.startswith("depth"):
        return f"speculative, depth {name.removeprefix('depth')}"
    return name
