"""``min_p`` and ``logit_bias``: what they do to a row, and that they stay exact alone, batched,
in speculative windows and through three stages, and over HTTP."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from stagerun import SamplingParams, SpeculationConfig, open_pipeline
from stagerun._decide._sampling import sample_token
from stagerun.server import create_app
from stagerun.testing import write_tiny_model

ROW = np.array([4.0, 3.9, 1.0, 0.5, -2.0], np.float32)


def test_a_bias_of_minus_100_bans_the_greedy_token_and_plus_100_forces_one() -> None:
    assert sample_token(ROW, SamplingParams(), 0) == 0
    banned = SamplingParams(bias_ids=(0,), bias_values=(-100.0,))
    assert sample_token(ROW, banned, 0) == 1
    forced = SamplingParams(temperature=1.0, seed=3, bias_ids=(4,), bias_values=(100.0,))
    assert {sample_token(ROW, forced, p) for p in range(50)} == {4}
    assert ROW[0] == 4.0  # the caller's row is left alone


def test_min_p_keeps_the_tokens_near_the_most_probable() -> None:
    loose = SamplingParams(temperature=1.0, seed=1)
    drawn = {sample_token(ROW, loose, p) for p in range(400)}
    assert drawn >= {0, 1, 2}  # so the filter below has something to remove
    tight = SamplingParams(temperature=1.0, seed=1, min_p=0.5)  # e^-0.1 ~ 0.9 passes, e^-3 not
    assert {sample_token(ROW, tight, p) for p in range(400)} == {0, 1}
    assert {sample_token(ROW, SamplingParams(temperature=1.0, min_p=1.0), p)
            for p in range(50)} == {0}  # fmt: skip


STORIES = ["once upon a time there was a", "the cat sat on the mat. the cat sat on the"]


async def test_processors_are_exact_alone_batched_and_speculative(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=6)
    biased = SamplingParams(temperature=0.9, seed=5, min_p=0.05,
                            bias_ids=(30, 31, 32), bias_values=(8.0, -100.0, 3.0))  # fmt: skip
    plain = SamplingParams(temperature=0.9, seed=5)
    kinds = [(biased, None), (biased, SpeculationConfig("ngram", depth=3, window=3)),
             (plain, None)]  # fmt: skip
    jobs = [(prompt, *kind) for prompt in STORIES for kind in kinds]

    async with open_pipeline(model, stages=3, capacity=len(jobs)) as pipeline:

        async def run(k: int, out: list[list[int]]) -> None:
            prompt, sampling, spec = jobs[k]
            done = await pipeline.complete(prompt, max_tokens=24, sampling=sampling,
                                           speculation=spec, ignore_eog=True)  # fmt: skip
            out[k] = done.token_ids

        solo: list[list[int]] = [[] for _ in jobs]
        for k in range(len(jobs)):
            await run(k, solo)
        together: list[list[int]] = [[] for _ in jobs]
        async with trio.open_nursery() as nursery:
            for k in range(len(jobs)):
                nursery.start_soon(run, k, together)
    assert together == solo
    for story in range(len(STORIES)):
        with_bias, speculative, without = solo[3 * story : 3 * story + 3]
        assert with_bias == speculative
        assert with_bias != without  # the processors change the answer
        assert 31 not in with_bias and 30 in with_bias


async def test_logit_bias_and_min_p_over_http(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=2)
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    stop = trio.Event()
    body: dict[str, Any] = {"model": "tiny", "prompt": "once upon a", "max_tokens": 8,
                            "temperature": 0}  # fmt: skip
    async with open_pipeline(model, stages=2) as pipeline, trio.open_nursery() as nursery:
        app: Any = create_app(pipeline, model_id="tiny")
        binds = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=stop.wait)
        )
        try:
            async with httpx.AsyncClient(base_url=binds[0], timeout=60) as client:

                async def ids(extra: dict[str, Any]) -> Any:
                    response = await client.post("/v1/completions", json={**body, **extra})
                    return response

                greedy = (await ids({})).json()["choices"][0]["text"]
                alone = await pipeline.complete("once upon a", max_tokens=8)
                assert alone.text == greedy
                first = alone.token_ids[0]
                banned = await ids({"logit_bias": {str(first): -100}})
                assert banned.status_code == 200
                assert banned.json()["choices"][0]["text"] != greedy
                forced = await ids({"logit_bias": {"75": 100}})
                assert forced.json()["choices"][0]["text"] == pipeline.tokenizer.decode([75] * 8)
                assert (await ids({"min_p": 0.3, "temperature": 1})).status_code == 200
                for extra, param in (
                    ({"logit_bias": {"100000": 1}}, "logit_bias"),
                    ({"logit_bias": {"a": 1}}, "logit_bias"),
                    ({"logit_bias": {"5": 101}}, "logit_bias"),
                    ({"logit_bias": [5]}, "logit_bias"),
                    ({"min_p": 1.5}, "min_p"),
                    ({"min_p": "x"}, "min_p"),
                ):
                    response = await ids(extra)
                    assert response.status_code == 400, extra
                    assert response.json()["error"]["param"] == param, extra
        finally:
            stop.set()


@pytest.mark.parametrize("bias", [{"5": -100}, {}])
def test_logit_bias_parses_into_pairs(bias: dict[str, int]) -> None:
    from stagerun.server import parse_generation_request

    request = parse_generation_request(
        {"model": "m", "prompt": "x", "logit_bias": bias}, "completion"
    )
    assert request.knobs.logit_bias == tuple((int(k), float(v)) for k, v in bias.items())
