"""kill -9 of the middle stage on the real default model: the output does not change.

The tiny-model tests in test_recovery.py cover every failure kind; this one backs the headline
claim on the model people run, plainly and speculatively, in one 3-process pipeline.
"""

from __future__ import annotations

import os
import signal

import pytest
from _oracle import assert_varied

from stagerun import SamplingParams, SpeculationConfig, TokenChunk, open_pipeline

PROMPT = "Once upon a time, in a small village by the sea, there lived a girl named"
TOKENS = 48
KILL_AT = 16


@pytest.mark.slow
async def test_a_killed_middle_stage_leaves_the_output_identical_plain_and_speculative() -> None:
    speculation = SpeculationConfig("ngram", depth=4, window=4, adaptive=False)
    async with open_pipeline("smollm2", stages=3, mode="processes", threads=1) as pipeline:
        want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        assert_varied(want.token_ids)
        process = pipeline.stages[1].process
        for round, config in enumerate([None, speculation], start=1):
            victim = process.pid
            assert victim is not None
            seen = 0

            def on_token(chunk: TokenChunk, victim: int = victim) -> None:
                nonlocal seen
                seen += 1
                if seen == KILL_AT:
                    os.kill(victim, signal.SIGKILL)

            got = await pipeline.complete(
                PROMPT,
                max_tokens=TOKENS,
                ignore_eog=True,
                sampling=SamplingParams(),
                speculation=config,
                on_token=on_token,
            )
            assert got.token_ids == want.token_ids, f"speculation {config}"
            assert got.text == want.text
            assert got.timings["recoveries"] == 1
            assert process.restarts == round and process.pid != victim
            if config is not None:
                assert got.timings["draft_n"] > 0  # it did speculate
        assert pipeline.recoveries == 2
