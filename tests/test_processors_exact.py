"""Every sampling processor at once, drawn by Hypothesis: exact in every mode.

Each example draws three requests with random processors (penalties, ``logit_bias``,
``min_p``, a grammar or none, logprobs, seeds). The oracle is each request alone on one
stage; the same requests speculative (verify windows in flight, n-gram drafts that diverge)
and batched beside each other and beside plain copies, through one and three stages, must
give the same tokens and bitwise the same log-probabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import pytest
import trio
from _oracle import run_each
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagerun import SamplingParams, SpeculationConfig, open_pipeline
from stagerun.testing import write_tiny_model

PROMPTS = ["once upon a time there was a", "the cat sat on the mat. the cat sat on the",
           "one two three four one two three four one"]  # fmt: skip
GRAMMARS = [
    "",
    llguidance.LLMatcher.grammar_from_regex(r"(cat|dog)s? [0-9]{2,5} (and|or) [a-z ]{3,30}"),
    llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "n": {"type": "integer"}},
         "required": ["name", "n"], "additionalProperties": False},
        defaults={"whitespace_flexible": False},
    ),
]  # fmt: skip
SPECULATE = SpeculationConfig("ngram", depth=3, window=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=4)


@st.composite
def sampling(draw: Any) -> SamplingParams:
    biased = draw(st.lists(st.integers(0, 250), max_size=3, unique=True))
    return SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.7, 1.3])),
        top_k=draw(st.sampled_from([0, 20])),
        seed=draw(st.integers(0, 2**32)),
        min_p=draw(st.sampled_from([0.0, 0.05])),
        bias_ids=tuple(biased),
        bias_values=tuple(draw(st.sampled_from([-100.0, 4.0])) for _ in biased),
        logprobs=draw(st.sampled_from([-1, 0, 3])),
        presence_penalty=draw(st.sampled_from([0.0, 1.5])),
        frequency_penalty=draw(st.sampled_from([0.0, -0.5, 0.8])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.4])),
        repetition_last_n=draw(st.sampled_from([0, 8])),
        grammar=draw(st.sampled_from(GRAMMARS)),
    )


def _answer(done: Any) -> tuple[Any, ...]:
    rows = (
        None if done.logprobs is None else [(e.token_id, e.logprob, e.top) for e in done.logprobs]
    )
    return tuple(done.token_ids), rows, done.finish_reason


async def _answers(model: Path, stages: int, jobs: list[tuple[int, SamplingParams, Any]],
                   *, together: bool) -> list[Any]:  # fmt: skip
    out: list[Any] = [None] * len(jobs)
    async with open_pipeline(model, stages=stages, capacity=len(jobs)) as pipeline:

        async def run(k: int) -> None:
            prompt, params, spec = jobs[k]
            done = await pipeline.complete(PROMPTS[prompt], max_tokens=24, sampling=params,
                                           speculation=spec)  # fmt: skip
            out[k] = _answer(done)

        await run_each(len(jobs), run, together=together)
    return out


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(sampling(), min_size=3, max_size=3))
def test_processors_are_exact_alone_speculative_batched_and_split(
    model: Path, requests: list[SamplingParams]
) -> None:
    jobs = [(k, params, None) for k, params in enumerate(requests)]
    speculative = [(k, params, SPECULATE) for k, params, _ in jobs]

    async def main() -> None:
        oracle = await _answers(model, 1, jobs, together=False)
        assert len({answer[0] for answer in oracle}) > 1  # the oracle is not one constant
        for stages in (1, 3):
            assert await _answers(model, stages, jobs + speculative, together=True) == oracle * 2
        assert await _answers(model, 3, speculative, together=False) == oracle

    trio.run(main)
