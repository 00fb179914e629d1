"""The values `Pipeline` takes and gives: results, streams, stage descriptions, policies."""

from __future__ import annotations

from typing import Any, Literal

import attrs
import trio

from .. import _proto
from .._wire._connect import alternatives
from ..model import ModelFile
from ._timings import Timings

__all__ = [
    "Completion",
    "DrafterContext",
    "GenerationStream",
    "StageHealth",
    "StageInfo",
    "TokenChunk",
    "TokenLogprob",
]


@attrs.frozen
class TokenLogprob:
    """A token's log-probability under the model's raw distribution, and the likeliest ones.

    ``top`` holds the ``SamplingParams.logprobs`` most likely tokens at that position, as
    ``(token_id, logprob)``, most likely first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class TokenChunk:
    """One generated token and the text it completes (may be empty mid-character).

    ``logprob`` is the token's `TokenLogprob` when the request asked for them.
    """

    token_id: int
    text: str
    logprob: TokenLogprob | None = None


@attrs.frozen
class Completion:
    """The result of one request (``logprobs``: one per token, when asked for)."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    timings: Timings  # typed, and a mapping of the llama-server style keys
    logprobs: list[TokenLogprob] | None = None
    # with ``SamplingParams.prompt_logprobs``: the prompt's tokens', None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None


@attrs.frozen
class StageInfo:
    """Where a stage runs and what it holds."""

    index: int
    layers: tuple[int, int]
    address: str | None  # None for stage 0 (this process)
    pid: int | None = None
    backend: str = "auto"
    process: Any = attrs.field(default=None, eq=False, repr=False)  # a supervised StageProcess


@attrs.frozen
class StageWork:
    """What a probed stage said of its work: its ticks so far (``ticks`` batched forwards
    that computed ``tick_items``), and one request's latest computes, ``spans`` of (start,
    end, window id, kind, batch) with start and end on the prober's `time.perf_counter_ns`
    clock (see `_proto.Status`)."""

    ticks: int = 0
    tick_items: int = 0
    spans: tuple[tuple[int, int, int, int, int], ...] = ()

    @classmethod
    def from_status(cls, status: _proto.Status, offset_ns: int = 0) -> StageWork:
        """``status``'s figures, its spans moved by ``offset_ns`` onto the prober's clock."""
        flat, n = status.spans, _proto.SPAN_FIELDS
        spans = tuple(
            (flat[i] + offset_ns, flat[i + 1] + offset_ns, flat[i + 2], flat[i + 3], flat[i + 4])
            for i in range(0, len(flat), n)
        )
        return cls(status.ticks, status.tick_items, spans)


@attrs.frozen
class AddressHealth:
    """The result of probing one address of a stage (its primary, or a standby)."""

    address: str
    state: Literal["ready", "unreachable"]
    error: str | None = None
    latency_ms: float | None = None
    prefix_cache: _proto.PrefixStats | None = None  # what the stage reported, if it did
    work: StageWork | None = None  # likewise

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"address": self.address, "state": self.state}
        if self.latency_ms is not None:
            out["latency_ms"] = round(self.latency_ms, 3)
        if self.error is not None:
            out["error"] = self.error
        return out


@attrs.frozen
class StageHealth:
    """The result of probing one stage: its primary address, and its standbys if it has any.

    ``state``, ``error`` and ``latency_ms`` are the primary's; ``standbys`` holds each
    standby's probe, and ``serving`` the first address that answered, in the order the
    stage before it tries them (None when none did).
    """

    stage: StageInfo
    state: Literal["ready", "unreachable", "stalled", "closed"]
    error: str | None = None
    latency_ms: float | None = None
    standbys: tuple[AddressHealth, ...] = ()
    serving: str | None = None
    prefix_cache: _proto.PrefixStats | None = None  # the primary's (stage 0: its own)
    work: StageWork | None = None  # the primary's (stage 0: its own)

    @property
    def primary(self) -> str:
        return alternatives(self.stage.address)[0] if self.stage.address else "local"

    @property
    def available(self) -> bool:
        """Whether any of the stage's addresses answered."""
        return self.state == "ready" or any(s.state == "ready" for s in self.standbys)

    def to_json(self) -> dict[str, Any]:
        lo, hi = self.stage.layers
        out: dict[str, Any] = {
            "index": self.stage.index,
            "address": self.primary,
            "layers": [lo, hi],
            "backend": self.stage.backend,
            "state": self.state,
        }
        if self.standbys:
            out["standbys"] = [s.to_json() for s in self.standbys]
            out["serving"] = self.serving
        if self.stage.process is not None:
            out["process"] = self.stage.process.to_json()
            out["pid"] = self.stage.process.pid
        elif self.stage.pid is not None:
            out["pid"] = self.stage.pid
        if self.latency_ms is not None:
            out["latency_ms"] = round(self.latency_ms, 3)
        if self.error is not None:
            out["error"] = self.error
        if self.prefix_cache is not None:
            out["prefix_cache"] = prefix_cache_json(self.prefix_cache)
        return out


def prefix_cache_json(stats: _proto.PrefixStats) -> dict[str, Any]:
    """``/health``'s view of a stage's prefix cache: its counts and its hit rate."""
    out: dict[str, Any] = attrs.asdict(stats)
    out["hit_rate"] = (
        round(stats.hit_tokens / stats.lookup_tokens, 4) if stats.lookup_tokens else None
    )
    return out


@attrs.frozen
class DrafterContext:
    """What a drafter plugin is built from (`stagerun.abc.DrafterOptions`)."""

    target: ModelFile
    draft_model: str | None = None


class GenerationStream:
    """The token stream of one `Pipeline.generate` call; ``result`` is set at the end."""

    def __init__(self, receive: trio.MemoryReceiveChannel[TokenChunk]) -> None:
        self._receive = receive
        self.result: Completion | None = None
        self.error: Exception | None = None
        self.error_raised = False

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> TokenChunk:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            if self.error is not None and not self.error_raised:
                self.error_raised = True
                raise self.error from None
            raise StopAsyncIteration from None
