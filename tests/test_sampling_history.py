"""Penalties and log-probabilities: the last stage's per-request history, kept like a KV cache.

The oracle is the request run alone on one stage; every other mode (batched beside others,
speculative windows that diverge, three stages, a prefix restored from the cache) must give
the same tokens and bitwise the same log-probabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _oracle import run_each

from stagerun import SamplingParams, SpeculationConfig, open_pipeline
from stagerun._decide._sampling import adjust_logits, row_logprobs
from stagerun._engine._sampler import RowSampler
from stagerun._proto import Decode, Verify
from stagerun.testing import write_tiny_model

VOCAB = 8


def test_penalties_follow_the_history_back_and_forth() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    sampler = RowSampler(params, prompt_len=2)
    row = np.zeros((1, VOCAB), np.float32)
    sampler.record(0, (1, 1))  # the prompt: not counted by presence or frequency
    sampler.answer(Verify(1, 1, 0, 2, (3, 3, 4)), np.zeros((3, VOCAB), np.float32))
    sampler.record(3, (5,))  # a window at 3 overwrote the stale 3 and 4
    generated = sampler._generated
    assert generated is not None
    sampler.answer(Decode(1, 4, (6,)), row)
    assert generated.counts is not None
    expected = np.bincount([3, 5, 6], minlength=VOCAB)
    assert (generated.counts == expected).all()
    sampler.trim(3)
    sampler.answer(Decode(1, 3, (2,)), row)
    assert (generated.counts == np.bincount([3, 2], minlength=VOCAB)).all()


def test_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones() -> None:
    row = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    params = SamplingParams(repetition_penalty=2.0)
    out = adjust_logits(row, params, recent=[0, 1, 0])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    both = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    out = adjust_logits(row, both, generated=np.array([2, 0, 1, 0]))
    assert out.tolist() == [0.0, -2.0, -0.5, 0.5]


def test_logprobs_are_the_raw_log_softmax() -> None:
    row = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    mine, ids, values = row_logprobs(row, 2, 3)
    expected = row - np.log(np.exp(row.astype(np.float64)).sum())
    assert mine == pytest.approx(expected[2], abs=1e-12)
    assert ids == [1, 3, 2]  # ties: the lower id first
    assert values == pytest.approx([expected[1], expected[3], expected[2]], abs=1e-12)


PROMPTS = ["once upon a time there was a", "the cat sat on the mat. the cat sat on the"]
PENALIZED = SamplingParams(temperature=0.8, seed=11, presence_penalty=1.2,
                           frequency_penalty=0.6, repetition_penalty=1.3,
                           repetition_last_n=24, logprobs=3)  # fmt: skip
PLAIN = SamplingParams(temperature=0.8, seed=11, logprobs=3)
SPECULATE = SpeculationConfig("ngram", depth=3, window=3)


def _rows(done: Any) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    return [(e.token_id, e.logprob, e.top) for e in done.logprobs]


async def _run_all(
    model: Path, stages: int, jobs: list[tuple[str, SamplingParams, Any]], *, together: bool
) -> list[list[Any]]:
    out: list[list[Any]] = [[] for _ in jobs]
    async with open_pipeline(model, stages=stages, capacity=len(jobs)) as pipeline:

        async def run(k: int) -> None:
            prompt, sampling, spec = jobs[k]
            done = await pipeline.complete(prompt, max_tokens=28, sampling=sampling,
                                           speculation=spec, ignore_eog=True)  # fmt: skip
            assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids)
            out[k] = _rows(done)

        await run_each(len(jobs), run, together=together)
        if not together:
            for k in range(len(jobs)):  # again: now the prompts' blocks are in the caches
                before = out[k]
                await run(k)
                assert out[k] == before, f"job {k} changed with its prefix restored"
    return out


async def test_penalties_and_logprobs_are_exact_in_every_mode(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=6)
    jobs = [(p, s, None) for p in PROMPTS for s in (PENALIZED, PLAIN)]
    oracle = await _run_all(model, 1, jobs, together=False)
    for prompt in range(len(PROMPTS)):
        penalized, plain = oracle[2 * prompt], oracle[2 * prompt + 1]
        assert [t for t, *_ in penalized] != [t for t, *_ in plain]  # the penalties bite
        assert len({t for t, *_ in plain}) < len({t for t, *_ in penalized})
    speculative = [(p, s, SPECULATE) for p, s, _ in jobs]
    for stages in (1, 3):
        assert await _run_all(model, stages, speculative, together=True) == oracle
        assert await _run_all(model, stages, jobs + speculative, together=True) == oracle * 2
    assert await _run_all(model, 3, jobs, together=False) == oracle
