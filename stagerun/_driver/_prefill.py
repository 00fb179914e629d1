"""Stage 0's side of a prefill: planned chunks, pipelined through the stages.

Theory of operation: `PrefillPlanner` (sans-IO, in `stagerun._decide._prefill`) picks each
chunk's size. `send_prefill` computes a chunk on stage 0, sends it down the lane and goes on
to the next one while the later stages work: up to ``credit`` chunks may be unacknowledged.
Each ack carries the whole chain's statistics for its chunk (`_proto.StageStats`, merged
hop by hop); they are folded into the lane pool's EWMA transport estimate, which seeds the
planner of the next request. The last chunk asks the last stage for a prediction, which
comes back on the return connection (`stagerun._driver._route.LaneRoute` reads it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import numpy as np

from .. import _proto, _spans, telemetry
from .._decide._prefill import (
    ChunkPolicy,
    DownstreamPrefillReport,
    PrefillChunkObservation,
    PrefillPlanner,
    PrefillTransportEstimate,
)
from ._lanes import Lane

__all__ = ["PrefillReport", "send_prefill"]


@attrs.define
class PrefillReport:
    """How one request's prefill went: chunk sizes and stage 0's view of each chunk."""

    policy: str
    chunks: int = 0
    sizes: list[int] = attrs.Factory(list)
    representative_tokens: int = 0
    representative_compute_ms: float = 0.0
    max_write_ms: float = 0.0
    max_wait_ms: float = 0.0
    grew: int = 0
    shrank: int = 0

    def add(self, tokens: int, chunk: PrefillChunkObservation) -> None:
        self.chunks += 1
        self.sizes.append(tokens)
        # the representative chunk: the most tokens, the slowest on a tie
        if (tokens, chunk.compute_ms) > (
            self.representative_tokens,
            self.representative_compute_ms,
        ):
            self.representative_tokens = tokens
            self.representative_compute_ms = chunk.compute_ms
        self.max_write_ms = max(self.max_write_ms, chunk.forward_write_ms)
        self.max_wait_ms = max(self.max_wait_ms, chunk.downstream_wait_ms)

    def finish(self, planner: PrefillPlanner) -> None:
        self.grew, self.shrank = planner.grew, planner.shrank


class _ChunkSender:
    """Stage 0's end of one prefill's lane: computes and sends chunks, keeps the ack window.

    Up to ``credit`` chunks before the last may be unacknowledged; the statistics their acks
    carry are merged into `down`. A ``Configure`` sent unacknowledged just before is owed the
    first ack.
    """

    def __init__(
        self,
        lane: Lane,
        request_id: int,
        *,
        compute0: Callable[[_proto.Prefill], Awaitable[np.ndarray[Any, Any]]],
        credit: int,
        wire_dtype: _proto.ActivationDType,
        configure_owed: bool,
    ) -> None:
        self._lane, self._request_id = lane, request_id
        self._compute0, self._credit, self._wire_dtype = compute0, credit, wire_dtype
        self._configure_owed = configure_owed
        self._configure_wait = 0.0  # seconds this chunk spent on Configure's ack: not downstream
        self._pending = 0
        self.down = _proto.StageStats()

    async def send(
        self, index: int, position: int, piece: Sequence[int], *, last: bool
    ) -> tuple[float, PrefillChunkObservation]:
        """Compute chunk ``index`` and send it; wait while ``credit`` chunks are unacknowledged.

        Returns when the chunk started (`time.perf_counter`) and stage 0's view of it.
        """
        started = time.perf_counter()
        message = _proto.Prefill(
            request_id=self._request_id,
            chunk_index=index,
            position=position,
            tokens=tuple(piece),
            predict=last,
        )
        hidden = await self._compute0(message)
        computed = time.perf_counter()
        await self._lane.send(message, hidden, self._wire_dtype)
        written = time.perf_counter()
        self._configure_wait = 0.0
        if not last:
            self._pending += 1
            while self._pending >= self._credit:
                await self._merge_next_ack()
        waited = time.perf_counter()
        return started, PrefillChunkObservation(
            compute_ms=(computed - started) * 1000.0,
            forward_write_ms=(written - computed) * 1000.0,
            downstream_wait_ms=(waited - written - self._configure_wait) * 1000.0,
        )

    async def drain(self) -> None:
        """Receive the acks still owed: the unacknowledged chunks', then Configure's."""
        while self._pending:
            await self._merge_next_ack()
        if self._configure_owed:
            await self._lane.receive_ack()

    async def _merge_next_ack(self) -> None:
        if self._configure_owed:
            asked = time.perf_counter()
            await self._lane.receive_ack()
            self._configure_wait = time.perf_counter() - asked
            self._configure_owed = False
        self.down = self.down.merge((await self._lane.receive_ack()).stats)
        self._pending -= 1


async def send_prefill(
    lane: Lane,
    request_id: int,
    prompt_ids: Sequence[int],
    *,
    compute0: Callable[[_proto.Prefill], Awaitable[np.ndarray[Any, Any]]],
    policy: ChunkPolicy,
    credit: int,
    wire_dtype: _proto.ActivationDType,
    estimate: PrefillTransportEstimate | None,
    configure_owed: bool = False,
    start: int = 0,
) -> PrefillReport:
    """Send ``prompt_ids[start:]`` in planned chunks, up to ``credit`` of them unacknowledged.

    ``compute0(chunk)`` runs stage 0's layers for one ``Prefill`` (every row's activations).
    Stage 0 computes chunk i+1 while the later stages work on chunk i. The acks of the chunks
    before the last are drained before this returns; the caller then reads the last chunk's
    prediction. ``estimate`` (the pool's) seeds the planner and learns from this prefill.

    ``configure_owed``: the request's ``Configure`` went down unacknowledged just before;
    its ack comes first, and a stage's refusal of it arrives here as `StageError`.
    ``start``: the positions before it are in every stage's cache already (a restored
    prefix); the first chunk starts there.
    """
    sender = _ChunkSender(
        lane,
        request_id,
        compute0=compute0,
        credit=credit,
        wire_dtype=wire_dtype,
        configure_owed=configure_owed,
    )
    total = len(prompt_ids)
    if not 0 <= start < total:
        raise ValueError(f"a prefill of {total} tokens cannot start at {start}")
    planner = PrefillPlanner(policy, total - start)
    if estimate is not None:
        planner.seed(estimate)
    report = PrefillReport(policy=repr(policy))
    tel = telemetry.current()
    prefill_start = telemetry.now_ns()
    position = start
    prefill_t0 = time.perf_counter()
    while position < total:
        size = planner.next_size(total - position)
        piece = prompt_ids[position : position + size]
        started, chunk = await sender.send(
            report.chunks, position, piece, last=position + size >= total
        )
        planner.observe(chunk)
        report.add(len(piece), chunk)
        if tel.debug_enabled:
            _spans.prefill_chunk(
                prefill_start + int((started - prefill_t0) * 1e9),
                _chunk_attributes(request_id, report.chunks - 1, position, len(piece), chunk),
            )
        position += size
    acked = report.chunks - 1
    await sender.drain()
    report.finish(planner)
    _spans.prefill_finished(
        prefill_start, _prefill_attributes(request_id, total - start, report, sender.down)
    )
    if estimate is not None and acked:
        _observe_transport(estimate, report, sender.down, acked)
    return report


def _chunk_attributes(
    request_id: int, index: int, position: int, tokens: int, chunk: PrefillChunkObservation
) -> dict[str, Any]:
    """The attributes of one chunk's ``stage.openai_prefill_chunk`` debug span."""
    return {
        "request_id": request_id,
        "seq_id": index,
        "pos_start": position,
        "token_count": tokens,
        "stage0_compute_ms": chunk.compute_ms,
        "forward_write_ms": chunk.forward_write_ms,
        "downstream_wait_ms": chunk.downstream_wait_ms,
    }


