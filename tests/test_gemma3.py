"""Gemma 3 270M (Q4_K_M), the second real model: against transformers, llama.cpp, and itself split.

The file (``gemma3-270m``, assembled from four PyPI chunk wheels) is the base model: Q4_K,
Q5_0, Q6_K, Q8_0 and F32 tensors, a SentencePiece vocabulary of 262,144 entries, no chat
template, 18 blocks of which every sixth is global and the others see a 512-position window,
with RoPE bases of 1,000,000 (global) and 10,000 (local). transformers dequantizes the file and
runs its own Gemma 3 code; llama.cpp runs its own kernels on the same blocks. The tokenizer's
own checks against transformers are in test_tokenizer_spm.py.

Greedy tokens may differ from transformers only where the top two logits are within
`NEAR_TIE` of each other (float32 against float32, sums in another order). llama.cpp is
noisier: its K-quant dot products run on activations quantized to 8 bits, and its logits differ
from ours by 0.18 in the median and 1.5 at most (5% of the largest) on a 16-token prompt,
so against it a divergence may come where the margin is below `LLAMA_CPP_TIE`, after at least
`LLAMA_CPP_AGREE` equal tokens. Every divergence is printed with its margin.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from _live_server import LiveServer
from _oracle import assert_varied
from _weights_only import transformers_model

from stagerun import open_pipeline
from stagerun.backends import GgmlBackend, NumpyBackend
from stagerun.model import ModelFile, open_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "Paris is the capital of",
    "Once upon a time, in a small village, there lived a girl named",
    "def fibonacci(n):",
    "Les accents: café, naïve, Zürich; 東京 🎉. In English this means",
]
N_NEW = 24
NEAR_TIE = 0.02
LLAMA_CPP_TIE = 0.5
LLAMA_CPP_AGREE = 8


@pytest.fixture(scope="module")
def gemma() -> ModelFile:
    return open_model("gemma3-270m")


@pytest.fixture(scope="module")
def backend(gemma: ModelFile) -> NumpyBackend:
    return NumpyBackend(gemma, threads=2)


def greedy(backend: Any, ids: list[int]) -> tuple[list[int], list[float]]:
    """``N_NEW`` greedy tokens and, for each, the margin between the top two logits."""
    cache = backend.new_cache()
    logits = backend.forward(cache, 0, tokens=ids)
    out: list[int] = []
    margins: list[float] = []
    while len(out) < N_NEW:
        top2 = np.sort(logits[-1])[-2:]
        margins.append(float(top2[1] - top2[0]))
        out.append(int(logits[-1].argmax()))
        logits = backend.forward(cache, len(ids) + len(out) - 1, tokens=[out[-1]])
    return out, margins


def assert_agrees(
    ours: list[int],
    margins: list[float],
    theirs: list[int],
    what: str,
    *,
    tie: float = NEAR_TIE,
    agree: int = 0,
) -> None:
    """Equal, or equal up to a divergence at a near-tie (reported) after ``agree`` tokens."""
    assert len(theirs) == len(ours), f"{what}: {len(theirs)} tokens, not {len(ours)}"
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if at is None:
        return
    print(f"{what}: diverges at token {at} where our top-2 margin is {margins[at]:.4f}")
    assert at >= agree, f"{what}: diverges at token {at}, before {agree}"
    assert margins[at] < tie, f"{what}: diverges at {at} with margin {margins[at]:.4f}"


@pytest.fixture(scope="module")
def transformers_greedy(
    gemma: ModelFile, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, list[int]]]:
    """transformers' greedy tokens for each prompt, on its own Gemma 3 code."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers_model(gemma.path, tmp_path_factory.mktemp("gemma3-weights"))
    model.eval()
    out = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = gemma.tokenizer.encode(prompt)
            tokens = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                max_new_tokens=N_NEW,
                do_sample=False,
                pad_token_id=0,
            )
            out[prompt] = [int(t) for t in tokens[0, len(ids) :]]
    del model
    gc.collect()
    yield out


