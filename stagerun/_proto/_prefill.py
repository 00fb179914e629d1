"""Prefill transport estimate: what the chain's prefill cost looked like on past requests.

Theory of operation: after each request's prefill, stage 0 knows its own representative chunk
(the one with the most tokens, the slowest on a tie), the largest forward-write and
downstream-wait it saw, and what the downstream stages reported about their own compute and
edges. `PrefillTransportEstimate.observe` folds that into an exponentially weighted moving
average (alpha 0.25: ``old * 0.75 + new * 0.25``); the first sample replaces the empty state.
The bottleneck is the stage with the slower per-token compute rate. `seed()` turns the estimate
into a synthetic chunk observation (compute 1, write and wait as ratios of compute) so the next
request's chunk planner starts from what the chain has shown rather than from nothing.

Pure bookkeeping: no I/O, no clocks.
"""

from __future__ import annotations

import attrs

EWMA_ALPHA = 0.25


@attrs.frozen
class PrefillChunkObservation:
    """Timings of one prefill chunk, in milliseconds."""

    compute_ms: float
    forward_write_ms: float
    downstream_wait_ms: float


@attrs.frozen
class DownstreamPrefillReport:
    """What the downstream stages reported about a request's prefill (milliseconds).

    ``compute_*`` describe the downstream sample with the slowest per-token rate; ``edge_*``
    the downstream hop with the largest write + wait.
    """

    compute_ms: float = 0.0
    compute_tokens: int = 0
    compute_stage_index: int = -1
    edge_write_ms: float = 0.0
    edge_wait_ms: float = 0.0
    edge_stage_index: int = -1
    activation_bytes: int = 0
    observations: int = 0


def _ewma(old: float, new: float) -> float:
    return old * (1.0 - EWMA_ALPHA) + new * EWMA_ALPHA


@attrs.define
class PrefillTransportEstimate:
    """EWMA of the chain's prefill transport cost, shared by all requests of a lane pool."""

    write_ms: float = 0.0
    wait_ms: float = 0.0
    slowest_compute_ms: float = 0.0
    slowest_compute_ms_per_token: float = 0.0
    write_to_compute: float = 0.0
    wait_to_compute: float = 0.0
    edge_stage_index: int = 0
    bottleneck_stage_index: int = 0
    bottleneck_token_count: int = 0
    activation_bytes: int = 0
    observations: int = 0

    def observe(
        self,
        *,
        stage_index: int,
        compute_ms: float,
        compute_tokens: int,
        forward_write_ms: float,
        downstream_wait_ms: float,
        downstream: DownstreamPrefillReport | None = None,
    ) -> None:
        """Fold one request's prefill into the estimate (skipped when stage 0 saw no tokens)."""
        if compute_tokens <= 0:
            return
        down = downstream or DownstreamPrefillReport()
        down_tokens = max(down.compute_tokens, 1)
        down_rate = down.compute_ms / down_tokens
        own_rate = compute_ms / max(compute_tokens, 1)
        if down_rate > own_rate:
            bottleneck_ms, bottleneck_index, bottleneck_tokens = (
                down.compute_ms,
                down.compute_stage_index,
                down_tokens,
            )
        else:
            bottleneck_ms, bottleneck_index, bottleneck_tokens = (
                compute_ms,
                stage_index,
                compute_tokens,
            )
        bottleneck_ms = max(bottleneck_ms, 0.001)
        write_ms = max(forward_write_ms, down.edge_write_ms)
        wait_ms = max(downstream_wait_ms, down.edge_wait_ms)
        local_total = forward_write_ms + downstream_wait_ms
        edge_index = (
            down.edge_stage_index
            if down.edge_write_ms + down.edge_wait_ms > local_total
            else stage_index
        )
        sample = PrefillTransportEstimate(
            write_ms=write_ms,
            wait_ms=wait_ms,
            slowest_compute_ms=bottleneck_ms,
            slowest_compute_ms_per_token=bottleneck_ms / max(bottleneck_tokens, 1),
            write_to_compute=write_ms / bottleneck_ms,
            wait_to_compute=wait_ms / bottleneck_ms,
            edge_stage_index=edge_index,
            bottleneck_stage_index=bottleneck_index,
            bottleneck_token_count=bottleneck_tokens,
            activation_bytes=down.activation_bytes,
            observations=max(down.observations, 1),
        )
        if self.observations == 0:
            for field in attrs.fields(PrefillTransportEstimate):
                setattr(self, field.name, getattr(sample, field.name))
            return
        self.write_ms = _ewma(self.write_ms, sample.write_ms)
        self.wait_ms = _ewma(self.wait_ms, sample.wait_ms)
        self.slowest_compute_ms = _ewma(self.slowest_compute_ms, sample.slowest_compute_ms)
        self.slowest_compute_ms_per_token = _ewma(
            self.slowest_compute_ms_per_token, sample.slowest_compute_ms_per_token
        )
        self.write_to_compute = _ewma(self.write_to_compute, sample.write_to_compute)
        self.wait_to_compute = _ewma(self.wait_to_compute, sample.wait_to_compute)
        self.edge_stage_index = sample.edge_stage_index
        self.bottleneck_stage_index = sample.bottleneck_stage_index
        self.bottleneck_token_count = sample.bottleneck_token_count
        self.activation_bytes = sample.activation_bytes
        self.observations += sample.observations

    def seed(self) -> PrefillChunkObservation | None:
        """A synthetic first observation for the next request, or None before any sample."""
        if self.observations == 0:
            return None
        return PrefillChunkObservation(
            compute_ms=1.0,
            forward_write_ms=self.write_to_compute,
            downstream_wait_ms=self.wait_to_compute,
        )
