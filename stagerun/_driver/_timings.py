"""What a request measured of itself, typed, and written out once (`Timings.to_json`).

A request fills in one typed section per concern as it goes: its prefill (`PrefillTimings`:
chunks, and the positions restored from the prefix caches), its recoveries
(`RecoveryTimings`), its speculative decoding (`stagerun._decide.SpeculationTimings`, which
the speculation controller measures). At the end
`stagerun._driver._request.Request` builds one `Timings`, which is also a read-only mapping
of today's llama-server style keys, so ``completion.timings["predicted_ms"]`` and the HTTP
responses' ``timings`` objects read the same values. A new figure is a field of its section
and a key in that section's ``to_json``: nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from .._decide import SpeculationTimings

__all__ = ["PrefillTimings", "RecoveryTimings", "Timings"]


@attrs.define
class PrefillTimings:
    """The request's prefills: chunks sent down lanes (over every attempt), the last one's
    positions restored from the prefix caches."""

    chunks: int | None = None  # None on one stage: its prefill is one compute, no chunks
    prefix_cached_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.chunks is not None:
            out["prefill_chunks"] = self.chunks
        out["prefix_cached_tokens"] = self.prefix_cached_tokens
        return out


@attrs.define
class RecoveryTimings:
    """The lane failures the request survived, and what they cost."""

    recoveries: int = 0
    wait_ms: float = 0.0  # waiting for a fresh lane
    replay_ms: float = 0.0  # replaying the committed tokens on it

    def to_json(self) -> dict[str, Any]:
        if not self.recoveries:
            return {}
        return {
            "recoveries": self.recoveries,
            "recovery_wait_ms": self.wait_ms,
            "recovery_replay_ms": self.replay_ms,
        }


@attrs.frozen
class Timings(Mapping[str, Any]):
    """One request's timings: the prompt (to the first token) and the decode after it.

    As a mapping it holds `to_json`'s keys.
    """

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    prefill: PrefillTimings = attrs.field(factory=PrefillTimings)
    recovery: RecoveryTimings = attrs.field(factory=RecoveryTimings)
    speculation: SpeculationTimings | None = None
    _json: dict[str, Any] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_json", self.to_json())

    @property
    def prompt_per_second(self) -> float:
        return self.prompt_n * 1000.0 / max(self.prompt_ms, 1e-9)

    @property
    def predicted_per_second(self) -> float:
        """Decode speed: the tokens after the first, over the time after the first."""
        n, ms = self.predicted_n, self.predicted_ms
        return (n - 1) * 1000.0 / ms if n > 1 and ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """llama-server's keys (``prompt_*``, ``predicted_*``), then each section's."""
        out: dict[str, Any] = {
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_second": self.prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_second": self.predicted_per_second,
        }
        out.update(self.prefill.to_json())
        out.update(self.recovery.to_json())
        if self.speculation is not None:
            out.update(self.speculation.to_json())
        return out

    def __getitem__(self, key: str) -> Any:
        return self._json[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)
