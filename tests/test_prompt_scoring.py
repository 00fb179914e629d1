"""Prompt scoring: each prompt token's log-probability, computed on the last stage.

The oracle is one forward of the whole prompt on one numpy backend holding every layer:
the log-softmax of row *i* at the token at *i* + 1. Through one and three stages, chunked
(64 tokens a chunk) and with the prefix cache on and off, the scores must match it within
1e-5, and the top alternatives must be its most likely tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stagerun import SamplingParams, open_pipeline
from stagerun.backends import NumpyBackend
from stagerun.model import open_model
from stagerun.testing import write_tiny_model

TEXTS = ["the cat sat on the mat. " * 12, "once upon a time there was a", "one two three " * 30]


def _oracle(model_path: Path, prompt: list[int]) -> np.ndarray:
    model = open_model(model_path)
    backend = NumpyBackend(model)
    logits = backend.forward(backend.new_cache(), 0, tokens=prompt, logits="all")
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("prefix_cache_mb", [0, 64])
async def test_prompt_scores_equal_one_forward(
    tmp_path: Path, stages: int, prefix_cache_mb: int
) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=6)
    sampling = SamplingParams(prompt_logprobs=3)
    async with open_pipeline(model, stages=stages, backend="numpy",
                             prefix_cache_mb=prefix_cache_mb) as pipeline:  # fmt: skip
        for text in TEXTS:
            prompt = pipeline.tokenizer.encode(text)
            oracle = _oracle(model, prompt)
            for _ in range(2):  # the second time the prompt's blocks are cached (when on)
                done = await pipeline.complete(prompt, max_tokens=0, sampling=sampling)
                assert done.token_ids == [] and done.prompt_logprobs is not None
                assert done.prompt_logprobs[0] is None and len(done.prompt_logprobs) == len(prompt)
                for i, entry in enumerate(done.prompt_logprobs[1:]):
                    assert entry is not None and entry.token_id == prompt[i + 1]
                    assert abs(entry.logprob - oracle[i, prompt[i + 1]]) < 1e-5
                    best = np.argsort(-oracle[i], kind="stable")[:3]
                    assert [t for t, _ in entry.top] == best.tolist()
                    assert np.allclose([v for _, v in entry.top], oracle[i, best], atol=1e-5)
    assert len(set(np.round(oracle.max(axis=1), 3))) > 5  # the oracle varies
