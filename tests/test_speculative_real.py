"""Speculative decoding on the real default model, 3 stages: output equals plain decoding."""

from __future__ import annotations

import pytest

from stagerun import SamplingParams, SpeculationConfig, open_pipeline
from stagerun._cli._bench import SPECULATIVE_PROMPTS
from stagerun.drafters import OracleDrafter

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("label", "sampling"),
    [
        ("repeat", SamplingParams()),
        ("rewrite", SamplingParams()),
        ("code-edit", SamplingParams()),
        ("rewrite", SamplingParams(temperature=0.8, top_p=0.95, seed=5)),
    ],
)
async def test_speculative_output_is_plain_output(label: str, sampling: SamplingParams) -> None:
    prompt = SPECULATIVE_PROMPTS[label]
    async with open_pipeline("smollm2", stages=3) as pipeline:
        plain = await pipeline.complete(prompt, chat=True, max_tokens=40, sampling=sampling)
        reference = plain.prompt_token_ids + plain.token_ids
        for depth in (1, 2, 4, 8):
            ngram = SpeculationConfig("ngram", depth=depth, window=4)
            result = await pipeline.complete(
                prompt, chat=True, max_tokens=40, sampling=sampling, speculation=ngram
            )
            assert result.token_ids == plain.token_ids, f"ngram depth {depth}"
            if depth in (1, 4):
                oracle = OracleDrafter(
                    reference, error_rate=0.3, vocab_size=pipeline.config.vocab_size, seed=depth
                )
                result = await pipeline.complete(
                    prompt,
                    chat=True,
                    max_tokens=40,
                    sampling=sampling,
                    speculation=ngram,
                    drafter=oracle,
                )
                assert result.token_ids == plain.token_ids, f"oracle depth {depth}"
