"""What speculative decoding measured of one request, typed; its response keys in `to_json`."""

from __future__ import annotations

from typing import Any

import attrs

from ._verdict import SpeculationStats, speculation_timings
from ._windows import VerifyWindowStats, response_timings

__all__ = ["SpeculationTimings"]


@attrs.frozen
class SpeculationTimings:
    """Speculative decoding's figures (after a recovery: the last stretch's)."""

    stats: SpeculationStats
    windows: VerifyWindowStats
    drafting_switched_off: bool
    shortest_window_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        out.update(speculation_timings(self.stats))
        out.update(response_timings(self.windows))
        out["draft_n"] = self.stats.proposed
        out["draft_n_accepted"] = self.stats.accepted
        out["speculative_drafting_switched_off"] = self.drafting_switched_off
        if self.shortest_window_ms is not None:
            out["speculative_shortest_window_ms"] = round(self.shortest_window_ms, 3)
        return out
