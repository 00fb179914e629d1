"""The tiny test model is an oracle: what it generates depends on what it was given.

Every equality-after-fault test in the suite compares a disturbed run with an undisturbed one.
That comparison can only catch a wrong replay if a wrong replay (a dropped token, a missing
prompt, another seed) changes the output, so these properties are asserted here, on the model
every such test uses, and on a few other shapes and seeds of it.
"""

from __future__ import annotations

import pathlib

import pytest

from stagerun import SamplingParams, open_pipeline
from stagerun.testing import write_tiny_model

PROMPTS = ("The lighthouse keeper counted the ships", "Once upon a time, a fox named")


@pytest.mark.parametrize(
    "shape",
    [{}, {"seed": 1}, {"n_layers": 6}, {"n_layers": 2, "d_model": 128, "d_ff": 64}],
    ids=["default", "seed1", "6-layers", "wide"],
)
async def test_greedy_output_varies_with_prompt_and_position(
    tmp_path: pathlib.Path, shape: dict[str, int]
) -> None:
    path = write_tiny_model(tmp_path / "tiny.gguf", **shape)
    async with open_pipeline(path) as pipeline:
        runs = [
            (await pipeline.complete(p, max_tokens=64, ignore_eog=True)).token_ids for p in PROMPTS
        ]
    for ids in runs:
        assert len(ids) == 64
        assert len(set(ids)) >= 16, ids
    assert runs[0] != runs[1]
    assert runs[0][:8] != runs[1][:8]  # they differ at once, not only late


async def test_seeded_sampling_depends_on_the_seed_and_only_on_it(
    tiny_model_path: pathlib.Path,
) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=1.0, seed=seed)

    async with open_pipeline(tiny_model_path) as pipeline:

        async def sample(seed: int) -> list[int]:
            result = await pipeline.complete(
                PROMPTS[0], max_tokens=24, ignore_eog=True, sampling=params(seed)
            )
            return result.token_ids

        by_seed = {seed: await sample(seed) for seed in (5, 6, 12345)}
        assert len({tuple(ids) for ids in by_seed.values()}) == 3
        assert await sample(5) == by_seed[5]
        greedy = (await pipeline.complete(PROMPTS[0], max_tokens=24, ignore_eog=True)).token_ids
    assert all(ids != greedy for ids in by_seed.values())
    assert all(len(set(ids)) >= 12 for ids in by_seed.values())


async def test_the_old_peaked_weights_repeat_one_token(tmp_path: pathlib.Path) -> None:
    """Why the scaling exists: unscaled weights make an oracle that cannot tell runs apart."""
    path = write_tiny_model(
        tmp_path / "peaked.gguf", embedding_std=1.0, attention_gain=1.0, logit_scale=1.0
    )
    async with open_pipeline(path) as pipeline:
        ids = (await pipeline.complete(PROMPTS[0], max_tokens=32, ignore_eog=True)).token_ids
    assert len(set(ids)) <= 2
