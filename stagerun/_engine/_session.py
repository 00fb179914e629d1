"""One request on one stage: what it holds, and the compute it runs, apart from the lane.

A `Session` is what a stage opens for a request (a ``Configure`` on stages 1.., the request
itself on stage 0) and closes at its end: the backend's cache for the request, its sampling
settings, and the counts its summary span reports (`stagerun._engine.StageEngine.summarize`).
`check_finite` refuses a forward's output that overflowed; a `StopCheck` is how a ``Cancel``
read meanwhile stops a verify window's compute at a layer boundary. The engine that opens,
computes and closes sessions is `stagerun._engine.StageEngine`.

What the sessions of every request on a stage hold together is bounded by the stage's
`stagerun._engine._budget.SessionBudget`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from .. import _proto
from ..abc import ComputeBackend
from ..telemetry import now_ns
from ._sampler import RowSampler

__all__ = [
    "Session",
    "StopCheck",
    "check_finite",
    "compute_stats",
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
    sampler: RowSampler | None = None  # on the last stage: the request's sampling state


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
