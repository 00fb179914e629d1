"""The prefill chunk planner and the transport estimate, ported from the original's cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagerun._decide._prefill import (
    AdaptiveRamp,
    DownstreamPrefillReport,
    FixedChunks,
    PrefillChunkObservation,
    PrefillPlanner,
    PrefillTransportEstimate,
    ScheduleChunks,
    parse_chunk_policy,
)

HIDDEN = PrefillChunkObservation(compute_ms=10.0, forward_write_ms=1.0, downstream_wait_ms=2.0)
EXPOSED_WAIT = PrefillChunkObservation(
    compute_ms=10.0, forward_write_ms=1.0, downstream_wait_ms=13.0
)
EXPOSED_WRITE = PrefillChunkObservation(
    compute_ms=10.0, forward_write_ms=8.0, downstream_wait_ms=0.0
)
IN_BETWEEN = PrefillChunkObservation(compute_ms=10.0, forward_write_ms=5.0, downstream_wait_ms=10.0)


def plan(planner: PrefillPlanner, total: int) -> list[int]:
    sizes, done = [], 0
    while done < total:
        size = planner.next_size(total - done)
        sizes.append(size)
        done += size
    return sizes


def test_schedule_parsing() -> None:
    assert parse_chunk_policy("128,256,384") == ScheduleChunks((128, 256, 384))
    assert parse_chunk_policy(" 256 ") == FixedChunks(256)
    assert parse_chunk_policy("adaptive") == AdaptiveRamp()
    for bad in ("", "0", "128,,256", "128,0", "fast", "-5", "1.5"):
        with pytest.raises(ValueError):
            parse_chunk_policy(bad)


def test_fixed_and_schedule_chunks() -> None:
    assert plan(PrefillPlanner(FixedChunks(256), 700), 700) == [256, 256, 188]
    schedule = PrefillPlanner(ScheduleChunks((128, 256, 384)), 1500)
    assert plan(schedule, 1500) == [128, 256, 384, 384, 348]  # the last size repeats


def test_short_prompts_go_in_one_chunk() -> None:
    assert plan(PrefillPlanner(AdaptiveRamp(), 200), 200) == [200]
    assert plan(PrefillPlanner(AdaptiveRamp(), 256), 256) == [256]
    assert plan(PrefillPlanner(AdaptiveRamp(), 257), 257)[0] == 128  # past it: the ramp


def test_grow_while_transport_hides_under_compute() -> None:
    planner = PrefillPlanner(AdaptiveRamp(), 2000)
    assert planner.next_size(2000) == 128
    planner.observe(HIDDEN)
    assert planner.next_size(1872) == 256
    planner.observe(HIDDEN)
    assert planner.next_size(1616) == 384
    planner.observe(HIDDEN)
    assert planner.next_size(1232) == 384  # max


@pytest.mark.parametrize("exposed", [EXPOSED_WAIT, EXPOSED_WRITE], ids=["wait", "write"])
def test_shrink_when_wait_or_write_is_exposed(exposed: PrefillChunkObservation) -> None:
    planner = PrefillPlanner(AdaptiveRamp(), 5000)
    planner.next_size(5000)
    planner.observe(HIDDEN)
    planner.observe(HIDDEN)
    assert planner.next_size(4000) == 384
    planner.observe(exposed)
    assert planner.next_size(4000) == 256
    planner.observe(exposed)
    planner.observe(exposed)
    assert planner.next_size(4000) == 128  # never below start
    planner.observe(IN_BETWEEN)
    assert planner.next_size(4000) == 128  # neither hidden nor exposed: unchanged


@settings(max_examples=50)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1000, allow_nan=False),
            st.floats(0, 1000, allow_nan=False),
            st.floats(0, 1000, allow_nan=False),
        ),
        min_size=100,
        max_size=100,
    )
)
def test_starvation_bound_over_100_observations(samples: list[tuple[float, float, float]]) -> None:
    policy = AdaptiveRamp()
    planner = PrefillPlanner(policy, 10**6)
    for compute, write, wait in samples:
        size = planner.next_size(10**6)
        assert policy.start <= size <= policy.max
        planner.observe(PrefillChunkObservation(compute, write, wait))


def test_ewma_seed_ramps_the_first_chunk() -> None:
    estimate = PrefillTransportEstimate()
    estimate.observe(
        stage_index=0,
        compute_ms=10.0,
        compute_tokens=256,
        forward_write_ms=0.0,
        downstream_wait_ms=0.0,
        downstream=DownstreamPrefillReport(edge_write_ms=1.0, edge_stage_index=1, observations=1),
    )
    cold = PrefillPlanner(AdaptiveRamp(), 1500)
    assert cold.next_size(1500) == 128
    seeded = PrefillPlanner(AdaptiveRamp(), 1500)
    seeded.seed(estimate)
    assert seeded.next_size(1500) == 256  # the chain showed hidden transport: start larger


def test_slowest_stage_calibration() -> None:
    estimate = PrefillTransportEstimate()
    estimate.observe(
        stage_index=0,
        compute_ms=80.0,
        compute_tokens=256,
        forward_write_ms=0.0,
        downstream_wait_ms=0.0,
        downstream=DownstreamPrefillReport(
            compute_ms=50.0, compute_tokens=64, compute_stage_index=2, observations=1
        ),
    )
    assert estimate.bottleneck_stage_index == 2
    planner = PrefillPlanner(AdaptiveRamp(), 1500)
    planner.seed(estimate)
    assert planner.ceiling == 128  # 0.78 ms/token: 128 tokens fit in the 100 ms target
    planner.observe(HIDDEN)
    assert planner.next_size(1500) == 128


def test_the_ewma_weighs_new_samples_a_quarter() -> None:
    estimate = PrefillTransportEstimate()
    for write in (4.0, 8.0):
        estimate.observe(
            stage_index=0,
            compute_ms=10.0,
            compute_tokens=100,
            forward_write_ms=write,
            downstream_wait_ms=0.0,
        )
    assert estimate.write_ms == pytest.approx(4.0 * 0.75 + 8.0 * 0.25)
    assert estimate.observations == 2
    assert PrefillTransportEstimate().seed() is None
