"""Speculative decoding end to end: pipelined verify windows give exactly plain decoding."""

from __future__ import annotations

import collections
import math
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from stagerun import (
    SamplingParams,
    SpeculationConfig,
    StageServer,
    _decide,
    open_pipeline,
    split_layers,
    telemetry,
)
from stagerun._decide._pace import PACE_TRIPS, DepthControl, PaceCheck
from stagerun.abc import ForwardItem
from stagerun.backends import NumpyBackend
from stagerun.drafters import OracleDrafter
from stagerun.testing import write_tiny_model

PROMPT = "the cat sat on the mat. the cat sat on the"
SAMPLED = SamplingParams(temperature=1.0, top_k=50, seed=11)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=6)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown drafter 'magic'"):
        SpeculationConfig("magic")
    with pytest.raises(ValueError, match=r"depth must be within 1\.\.64"):
        SpeculationConfig("ngram", depth=65)
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculationConfig("draft-model")


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "seeded"])
async def test_every_depth_and_drafter_matches_plain_decoding(
    tiny: Path, sampling: SamplingParams
) -> None:
    async with open_pipeline(tiny, stages=3) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=32, sampling=sampling)
        assert len(set(plain.token_ids)) >= 8, plain.token_ids  # a varied oracle
        reference = plain.prompt_token_ids + plain.token_ids
        for depth in (1, 2, 4, 8):
            config = SpeculationConfig("ngram", depth=depth, window=4)
            result = await pipeline.complete(
                PROMPT, max_tokens=32, sampling=sampling, speculation=config
            )
            assert result.token_ids == plain.token_ids, f"ngram depth {depth}"
            for error_rate in (0.0, 0.3, 1.0):
                drafter = OracleDrafter(
                    reference, error_rate=error_rate, vocab_size=pipeline.config.vocab_size
                )
                result = await pipeline.complete(
                    PROMPT, max_tokens=32, sampling=sampling, speculation=config, drafter=drafter
                )
                assert result.token_ids == plain.token_ids, f"oracle {error_rate} depth {depth}"
                assert result.finish_reason == plain.finish_reason
        assert pipeline.pool is not None and pipeline.pool.replaced == 0


async def test_one_stage_speculation_matches(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=1) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=24, sampling=SAMPLED)
        assert len(set(plain.token_ids)) >= 8, plain.token_ids  # a varied oracle
        drafter = OracleDrafter(
            plain.prompt_token_ids + plain.token_ids,
            error_rate=0.3,
            vocab_size=pipeline.config.vocab_size,
        )
        result = await pipeline.complete(
            PROMPT,
            max_tokens=24,
            sampling=SAMPLED,
            speculation=SpeculationConfig("ngram", depth=4),
            drafter=drafter,
        )
        assert result.token_ids == plain.token_ids


async def test_timings_carry_speculative_keys(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=2, speculation=SpeculationConfig("ngram")) as pipeline:
        result = await pipeline.complete(PROMPT, max_tokens=16)
    timings = result.timings
    for key in (
        "speculative_windows",
        "speculative_proposed_n",
        "speculative_accepted_n",
        "speculative_accept_rate",
        "verify_window_depth",
        "verify_window_opened",
        "verify_window_stale_discarded",
        "verify_window_occupancy_ms_by_depth",
        "draft_n",
        "draft_n_accepted",
    ):
        assert key in timings, key
    assert timings["verify_window_depth"] == 4


async def test_stop_strings_end_speculation_cleanly(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=3) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=24, sampling=SAMPLED)
        assert len(set(plain.token_ids)) >= 8, plain.token_ids  # a varied oracle
        stop = plain.text[5:8]
        expected = plain.text[: plain.text.index(stop)]
        result = await pipeline.complete(
            PROMPT,
            max_tokens=24,
            sampling=SAMPLED,
            stop=[stop],
            speculation=SpeculationConfig("ngram", depth=4),
        )
        assert result.text == expected and result.finish_reason == "stop"
        assert pipeline.pool is not None and pipeline.pool.replaced == 0


