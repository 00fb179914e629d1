"""The GGUF-built tokenizer, streaming detokenization and chat templates."""

from __future__ import annotations

import gc
import pathlib
import tracemalloc

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagerun._errors import UnsupportedModelError
from stagerun.model import (
    CHATML_TEMPLATE,
    ChatTemplateError,
    ModelFile,
    Tokenizer,
    open_model,
    render_chat,
)
from stagerun.model._gguf_file import StringArray

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEXTS = [
    "Hello, world!",
    "The capital of France is",
    "  leading spaces\tand tabs\n\nnew lines  ",
    "Numbers 12345 and 3.14159, dates 2024-01-31.",
    "Accents: café, naïve, Ångström, Zürich.",
    "CJK: 日本語のテキスト, 中文, 한국어.",
    "Emoji: 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # code\n",
    "I'm sure they'll say it's fine; we've done it.",
]


def _stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    return pieces, "".join(pieces) + decoder.flush()


# -- tiny model ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_tiny_round_trip(tiny_tokenizer: Tokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text
    assert _stream(tiny_tokenizer, ids)[1] == text
    assert all(0 <= i < tiny_tokenizer.vocab_size for i in ids)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model: ModelFile) -> Tokenizer:
    return tiny_model.tokenizer


def test_tiny_merges_apply(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("the")
    assert len(ids) == 2  # "t" + "he"; "Ġthe" needs a leading space
    assert len(tiny_tokenizer.encode(" the")) == 1


def test_tiny_special_tokens(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tiny_tokenizer.encode("<|im_end|>") == [2]
    plain = tiny_tokenizer.encode("<|im_end|>", special=False)
    assert 2 not in plain and len(plain) > 1
    assert tiny_tokenizer.decode(plain) == "<|im_end|>"
    a = tiny_tokenizer.encode("a")[0]
    assert tiny_tokenizer.decode([1, a, 2], skip_special=True) == "a"
    assert tiny_tokenizer.decode([1, a, 2]) == "<|im_start|>a<|im_end|>"


def test_add_bos_follows_the_model(tiny_tokenizer: Tokenizer) -> None:
    assert not tiny_tokenizer.add_bos
    assert tiny_tokenizer.encode("a")[0] != 1
    assert tiny_tokenizer.encode("a", add_bos=True)[0] == 1


def test_only_byte_level_bpe_is_supported() -> None:
    with pytest.raises(UnsupportedModelError, match="'llama' tokenizer"):
        Tokenizer.from_gguf_fields(
            model="llama", pre=None, tokens=["a"], token_types=[1], merges=[],
            bos_id=None, eos_id=None, eog_ids=frozenset(), add_bos=False,
        )  # fmt: skip


def test_stream_decoder_skip_special(tiny_tokenizer: Tokenizer) -> None:
    decoder = tiny_tokenizer.stream_decoder(skip_special=True)
    a = tiny_tokenizer.encode("a")[0]
    assert [decoder.push(i) for i in (1, a, 2)] == ["", "a", ""]


def test_stream_decoder_flush_reports_a_dangling_byte(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("é")  # two byte tokens in the tiny vocabulary
    assert len(ids) == 2
    decoder = tiny_tokenizer.stream_decoder()
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.push(tiny_tokenizer.encode("a")[0]) == "a"  # usable again after flush


def test_token_bytes_range(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_tokenizer.token_bytes(10_000)


# -- chat templates ---------------------------------------------------------------------------


def test_render_chatml() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text = render_chat(CHATML_TEMPLATE, messages, bos_token="", eos_token="")
    assert (
        text
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # noqa: E501
    )
    text = render_chat(
        CHATML_TEMPLATE, messages, add_generation_prompt=False, bos_token="", eos_token=""
    )
    assert text.endswith("Hi<|im_end|>\n")


def test_template_raise_exception() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    assert (
        render_chat(template, [{"role": "user", "content": ""}], bos_token="", eos_token="") == "ok"
    )
    with pytest.raises(ChatTemplateError, match="user first"):
        render_chat(template, [{"role": "system", "content": ""}], bos_token="", eos_token="")


def test_template_helpers_and_errors() -> None:
    template = "{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y') | length }}"
    text = render_chat(template, [{"role": "user", "content": "é"}], bos_token="<s>", eos_token="")
    assert text == '<s>[{"role": "user", "content": "é"}]4'
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat("{% for %}", [], bos_token="", eos_token="")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute games
        render_chat("{{ ''.__class__.__mro__ }}", [], bos_token="", eos_token="")


def test_a_model_without_a_template_refuses_chat_unless_given_one(
    tiny_model_path: pathlib.Path,
) -> None:
    model = open_model(tiny_model_path)
    own = model.chat_template
    model.chat_template = None  # a base model's file, like Gemma 3 270M's
    try:
        with pytest.raises(ChatTemplateError, match=r"has no chat template.*--chat-template"):
            model.apply_chat_template([{"role": "user", "content": "hi"}])
        ids = model.apply_chat_template([{"role": "user", "content": "hi"}], template=own)
        assert model.tokenizer.decode(ids) == (
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        )
        assert ids[0] == 1 and ids.count(2) == 1
        family = model.config.family
        model.config = attrs.evolve(
            model.config, family=attrs.evolve(family, chat_template="{{ messages[0]['content'] }}!")
        )
        try:  # a family's template stands in for the file's
            assert model.render_chat([{"role": "user", "content": "hi"}]) == "hi!"
        finally:
            model.config = attrs.evolve(model.config, family=family)
    finally:
        model.chat_template = own


# -- the default model -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smollm2: ModelFile, text: str) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert _stream(tok, ids)[1] == text


@pytest.mark.slow
def test_smollm2_matches_llama_cpp(smollm2: ModelFile) -> None:
    # ids llama.cpp's /tokenize returned for this text (python-notes section 1)
    assert smollm2.tokenizer.encode("Once upon a time") == [6403, 1980, 253, 655]
    assert smollm2.tokenizer.vocab_size == 49152
    assert not smollm2.tokenizer.add_bos


@pytest.mark.slow
def test_smollm2_special_tokens(smollm2: ModelFile) -> None:
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]
    assert tok.encode("<|endoftext|>") == [0]
    assert len(tok.encode("<|im_end|>", special=False)) > 1
    assert (tok.bos_id, tok.eos_id, tok.eog_ids) == (1, 2, frozenset({0, 2}))


@pytest.mark.slow
def test_smollm2_stream_holds_back_split_emoji(smollm2: ModelFile) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("Party 🎉!")
    assert len(ids) >= 4  # the emoji takes several byte tokens
    pieces, text = _stream(tok, ids)
    assert text == "Party 🎉!"
    assert "" in pieces[1:]  # a token that ended mid-character produced nothing yet
    assert all("\ufffd" not in p for p in pieces)
    assert "🎉" in pieces


@pytest.mark.slow
def test_smollm2_chat_template_is_chatml(smollm2: ModelFile) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    text = smollm2.render_chat(messages)
    assert text == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm2.apply_chat_template(messages)
    assert ids[:3] == [1, 9690, 198]  # <|im_start|> system \n
    assert ids[-3:] == [1, 520, 9531, 198][-3:]
    assert smollm2.tokenizer.decode(ids) == text
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert SMOL_SYSTEM not in smollm2.render_chat(with_system, add_generation_prompt=False)


def test_a_gguf_s_tokenizer_holds_no_python_object_per_token() -> None:
    """The vocabulary stays the file's string array, read in place: a list of the 49,152
    tokens would hold ~3 MB of Python objects here (Gemma 3's 262,144: 28 MB)."""
    model = open_model("smollm2")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tokenizer = model.tokenizer
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tokenizer.vocab_size == 49152
    assert held < 1_000_000, f"the tokenizer holds {held / 1e6:.1f} MB of Python objects"
    assert tokenizer.token_text(2) == "<|im_end|>" and tokenizer.token_bytes(28) == b","


@given(st.lists(st.text(max_size=6), max_size=12))
def test_string_array_char_lengths_count_characters_without_decoding(items: list[str]) -> None:
    """Laid out as a GGUF string array (each item after its 8-byte length), empty items and
    multi-byte characters included."""
    blob, starts, ends = b"", [], []
    for item in items:
        raw = item.encode("utf-8")
        blob += len(raw).to_bytes(8, "little")
        starts.append(len(blob))
        blob += raw
        ends.append(len(blob))
    array = StringArray(memoryview(blob), np.array(starts, np.int64), np.array(ends, np.int64))
    assert list(array) == items
    assert array.char_lengths().tolist() == [len(item) for item in items]
