"""One request on one stage: what it holds, and the compute it runs, apart from the lane.

A `Session` is what a ``Configure`` opens on a stage and a ``Stop`` ends: the backend's cache
for the request, its sampling settings, and the counts its summary span reports (`summarize`).
`check_finite` refuses a forward's output that overflowed; a `StopCheck` is how a ``Cancel``
read meanwhile stops a verify window's compute at a layer boundary. The lane around them is
`stagerun._stage._worker.LaneWorker`'s.

What the sessions of every lane on a stage hold together is bounded by the stage's
`stagerun._stage._budget.SessionBudget`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from .. import _proto, telemetry
from ..abc import ComputeBackend
from ..telemetry import now_ns
from ._context import StageContext

__all__ = [
    "Session",
    "StopCheck",
    "check_finite",
    "compute_attributes",
    "compute_stats",
    "count_stopped",
    "summarize",
    "us_since",
]


@attrs.define
class Session:
    """One request's state on one stage."""

    cache: Any
    sampling: _proto.SamplingParams
    prompt_len: int
    started_ns: int = attrs.field(factory=now_ns)
    messages: int = 0
    computes: int = 0
    tokens: int = 0
    compute_us: int = 0
    forward_write_us: int = 0
    kv_positions: int = 0  # the furthest position charged to the stage's `SessionBudget`


def us_since(start: float) -> int:
    """Microseconds since ``start`` (a `time.perf_counter` reading)."""
    return int((time.perf_counter() - start) * 1e6)


class StopCheck:
    """``should_stop`` for one verify window's compute: True once a ``Cancel`` named it.

    It counts the polls that let the compute go on. The built-in backends poll once before
    each layer, so when a stop comes that count is the number of layers already computed (a
    plugin that polls only between layers, as `stagerun.testing.check_backend` allows, has
    its stops reported one layer early).

    Args:
        cancelled: whether a ``Cancel`` has named the window by now (asked at every poll).
    """

    def __init__(self, cancelled: Callable[[], bool]) -> None:
        self._cancelled = cancelled
        self.layers_done = 0

    def cancelled(self) -> bool:
        """Whether a ``Cancel`` has named the window (asked before its tick: not counted)."""
        return self._cancelled()

    def __call__(self) -> bool:
        if self._cancelled():
            return True
        self.layers_done += 1
        return False


def check_finite(backend: ComputeBackend, out: np.ndarray[Any, Any]) -> None:
    """Refuse a forward's output that is not finite, as one plain error."""
    if not np.isfinite(out).all():
        lo, hi = backend.layers
        raise ValueError(
            f"layers {lo}..{hi - 1} computed values that are not finite (NaN or "
            "infinity) from these activations."
        )


def compute_stats(
    message: _proto.ActivationMessage, compute_us: int, stage_index: int
) -> _proto.StageStats:
    """The stats one computed message reports; a prefill chunk's also name the slowest stage."""
    stats = _proto.StageStats(compute_us=compute_us, stage_count=1, token_count=len(message.tokens))
    if isinstance(message, _proto.Prefill):
        stats = attrs.evolve(
            stats,
            slowest_compute_us=compute_us,
            slowest_tokens=len(message.tokens),
            slowest_stage=stage_index,
        )
    return stats


def compute_attributes(stage_index: int, message: _proto.ActivationMessage) -> dict[str, Any]:
    """What the debug spans of one computed message say of it (ids, positions, counts)."""
    attributes: dict[str, Any] = {
        "llama_stage.stage_index": stage_index,
        "llama_stage.message_kind": message.kind,
        "llama_stage.request_id": message.request_id,
        "llama_stage.pos_start": message.position,
        "llama_stage.token_count": len(message.tokens),
    }
    if isinstance(message, _proto.Verify):
        attributes["llama_stage.verify_window_id"] = message.window_id
    return attributes


def summarize(stage: StageContext, request_id: int, session: Session) -> None:
    """The span an ended session reports: its counts, and the stage's stale-work counters."""
    telemetry.current().span(
        "stage.binary_request_summary",
        session.started_ns,
        {
            "llama_stage.stage_index": stage.index,
            "llama_stage.request_id": request_id,
            "llama_stage.message_count": session.messages,
            "llama_stage.computes": session.computes,
            "llama_stage.token_count": session.tokens,
            "llama_stage.compute_ms": session.compute_us / 1000.0,
            "llama_stage.forward_write_ms": session.forward_write_us / 1000.0,
            "llama_stage.stale_dropped": stage.stale_dropped,
            "llama_stage.stale_stopped": stage.stale_stopped,
            "llama_stage.stale_stopped_layers": {
                str(layer): count for layer, count in sorted(stage.stale_stopped_layers.items())
            },
        },
    )


def count_stopped(
    stage: StageContext, message: _proto.ActivationMessage, layers_done: int, us: int
) -> None:
    """Count a stale compute that stopped at a layer boundary, and where it stopped.

    ``layers_done`` layers ran, so the compute stopped before layer ``lo + layers_done``.
    Before the first layer nothing was computed: that window was dropped before it
    started, like one still queued. Otherwise it stopped part-way, strictly inside the
    stage's layers, and that layer is counted in ``stale_stopped_layers``.
    """
    layer = stage.backend.layers[0] + layers_done
    if layers_done == 0:
        stage.stale_dropped += 1
    else:
        stage.stale_stopped += 1
        stage.stale_stopped_layers[layer] += 1
    tel = telemetry.current()
    if tel.debug_enabled:
        tel.debug_span(
            "stage.binary_llama_decode",
            now_ns() - us * 1000,
            {
                **compute_attributes(stage.index, message),
                "llama_stage.compute_stopped": True,
                "llama_stage.compute_stopped_layer": layer,
                "llama_stage.elapsed_ms": us / 1000.0,
            },
        )
