"""End to end on the real default model: every split gives the whole model's tokens."""

from __future__ import annotations

import pytest

from stagerun import SamplingParams, open_pipeline

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
]


async def _tokens(stages: int, prompt: str, *, mode: str = "inproc", n: int = 16) -> list[int]:
    async with open_pipeline("smollm2", stages=stages, mode=mode) as pipeline:  # type: ignore[arg-type]
        return (await pipeline.complete(prompt, max_tokens=n)).token_ids


async def test_capital_of_france_names_paris() -> None:
    async with open_pipeline("smollm2", stages=3) as pipeline:
        result = await pipeline.complete("The capital of France is", max_tokens=12)
    assert "Paris" in result.text


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_splits_in_process_are_token_identical(prompt: str) -> None:
    reference = await _tokens(1, prompt)
    for stages in (2, 3, 5):
        assert await _tokens(stages, prompt) == reference, f"{stages} stages differ"


async def test_splits_as_processes_are_token_identical() -> None:
    prompt = PROMPTS[0]
    reference = await _tokens(1, prompt)
    for stages in (2, 3, 5):
        assert await _tokens(stages, prompt, mode="processes") == reference, f"{stages} stages"


async def test_chat_prompt_and_seeded_sampling() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=7)
    results = []
    for stages in (1, 3):
        async with open_pipeline("smollm2", stages=stages) as pipeline:
            result = await pipeline.complete(
                "Name one colour.", max_tokens=24, sampling=params, chat=True
            )
            results.append(result.token_ids)
    assert results[0] == results[1]
    assert results[0]


async def test_stop_given_as_one_string_is_that_string() -> None:
    prompt = "Count: one, two, three,"
    async with open_pipeline("smollm2") as pipeline:
        whole = await pipeline.complete(prompt, max_tokens=16)
        assert " five" in whole.text  # so the stop string is met, after spaces and an 'f'
        as_string = await pipeline.complete(prompt, max_tokens=16, stop="five")
        as_list = await pipeline.complete(prompt, max_tokens=16, stop=["five"])
    assert as_string.text == as_list.text == whole.text[: whole.text.index("five")]
    assert " four" in as_string.text  # not cut at the first space or 'f'