def test_the_file_is_what_the_acceptance_says(gemma: ModelFile) -> None:
    c = gemma.config
    assert (c.family.name, c.n_layers, c.d_model, c.vocab_size) == ("gemma3", 18, 640, 262144)
    assert gemma.chat_template is None and c.sliding_window == 512
    assert [i for i in range(18) if not c.is_local(i)] == [5, 11, 17]
    assert (c.layer_rope(0), c.layer_rope(5)) == ((10000.0, 1.0, False), (1e6, 1.0, False))
    kinds = {t.tensor_type.name for t in gemma._reader.tensors}
    assert kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(
    backend: NumpyBackend, gemma: ModelFile, transformers_greedy: dict[str, list[int]], prompt: str
) -> None:
    ours, margins = greedy(backend, gemma.tokenizer.encode(prompt))
    assert_varied(ours)
    theirs = transformers_greedy[prompt]
    assert_agrees(ours, margins, theirs, f"transformers, {prompt!r}")


def test_paris_is_the_capital_of_france(backend: NumpyBackend, gemma: ModelFile) -> None:
    ours, _ = greedy(backend, gemma.tokenizer.encode(PROMPTS[0]))
    assert gemma.tokenizer.decode(ours[:3]).strip().startswith("France")


@pytest.mark.llama_cpp
def test_greedy_tokens_match_llama_cpp(backend: NumpyBackend, gemma: ModelFile) -> None:
    from stagerun_llamacpp import LlamaCppBackend

    other = LlamaCppBackend(gemma)
    try:
        for prompt in PROMPTS:
            ids = gemma.tokenizer.encode(prompt)
            ours, margins = greedy(backend, ids)
            theirs, _ = greedy(other, ids)
            assert_agrees(
                ours,
                margins,
                theirs,
                f"llama.cpp, {prompt!r}",
                tie=LLAMA_CPP_TIE,
                agree=LLAMA_CPP_AGREE,
            )
    finally:
        del other
        gc.collect()


@pytest.mark.parametrize("kind", ["numpy", "ggml"])
async def test_one_two_and_three_stages_give_the_same_tokens(
    kind: str, backend: NumpyBackend, gemma: ModelFile
) -> None:
    """2 stages split between local layer 4 and global 5; of 3, the middle holds local layers
    only (6..10) and the last starts at the global layer 11. One stage is the whole model.
    numpy (float32 Gemma 3 in every stage: 20 s a pipeline to load) runs the 3 stages only,
    whose splits cover both sides of a global layer."""
    prompt = PROMPTS[1]
    whole = backend if kind == "numpy" else GgmlBackend(gemma, threads=2)
    alone, _ = greedy(whole, gemma.tokenizer.encode(prompt))
    assert_varied(alone)
    splits = [[(0, 5), (5, 18)], [(0, 6), (6, 11), (11, 18)]]
    for layers in splits[1:] if kind == "numpy" else splits:
        async with open_pipeline(gemma, layers=layers, threads=2, backend=kind) as pipeline:
            result = await pipeline.complete(prompt, max_tokens=N_NEW, ignore_eog=True)
        assert result.token_ids == alone, layers


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(
        ["--model", "gemma3-270m", "--stages", "2"], tmp_path_factory.mktemp("g") / "log"
    )
    try:
        live.wait_ready(timeout=300)
        yield live
    finally:
        live.stop()


def test_the_openai_client_completes_and_a_chat_gets_a_clear_400(
    server: LiveServer, backend: NumpyBackend, gemma: ModelFile
) -> None:
    # the server computes with its default backend, ggml here
    expected, _ = greedy(GgmlBackend(gemma, threads=2), gemma.tokenizer.encode(PROMPTS[0]))
    with server.openai() as client:
        done = client.completions.create(
            model="gemma3-270m", prompt=PROMPTS[0], max_tokens=N_NEW, temperature=0
        )
        assert done.choices[0].text == gemma.tokenizer.decode(expected)
        assert done.choices[0].text.strip().startswith("France")
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="gemma3-270m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
    assert "has no chat template" in str(info.value) and "--chat-template" in str(info.value)


async def test_a_chat_template_given_to_the_pipeline_is_used(gemma: ModelFile) -> None:
    """The pipeline renders chats with `PipelineConfig.chat_template` in place of the
    model's missing one (`--chat-template FILE` sets it: test_config.py)."""
    template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
        "{{ m['content'] }}<end_of_turn>\n{% endfor %}{{ '<start_of_turn>model\\n' }}"
    )  # a literal newline at the very end would be trimmed by Jinja
    messages = [{"role": "user", "content": "Name a colour."}]
    async with open_pipeline(gemma, stages=1, threads=2, chat_template=template) as pipeline:
        ids = pipeline.encode_prompt(messages)
        result = await pipeline.complete(messages, max_tokens=8)
    assert gemma.tokenizer.decode(ids) == (
        "<bos><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    )
    assert result.token_ids and result.text
