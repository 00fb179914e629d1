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


# --- chunk planning --------------------------------------------------------------------------


@attrs.frozen
class FixedChunks:
    """Every chunk has ``size`` tokens (the last one may be shorter)."""

    size: int = 256

    def __attrs_post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a prefill chunk holds at least 1 token, not {self.size}")


@attrs.frozen
class ScheduleChunks:
    """Chunk ``i`` has ``sizes[i]`` tokens; past the end of the list, the last size repeats."""

    sizes: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        if not self.sizes or any(size < 1 for size in self.sizes):
            raise ValueError(f"a prefill schedule needs sizes of at least 1, got {self.sizes}")


@attrs.frozen
class AdaptiveRamp:
    """Grow chunks while transport hides under compute, shrink them when it shows.

    A prompt of at most ``fixed_chunk_size`` tokens goes in one chunk (splitting short prompts
    only adds round trips). Longer ones start at ``start`` tokens and move by ``step`` after
    every chunk, between ``start`` and ``max`` (the starvation bound: later stages never wait
    for more than one ``max``-token chunk), and never past the size the slowest stage computes
    in ``target_ms``.
    """

    fixed_chunk_size: int = 256
    start: int = 128
    step: int = 128
    max: int = 384
    target_ms: float = 100.0

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.start <= self.max or self.step < 1 or self.fixed_chunk_size < 1:
            raise ValueError(
                f"adaptive prefill needs 1 <= start <= max and step >= 1, got start "
                f"{self.start}, step {self.step}, max {self.max}"
            )
        if not self.target_ms > 0:
            raise ValueError(f"adaptive prefill needs a positive target, got {self.target_ms} ms")


ChunkPolicy = FixedChunks | ScheduleChunks | AdaptiveRamp
HIDDEN_WAIT, HIDDEN_WRITE = 0.75, 0.25  # of compute: transport hidden, grow
EXPOSED_WAIT, EXPOSED_WRITE = 1.25, 0.75  # of compute: transport exposed, shrink


def parse_chunk_policy(text: str) -> ChunkPolicy:
    """``adaptive`` (default ramp), ``256`` (fixed) or ``128,256,384`` (a schedule).

    Raises:
        ValueError: anything else, an empty entry, or a size below 1.
    """
    spec = text.strip().lower()
    if spec in ("adaptive", "adaptive-ramp"):
        return AdaptiveRamp()
    parts = [part.strip() for part in spec.split(",")]
    if not all(part.isdigit() for part in parts):
        raise ValueError(
            f"prefill chunks {text!r} must be 'adaptive', a size like 256, or a schedule like "
            "128,256,384"
        )
    sizes = tuple(int(part) for part in parts)
    return FixedChunks(sizes[0]) if len(sizes) == 1 else ScheduleChunks(sizes)


class PrefillPlanner:
    """Sizes the chunks of one request's prefill; feed it each chunk's timings.

    Args:
        policy: how to size chunks.
        prompt_tokens: the number of tokens the prefill covers.
    """

    def __init__(self, policy: ChunkPolicy, prompt_tokens: int) -> None:
        self.policy = policy
        self.prompt_tokens = prompt_tokens
        self.index = 0
        self.grew = self.shrank = 0
        self._next = policy.start if isinstance(policy, AdaptiveRamp) else 0
        self._ceiling = policy.max if isinstance(policy, AdaptiveRamp) else 0

    def __repr__(self) -> str:
        return f"<PrefillPlanner {self.policy!r} chunk={self.index} next={self._next}>"

    @property
    def ceiling(self) -> int:
        """The largest adaptive chunk the slowest stage computes within the target."""
        return self._ceiling

    def next_size(self, remaining: int) -> int:
        """Tokens for the next chunk, out of ``remaining`` (at least 1, at most remaining)."""
        if remaining < 1:
            raise ValueError("no prompt tokens remain to plan a chunk for")
        policy = self.policy
        if isinstance(policy, FixedChunks):
            size = policy.size
        elif isinstance(policy, ScheduleChunks):
            size = policy.sizes[min(self.index, len(policy.sizes) - 1)]
        elif self.index == 0 and self.prompt_tokens <= policy.fixed_chunk_size:
            size = self.prompt_tokens  # a short prompt: one chunk
        else:
            size = min(self._next, self._ceiling)
        self.index += 1
        return max(1, min(size, remaining))

    def observe(self, chunk: PrefillChunkObservation) -> None:
        """Move the adaptive size after a chunk: grow if transport hid, shrink if it showed."""
        policy = self.policy
        if not isinstance(policy, AdaptiveRamp):
            return
        compute = max(chunk.compute_ms, 0.001)
        wait, write = chunk.downstream_wait_ms, chunk.forward_write_ms
        if wait <= HIDDEN_WAIT * compute and write <= HIDDEN_WRITE * compute:
            self._next = min(self._next + policy.step, policy.max)
            self.grew += 1
        elif wait > EXPOSED_WAIT * compute or write > EXPOSED_WRITE * compute:
            self._next = max(self._next - policy.step, policy.start)
            self.shrank += 1
        self._next = min(self._next, self._ceiling)

    def calibrate_slowest_stage_rate(self, ms_per_token: float) -> None:
        """Cap adaptive chunks at what the slowest stage computes in ``target_ms``."""
        policy = self.policy
        if not isinstance(policy, AdaptiveRamp) or not ms_per_token > 0:
            return
        predicted = int(policy.target_ms // ms_per_token)
        steps = max(predicted - policy.start, 0) // policy.step
        self._ceiling = min(max(policy.start + steps * policy.step, policy.start), policy.max)
        self._next = min(self._next, self._ceiling)

    def seed(self, estimate: PrefillTransportEstimate) -> None:
        """Start from what past requests showed: calibrate the ceiling, then observe the seed."""
        if estimate.observations == 0:
            return
        self.calibrate_slowest_stage_rate(estimate.slowest_compute_ms_per_token)
        seed = estimate.seed()
        if seed is not None:
            self.observe(seed)