def _prefill_attributes(
    request_id: int, total: int, report: PrefillReport, down: _proto.StageStats
) -> dict[str, Any]:
    """The attributes of the whole prefill's ``stage.openai_prefill`` span."""
    return {
        "request_id": request_id,
        "token_count": total,
        "prefill_chunks": report.chunks,
        "prefill_chunks_grew": report.grew,
        "prefill_chunks_shrank": report.shrank,
        "prefill_max_forward_write_ms": report.max_write_ms,
        "prefill_max_downstream_wait_ms": report.max_wait_ms,
        "downstream_compute_ms": down.compute_us / 1000.0,
    }


def _observe_transport(
    estimate: PrefillTransportEstimate,
    report: PrefillReport,
    down: _proto.StageStats,
    acked: int,
) -> None:
    """Fold this prefill's stage 0 view and its ``acked`` chunks' statistics into ``estimate``."""
    estimate.observe(
        stage_index=0,
        compute_ms=report.representative_compute_ms,
        compute_tokens=report.representative_tokens,
        forward_write_ms=report.max_write_ms,
        downstream_wait_ms=report.max_wait_ms,
        downstream=DownstreamPrefillReport(
            compute_ms=down.slowest_compute_us / 1000.0,
            compute_tokens=down.slowest_tokens,
            compute_stage_index=down.slowest_stage,
            edge_write_ms=down.edge_write_us / 1000.0,
            edge_wait_ms=down.edge_wait_us / 1000.0,
            edge_stage_index=down.edge_stage,
            observations=acked,
        ),
    )