class LayerDelayBackend:
    """A real backend whose every layer takes ``per_layer_s`` longer, through ``should_stop``.

    The stage's ``should_stop`` is polled once before each layer, as the real backend does;
    when it says go on, the layer that follows takes the delay. So a stale window whose
    ``Cancel`` arrives before the first poll computes nothing, and one whose ``Cancel`` arrives
    later stops after at least one layer: which of the two happens depends on when the
    ``Cancel`` arrives, but with tens of milliseconds per layer both keep happening.
    """

    def __init__(self, inner: NumpyBackend, per_layer_s: float) -> None:
        self.inner = inner
        self.per_layer_s = per_layer_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _slowed(self, should_stop: Any) -> Any:
        def poll() -> bool:
            if should_stop is not None and should_stop():
                return True
            time.sleep(self.per_layer_s)  # the layer about to run
            return False

        return poll

    def forward(self, cache: Any, position: int, **kw: Any) -> Any:
        kw["should_stop"] = self._slowed(kw.get("should_stop"))
        return self.inner.forward(cache, position, **kw)

    def forward_batch(self, items: list[ForwardItem]) -> Any:
        slowed = [attrs.evolve(it, should_stop=self._slowed(it.should_stop)) for it in items]
        return self.inner.forward_batch(slowed)


async def start_slow_stages(
    nursery: trio.Nursery, model: Path, ranges: list[tuple[int, int]], per_layer_s: float
) -> list[StageServer]:
    """Stage servers for ``ranges[1:]`` (last first), every layer slowed by ``per_layer_s``."""
    servers: list[StageServer] = []
    downstream: str | None = None
    for index in range(len(ranges) - 1, 0, -1):
        backend = LayerDelayBackend(NumpyBackend(model, ranges[index]), per_layer_s)
        server = StageServer(backend, index=index, downstream=downstream)  # type: ignore[arg-type]
        downstream = await nursery.start(server.serve)
        servers.insert(0, server)
    return servers


async def test_stages_drop_queued_stale_windows_and_stop_stale_computes(
    tiny: Path, nursery: trio.Nursery
) -> None:
    ranges = split_layers(6, 3)
    servers = await start_slow_stages(nursery, tiny, ranges, per_layer_s=0.01)
    async with open_pipeline(
        tiny, layers=ranges, remote=[s.address for s in servers if s.address]
    ) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=20, sampling=SAMPLED)
        assert len(set(plain.token_ids)) >= 8, plain.token_ids  # a varied oracle
        plain_computes = [s.computes for s in servers]
        drafter = OracleDrafter(
            plain.prompt_token_ids + plain.token_ids,
            error_rate=1.0,  # every first draft is wrong: every later window goes stale
            vocab_size=pipeline.config.vocab_size,
        )
        result = await pipeline.complete(
            PROMPT,
            max_tokens=20,
            sampling=SAMPLED,
            speculation=SpeculationConfig("ngram", depth=4, window=2, adaptive=False),
            drafter=drafter,
        )
    assert result.token_ids == plain.token_ids
    opened = result.timings["verify_window_opened"]
    dropped = sum(s.stale_dropped for s in servers)
    stopped = sum(s.stale_stopped for s in servers)
    computed = [s.computes - c for s, c in zip(servers, plain_computes, strict=True)]
    # a queued stale window is never computed, and a stale compute in progress stops early
    print(f"stale dropped={dropped} stopped={stopped} computed={computed} opened={opened}")
    assert dropped >= 1, (dropped, stopped, computed, opened)
    assert stopped >= 1, (dropped, stopped, computed, opened)
    # (+ Configure-free computes: prefill is one compute per stage)
    assert all(c < opened + 1 for c in computed), (computed, opened)


async def test_a_stale_window_answered_anyway_is_charged_what_it_cost_stage_0(
    tiny: Path,
) -> None:
    """Stage 0 measures each window (its compute, its write, the wait for the reply, the
    drain) and a window that went stale but was answered is charged all of it."""
    async with open_pipeline(tiny, layers=split_layers(6, 3)) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=24, sampling=SAMPLED)
        assert len(set(plain.token_ids)) >= 8, plain.token_ids  # an oracle that can fail
        drafter = OracleDrafter(
            plain.prompt_token_ids + plain.token_ids,
            error_rate=0.5,
            vocab_size=pipeline.config.vocab_size,
        )
        result = await pipeline.complete(
            PROMPT,
            max_tokens=24,
            sampling=SAMPLED,
            speculation=SpeculationConfig("ngram", depth=4, window=2, adaptive=False),
            drafter=drafter,
        )
    assert result.token_ids == plain.token_ids
    stale = {k: v for k, v in result.timings.items() if k.startswith("verify_window_stale_")}
    print(stale)
    assert stale["verify_window_stale_verify_elapsed_ms"] > 0, "no stale window was answered"
    for part in ("stage0_compute", "forward_write", "downstream_wait"):
        assert stale[f"verify_window_stale_{part}_ms"] > 0, part
    assert stale["verify_window_stale_drain_ms"] >= 0


