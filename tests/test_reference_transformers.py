"""The default model against Hugging Face transformers loading the same GGUF file.

transformers dequantizes the GGUF and builds its tokenizer itself, so this checks our loader,
RoPE pairing, tokenizer and chat template against an independent implementation. It needs the
``reference`` extra (torch==2.13.0, transformers, accelerate).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import torch
import transformers
from _weights_only import transformers_model

from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Les accents: café, naïve, Zürich; 東京 🎉. In English this means",
]
CHAT = [{"role": "user", "content": "What is the capital of Japan? Answer in one word."}]
TOKENIZER_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Accents: café, naïve, Ångström, façade, jalapeño.",
    "CJK: 日本語のテキスト, 中文字符, 한국어 문장.",
    "Emoji: 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "def f(x: int) -> dict:\n\treturn {'a': [x ** 2 for _ in range(10)]}  # 100%\n",
    "   spaces   and\n\n\nnewlines\r\n  ",
    "Numbers: 1234567890, 3.14159, -42, 1e-5, 0x1F.",
    "<|im_start|>user\nraw control tokens<|im_end|>\n<|endoftext|>",
]
N_NEW = 24


@attrs.frozen
class Reference:
    """Everything transformers says, computed in one go (torch and numpy never interleave)."""

    token_ids: dict[str, list[int]]
    decoded: dict[str, str]
    chat_text: str
    chat_ids: list[int]
    logits: np.ndarray
    greedy: dict[str, list[int]]


def hf_greedy(model: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
            max_new_tokens=N_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]


@pytest.fixture(scope="module")
def reference(smollm2: ModelFile, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    directory, name = str(smollm2.path.parent), smollm2.path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers_model(smollm2.path, tmp_path_factory.mktemp("smollm2-weights"))
    model.eval()  # type: ignore[no-untyped-call]
    token_ids = {text: list(tokenizer(text)["input_ids"]) for text in TOKENIZER_TEXTS}
    chat_text = str(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))
    chat_ids = list(tokenizer(chat_text, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([token_ids[TOKENIZER_TEXTS[0]]])).logits[0].numpy()
    prompts = {p: list(tokenizer(p)["input_ids"]) for p in PROMPTS}
    prompts["chat"] = chat_ids
    return Reference(
        token_ids=token_ids,
        decoded={text: str(tokenizer.decode(ids)) for text, ids in token_ids.items()},
        chat_text=chat_text,
        chat_ids=chat_ids,
        logits=logits,
        greedy={p: hf_greedy(model, ids) for p, ids in prompts.items()},
    )


def our_greedy(backend: NumpyBackend, ids: list[int]) -> list[int]:
    cache = backend.new_cache()
    logits = backend.forward(cache, 0, tokens=ids)
    out: list[int] = []
    while len(out) < N_NEW:
        out.append(int(logits[-1].argmax()))
        logits = backend.forward(cache, len(ids) + len(out) - 1, tokens=[out[-1]])
    return out


def assert_same_greedy(ours: list[int], theirs: list[int], eog: frozenset[int]) -> None:
    # transformers stops at an end-of-generation token; we always run N_NEW steps.
    assert ours[: len(theirs)] == theirs
    assert len(theirs) == N_NEW or theirs[-1] in eog


@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_ids_match(smollm2: ModelFile, reference: Reference, text: str) -> None:
    ours = smollm2.tokenizer.encode(text)
    assert ours == reference.token_ids[text]
    assert smollm2.tokenizer.decode(ours) == reference.decoded[text] == text


def test_chat_template_matches(smollm2: ModelFile, reference: Reference) -> None:
    assert smollm2.render_chat(CHAT) == reference.chat_text
    assert smollm2.apply_chat_template(CHAT) == reference.chat_ids


def test_prompt_logits_match(
    smollm2: ModelFile, smollm2_backend: NumpyBackend, reference: Reference
) -> None:
    ids = smollm2.tokenizer.encode(TOKENIZER_TEXTS[0])
    ours = smollm2_backend.forward(smollm2_backend.new_cache(), 0, tokens=ids, logits="all")
    theirs = reference.logits
    assert ours.shape == theirs.shape
    assert float(np.abs(ours - theirs).max() / np.abs(theirs).max()) < 1e-4


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match(
    smollm2: ModelFile, smollm2_backend: NumpyBackend, reference: Reference, prompt: str
) -> None:
    ids = smollm2.tokenizer.encode(prompt)
    ours = our_greedy(smollm2_backend, ids)
    assert_same_greedy(ours, reference.greedy[prompt], smollm2.config.eog_ids)


def test_greedy_chat_reply_matches(
    smollm2: ModelFile, smollm2_backend: NumpyBackend, reference: Reference
) -> None:
    ours = our_greedy(smollm2_backend, smollm2.apply_chat_template(CHAT))
    assert_same_greedy(ours, reference.greedy["chat"], smollm2.config.eog_ids)
    assert "Tokyo" in smollm2.tokenizer.decode(ours)
