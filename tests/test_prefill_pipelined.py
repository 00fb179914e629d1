"""Pipelined, planned prefill across stages: same tokens, bounded chunks, a learning estimate."""

from __future__ import annotations

import pathlib

import pytest

from stagerun import open_pipeline

PROMPT_IDS = [(i * 37) % 270 + 3 for i in range(420)]  # a 420-token prompt (tiny vocab: 279)


async def _run(model: pathlib.Path, **options: object) -> tuple[list[int], object]:
    async with open_pipeline(model, **options) as pipeline:  # type: ignore[arg-type]
        result = await pipeline.complete(PROMPT_IDS, max_tokens=8, ignore_eog=True)
        second = await pipeline.complete(PROMPT_IDS, max_tokens=8, ignore_eog=True)
        assert second.token_ids == result.token_ids
        return result.token_ids, pipeline


@pytest.mark.parametrize(
    "options",
    [
        {"prefill_chunk": "adaptive"},
        {"prefill_chunk": "adaptive", "prefill_credit": 1},
        {"prefill_chunk": "64,128"},
        {"prefill_chunk": 100},
    ],
    ids=["adaptive", "adaptive-serial", "schedule", "fixed"],
)
async def test_chunked_prefill_over_3_stages_equals_one_stage(
    tiny_model_path: pathlib.Path, options: dict[str, object]
) -> None:
    reference, _ = await _run(tiny_model_path, stages=1, prefill_chunk=100_000)
    tokens, pipeline = await _run(tiny_model_path, stages=3, **options)
    assert tokens == reference
    report = pipeline.last_prefill  # type: ignore[attr-defined]
    assert sum(report.sizes) == len(PROMPT_IDS) and report.chunks > 1
    if options["prefill_chunk"] == "64,128":
        assert report.sizes[:3] == [64, 128, 128]


async def test_chunk_acks_feed_the_transport_estimate(tiny_model_path: pathlib.Path) -> None:
    _, pipeline = await _run(tiny_model_path, stages=3, prefill_chunk="adaptive")
    estimate = pipeline.pool.prefill_transport  # type: ignore[attr-defined]
    assert estimate.observations >= 2  # both requests, each with several acked chunks
    assert estimate.bottleneck_stage_index in (0, 1, 2)
    assert estimate.slowest_compute_ms_per_token > 0
    # the downstream edges reported their hop: stage 1 -> 2 is the only one below stage 0
    assert estimate.edge_stage_index in (0, 1)


async def test_a_short_prompt_is_one_chunk(tiny_model_path: pathlib.Path) -> None:
    async with open_pipeline(tiny_model_path, stages=2) as pipeline:
        await pipeline.complete(PROMPT_IDS[:200], max_tokens=2)
        assert pipeline.last_prefill is not None and pipeline.last_prefill.sizes == [200]