async def test_draft_model_drafter_end_to_end(tiny: Path) -> None:
    config = SpeculationConfig("draft-model", depth=4, window=4, draft_model=str(tiny))
    async with open_pipeline(tiny, stages=3) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=24)
        assert len(set(plain.token_ids)) >= 8, plain.token_ids  # a varied oracle
        first = await pipeline.complete(PROMPT, max_tokens=24, speculation=config)
        second = await pipeline.complete(PROMPT, max_tokens=24, speculation=config)
    assert first.token_ids == second.token_ids == plain.token_ids
    # the target drafting for itself, greedily: every draft is right
    assert first.timings["speculative_accept_rate"] == 1.0


def _stats_after(windows: int, full: int, proposed: int) -> _decide.SpeculationStats:
    return _decide.SpeculationStats(windows=windows, full_accept_windows=full, proposed=proposed)


def test_adaptive_depth_follows_the_full_accept_rate() -> None:
    control = DepthControl(8, adaptive=True)
    start = control.allowed
    assert 1 < start < 8  # the prior allows some pipelining, not all of it
    stats = _stats_after(0, 0, 0)
    for i in range(1, 8):  # every window accepted in full
        after = _stats_after(i, i, 4 * i)
        control.observe(stats, after)
        stats = after
    assert control.allowed == 8
    for i in range(8, 14):  # every window rejected
        after = _stats_after(i, stats.full_accept_windows, 4 * i)
        control.observe(stats, after)
        stats = after
    assert control.allowed == 1
    # A window that carried no drafts (a plain step) says nothing about drafting.
    control.observe(stats, attrs.evolve(stats, windows=stats.windows + 1))
    assert control.allowed == 1


def test_fixed_depth_when_not_adaptive() -> None:
    control = DepthControl(4, adaptive=False)
    control.observe(_stats_after(0, 0, 0), _stats_after(5, 0, 20))
    assert control.allowed == 4


def test_pace_check_compares_committed_rate_with_a_plain_step() -> None:
    pace = PaceCheck()
    assert not pace.slower_than_plain(0, 10.0)  # nothing measured yet
    pace.opened(1, 0.0)
    pace.replied(1, 100.0)  # the first quartile of [100, 150]: 100 ms, plain ~ 10 tokens/s
    pace.opened(2, 100.0)
    pace.replied(2, 250.0)
    pace.forget([3])  # unknown windows are ignored
    assert (pace.shortest_round_trip_ms, pace.plain_step_ms()) == (100.0, 100.0)
    assert pace.slower_than_plain(2, 250.0)  # 8 tokens/s
    assert not pace.slower_than_plain(5, 250.0)  # 20 tokens/s


def _paced(trips: list[float]) -> PaceCheck:
    """A pace that has seen windows of these round trips, one opened every 10 ms from 0."""
    pace = PaceCheck()
    for window_id, trip in enumerate(trips):
        pace.opened(window_id, 10.0 * window_id)
        pace.replied(window_id, 10.0 * window_id + trip)
    return pace


def test_a_plain_step_is_not_read_from_a_lull() -> None:
    # Requests that start together: one window back in 120 ms while the pipeline fills, the
    # rest in 300 once it is full. 8 tokens in 1.5 s beat plain steps of 300 ms (5 tokens);
    # against the 120 (12.5 tokens) drafting was switched off.
    pace = _paced([120.0] + [300.0] * 8)
    assert (pace.shortest_round_trip_ms, pace.plain_step_ms()) == (120.0, 300.0)
    assert not pace.slower_than_plain(8, 1500.0)
    assert pace.slower_than_plain(5, 1500.0)  # as slow as plain is now: switched off


def test_a_plain_step_follows_the_latest_round_trips() -> None:
    # 40 windows of 50 ms: the first quartile while they are among the latest PACE_TRIPS; once
    # they are not, they are forgotten (kept, 40 of 104 would still give 50)
    assert _paced([50.0] * 40 + [300.0] * (PACE_TRIPS - 40)).plain_step_ms() == 50.0
    assert _paced([50.0] * 40 + [300.0] * PACE_TRIPS).plain_step_ms() == 300.0
    # one short round trip in four or more is not the plain step, one in three is
    assert _paced([120.0, 300.0, 300.0, 300.0]).plain_step_ms() == 300.0
    assert _paced([300.0, 120.0, 300.0]).plain_step_ms() == 120.0
    assert _paced([300.0, 50.0, 200.0, 100.0, 400.0, 60.0, 70.0, 80.0]).plain_step_ms() == 70.0
    assert math.isinf(PaceCheck().plain_step_ms())


@pytest.fixture(scope="module")
def tiny9(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Nine layers: three per stage, so a stop can land strictly inside a stage's layers."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny9") / "tiny.gguf", n_layers=9)


async def test_stale_windows_are_dropped_before_starting_or_stopped_at_a_named_layer(
    tiny9: Path, nursery: trio.Nursery
) -> None:
    ranges = split_layers(9, 3)
    servers = await start_slow_stages(nursery, tiny9, ranges, per_layer_s=0.02)
    recorder = telemetry.Telemetry("debug", [], capacity=100_000)
    previous = telemetry.set_current(recorder)
    try:
        async with open_pipeline(
            tiny9, layers=ranges, remote=[s.address for s in servers if s.address]
        ) as pipeline:
            plain = await pipeline.complete(PROMPT, max_tokens=16, sampling=SAMPLED)
            assert len(set(plain.token_ids)) >= 8, plain.token_ids  # an oracle that can fail
            assert all(s.stale_dropped == s.stale_stopped == 0 for s in servers)
            drafter = OracleDrafter(
                plain.prompt_token_ids + plain.token_ids,
                error_rate=1.0,  # every epoch's first draft is wrong: its later windows go stale
                vocab_size=pipeline.config.vocab_size,
            )
            result = await pipeline.complete(
                PROMPT,
                max_tokens=16,
                sampling=SAMPLED,
                speculation=SpeculationConfig("ngram", depth=4, window=2, adaptive=False),
                drafter=drafter,
            )
        records = recorder.take()
    finally:
        telemetry.set_current(previous)
    assert result.token_ids == plain.token_ids
    timings = result.timings
    # Stage 0 accounted for every window it marked stale: answered anyway, or Cancelled.
    marked = timings["verify_window_stale_marked"]
    assert marked == timings["verify_window_stale_discarded"] > 0
    dropped = sum(s.stale_dropped for s in servers)
    stopped = sum(s.stale_stopped for s in servers)
    layers = {s.index: dict(sorted(s.stale_stopped_layers.items())) for s in servers}
    print(
        f"opened={timings['verify_window_opened']} stale_marked={marked} dropped={dropped} "
        f"stopped={stopped} stopped_at_layers={layers} "
        f"per_stage={[(s.index, s.stale_dropped, s.stale_stopped) for s in servers]}"
    )
    assert dropped > 0, "no stale window was dropped before it started"
    assert stopped > 0, "no stale compute was stopped part-way"
    # the decode span carries the verify-window counters, as the response's timings do
    (decode,) = [
        r
        for r in records
        if r.name == "stage.openai_decode" and r.attributes["llama_stage.speculative"]
    ]
    for name in ("horizon_refill_attempts", "horizon_refill_tokens"):
        assert (
            decode.attributes[f"llama_stage.verify_window.{name}"]
            == timings[f"verify_window_{name}"]
        )
    assert decode.attributes["llama_stage.verify_window.horizon_refill_attempts"] > 0
    # A window stopped (or dropped) by one stage never reaches the next: at most one each.
    assert dropped + stopped <= marked
    stopped_spans = collections.Counter(
        (r.attributes["llama_stage.stage_index"], r.attributes["llama_stage.compute_stopped_layer"])
        for r in records
        if r.name == "stage.binary_llama_decode" and r.attributes.get("llama_stage.compute_stopped")
    )
    for server in servers:
        lo, hi = server.backend.layers
        # Part-way: after at least one of the stage's layers, before its last one.
        assert all(lo < layer < hi for layer in server.stale_stopped_layers), (lo, hi, layers)
        assert sum(server.stale_stopped_layers.values()) == server.stale_stopped
        # Each stopped compute's span names the layer it stopped before; a stop before the
        # first layer names the stage's first layer and was counted as dropped.
        spans = {layer: n for (i, layer), n in stopped_spans.items() if i == server.index}
        assert {k: n for k, n in spans.items() if k != lo} == dict(server.stale_stopped_layers)
        assert spans.get(lo, 0) <= server.stale_dropped
