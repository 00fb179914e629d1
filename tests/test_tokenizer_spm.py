"""SentencePiece ('llama') vocabularies: a synthetic one, and Gemma 3 against transformers.

The synthetic vocabularies pin the algorithm down where it could go wrong unnoticed on a real
file: merges are chosen by the joined piece's score (not by the order the tokens are listed),
user-defined runs of spaces merge first, characters missing from the vocabulary fall back to
``<0xNN>`` byte tokens (or ``<unk>`` when there are none), and the space prefix follows
``add_space_prefix``. Gemma 3 270M is then checked token for token against Hugging Face
transformers loading the same GGUF.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import subprocess
import sys
from typing import Any

import llguidance
import pytest
import tokenizers
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from stagerun._engine._grammar import Grammars
from stagerun._errors import UnsupportedModelError
from stagerun.model import Tokenizer, open_model, resolve_model

UNKNOWN, CONTROL, USER_DEFINED, BYTE, NORMAL = 2, 3, 4, 6, 1


def _stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    return pieces, "".join(pieces) + decoder.flush()


# -- a handful of tokens ----------------------------------------------------------------------

# id: 0 <unk>, 1 <s>, 2 </s>, 3 <0xC3>, 4 <0xA9> (the bytes of "é"), 5 two real spaces, then
# the scored pieces from 6 on.
HEAD = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
HEAD += [("<0xC3>", BYTE), ("<0xA9>", BYTE), ("  ", USER_DEFINED)]
PIECES = ["▁", "a", "b", "c", "ab", "bc", "▁a"]
A, B, C, AB, BC, SPACE_A = (len(HEAD) + PIECES.index(p) for p in PIECES[1:])


def small_spm(scores: dict[str, float], *, add_space_prefix: bool = False) -> Tokenizer:
    """The vocabulary above, with these scores for the pieces (the rest score -10)."""
    return Tokenizer.from_gguf_fields(
        model="llama",
        pre="default",
        tokens=[t for t, _ in HEAD] + PIECES,
        token_types=[k for _, k in HEAD] + [NORMAL] * len(PIECES),
        # llama.cpp writes -1000 for Gemma's control and user-defined tokens
        scores=[-1000.0] * len(HEAD) + [scores.get(p, -10.0) for p in PIECES],
        merges=[],
        bos_id=1,
        eos_id=2,
        eog_ids=frozenset({2}),
        add_bos=False,
        unknown_id=0,
        add_space_prefix=add_space_prefix,
    )


def test_merges_follow_the_scores_not_the_listing_order() -> None:
    # "ab" is listed before "bc"; SentencePiece joins the pair whose joint piece scores higher.
    # A tokenizer that ranked merges by position (or ignored scores) fails one of the two.
    assert small_spm({"ab": -2.0, "bc": -1.0}).encode("abc") == [A, BC]
    assert small_spm({"ab": -1.0, "bc": -2.0}).encode("abc") == [AB, C]
    assert small_spm({"ab": -1.0, "bc": -2.0}).encode("cab") == [C, AB]
    assert small_spm({}).encode("cba") == [C, B, A]  # no piece "cb" or "ba"


def test_space_runs_merge_before_scored_pieces() -> None:
    # Gemma's user-defined "  " (two real spaces) is reached as "▁▁"; it wins over "▁a", which
    # would otherwise take the second space: "  a" is ["  ", "a"], not ["▁", "▁a"].
    tok = small_spm({"▁a": 0.0})
    assert tok.encode("  a") == [5, A]
    assert tok.encode(" a") == [SPACE_A]
    assert tok.token_bytes(5) == b"  "
    assert tok.decode([5, A]) == "  a"


def test_byte_fallback_and_unknown() -> None:
    tok = small_spm({})
    assert tok.encode("é") == [3, 4]  # not in the vocabulary: its UTF-8 bytes as <0xNN>
    assert tok.encode("zz") == [0, 0]  # no byte tokens for "z": one <unk> per character
    assert (tok.token_bytes(3), tok.token_bytes(4)) == (b"\xc3", b"\xa9")
    assert tok.decode([A, 3, 4]) == "aé"
    decoder = tok.stream_decoder()
    assert [decoder.push(i) for i in (A, 3, 4)] == ["a", "", "é"]


def test_space_prefix_follows_the_file() -> None:
    plain, prefixed = small_spm({}), small_spm({}, add_space_prefix=True)
    assert plain.encode("a b") == [A, 6, B]
    assert prefixed.encode("a b") == [SPACE_A, 6, B]
    assert prefixed.decode(prefixed.encode("a b")) == "a b"  # the prefix is not written out
    # llama.cpp also prefixes the text after a special token
    assert prefixed.encode("<s>a") == [1, SPACE_A]
    assert plain.encode("<s>a") == [1, A]
    assert plain.encode("") == prefixed.encode("") == []


def test_special_tokens_in_a_small_vocabulary() -> None:
    tok = small_spm({})
    assert tok.kind == "llama"
    assert tok.special_ids == frozenset({1, 2})
    assert tok.encode("a</s>") == [A, 2]
    assert tok.decode([1, A, 2]) == "<s>a</s>"
    assert tok.decode([1, A, 2], skip_special=True) == "a"
    assert tok.encode("a", add_bos=True) == [1, A]
    assert tok.token_bytes(2) == b"</s>"


def full_byte_spm(add_space_prefix: bool) -> Tokenizer:
    """Every byte has its <0xNN> token, so any text can be written."""
    pieces = ["▁", "▁t", "h", "e", "he", "▁the", "t", "é", "日本", "日", "本"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    kinds = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    return Tokenizer.from_gguf_fields(
        model="llama",
        pre=None,
        tokens=tokens,
        token_types=kinds,
        scores=[0.0] * 259 + [-float(i) for i in range(len(pieces))],
        merges=[],
        bos_id=1,
        eos_id=2,
        eog_ids=frozenset({2}),
        add_bos=True,
        unknown_id=0,
        add_space_prefix=add_space_prefix,
    )


FULL_BYTE = {prefix: full_byte_spm(prefix) for prefix in (False, True)}


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40).filter(lambda t: "▁" not in t), st.booleans())
def test_full_byte_round_trip(text: str, prefix: bool) -> None:
    tok = FULL_BYTE[prefix]
    ids = tok.encode(text, special=False)
    assert ids[0] == 1  # add_bos
    assert 0 not in ids  # byte fallback covers everything, no <unk>
    assert tok.decode(ids[1:]) == text
    # decode drops the prefix; a stream keeps it, as a generated "▁Paris" is " Paris"
    assert _stream(tok, ids[1:])[1] == (" " + text if prefix and text else text)


def test_full_byte_merges() -> None:
    tok = FULL_BYTE[False]
    plain = tok.encode("</s>", special=False, add_bos=False)
    assert 2 not in plain and tok.decode(plain) == "</s>"  # spelled out in byte tokens
    the = tok.encode(" the", add_bos=False)
    assert [tok.token_text(i) for i in the] == ["▁the"]
    assert [tok.token_text(i) for i in tok.encode("日本語", add_bos=False)] == [
        "日本", "<0xE8>", "<0xAA>", "<0x9E>",
    ]  # fmt: skip


def test_a_token_spanning_two_word_starts_is_joined_whole() -> None:
    # The text is joined a word at a time, except across word starts that a token spans:
    # "a▁b▁" spans both of "a b "'s. Cutting where only the shorter "a▁b" spans would give
    # ["a▁b", "▁"].
    pieces = ["▁", "a", "b", "a▁b", "a▁", "a▁b▁"]
    tok = Tokenizer.from_gguf_fields(
        model="llama", pre=None, tokens=pieces, token_types=[NORMAL] * len(pieces),
        scores=[0.0, 0.0, 0.0, -2.0, -1.0, -3.0], merges=[], bos_id=None, eos_id=None,
        eog_ids=frozenset(), add_bos=False, add_space_prefix=False,
    )  # fmt: skip
    reference = tokenizers.Tokenizer.from_str(tok.to_json())
    for text, ids in (("a b ", [5]), ("a b b", [5, 2]), ("b a b a", [2, 0, 5, 1])):
        assert tok.encode(text) == reference.encode(text).ids == ids


# -- any small vocabulary, against the tokenizers library ---------------------------------------

# Every piece of two to four characters over "a", "b" and "▁": a vocabulary draws some of them,
# so that tokens overlap, span word starts ("b▁b") and tie on score in every way.
# ("bab" is left to the control token below: the file spells no token twice)
_PIECES = ["".join(p) for n in (2, 3, 4) for p in itertools.product("ab▁", repeat=n)]
_PIECES.remove("bab")
# control tokens (one holding a user-defined token, one spelled like pieces that joins must not
# build), user-defined ones; then some of the 256 byte tokens
_ADDED = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("<sb>", CONTROL), ("bab", CONTROL)]
_ADDED += [("  ", USER_DEFINED), ("b>", USER_DEFINED)]
_TEXT = st.lists(
    st.sampled_from(["a", "b", " "])
    | st.sampled_from(["  ", "<s>", "<sb>", "bab", "b>", "x", "é", "<", "z"]),
    max_size=24,
)
# every byte token, or those of "x" and "é" only (so "<" and "z" have neither an id nor bytes)
_BYTES = st.sampled_from([range(256), [0x78, 0xC3, 0xA9], [0xC3]])


@st.composite
def _any_spm(draw: st.DrawFn) -> Tokenizer:
    pieces = ["a", "b", "▁", *draw(st.lists(st.sampled_from(_PIECES), unique=True, max_size=60))]
    score = st.sampled_from([-1.0, -2.0, -3.0]) | st.floats(-5.0, 0.0)
    scores = draw(st.lists(score, min_size=len(pieces), max_size=len(pieces)))
    head = _ADDED + [(f"<0x{b:02X}>", BYTE) for b in draw(_BYTES)]
    # an unknown token, none, or an id past the vocabulary (which is none)
    unknown = draw(st.sampled_from([0, None, 10_000]))
    return Tokenizer.from_gguf_fields(
        model="llama", pre=None,
        tokens=[t for t, _ in head] + pieces,
        token_types=[k for _, k in head] + [NORMAL] * len(pieces),
        scores=[0.0] * len(head) + scores,
        merges=[], bos_id=1, eos_id=2, eog_ids=frozenset({2}), add_bos=False, unknown_id=unknown,
        add_space_prefix=draw(st.booleans()),
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_any_spm(), st.lists(_TEXT.map("".join), min_size=1, max_size=8), st.data())
def test_any_vocabulary_encodes_and_decodes_as_tokenizers_does(
    tok: Tokenizer, texts: list[str], data: st.DataObject
) -> None:
    # The compact encoder against the Rust BPE of the same vocabulary (`Tokenizer.to_json`,
    # what llguidance is given): ranks, ties, word cuts, added tokens, byte fallback, the
    # unknown token (written after the byte tokens that follow it), characters left out.
    reference = tokenizers.Tokenizer.from_str(tok.to_json())
    plain = tokenizers.Tokenizer.from_str(tok.to_json())
    plain.encode_special_tokens = True
    for text in texts:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, special=False) == plain.encode(text, add_special_tokens=False).ids
    # any ids, byte tokens that do not make UTF-8 among them
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size + 1), max_size=12))
    for skip in (False, True):
        assert tok.decode(ids, skip_special=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_llama_vocabulary_needs_scores_and_unknown_models_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="0 scores"):
        Tokenizer.from_gguf_fields(
            model="llama", pre=None, tokens=["a"], token_types=[1], merges=[],
            bos_id=None, eos_id=None, eog_ids=frozenset(), add_bos=False,
        )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"'bert' tokenizer.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf_fields(
            model="bert", pre=None, tokens=["a"], token_types=[1], merges=[],
            bos_id=None, eos_id=None, eog_ids=frozenset(), add_bos=False,
        )  # fmt: skip


# -- Gemma 3 against transformers ---------------------------------------------------------------

GEMMA_TEXTS = [
    "",
    " ",
    "Hello, world!",
    "The capital of France is",
    " leading space",
    "trailing space ",
    "  leading spaces\tand tabs\n\nnew lines  ",
    "forty spaces" + " " * 40 + "then tabs" + "\t" * 35 + "then newlines" + "\n" * 40,
    "Numbers 12345 and 3.14159, dates 2024-01-31.",
    "I'm sure they'll say it's fine; we've done it.",
    "Accents: café, naïve, Ångström, Zürich, façade, jalapeño.",
    "Combining: e\u0301 a\u0308 n\u0303 \u1e9b\u0323 and Hangul jamo \u1100\u1161\u11a8",
    "CJK: 日本語のテキスト, 中文字符, 한국어 문장.",
    "Emoji: 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵, shaking 🫨",
    "Rare: \U0001d11e \U00010348 \U0001f9ff \ue000 \u2fff \U000e0041 \x00\x01\x7f",
    "def f(x: int) -> dict:\n    return {'a': [x ** 2 for _ in range(10)]}  # 100%\n",
    "if x:\n\tif y:\n\t\treturn {\n\t\t\t'k': 1,\n\t\t}\r\n    }   // three spaces\n",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<bos>tags <b>bold</b> <table><tr><td>x</td></tr></table> [multimodal] <unk><pad>",
    "<0x41> spells a byte token as text",
    # ">▁</" is a token that spans the start of a word: the text is not cut there
    "x> </y, if a> </b: <p> </p> 1 > </ 2",
]


@pytest.fixture(scope="module")
def gemma_path() -> pathlib.Path:
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma(gemma_path: pathlib.Path) -> Tokenizer:
    return open_model(gemma_path).tokenizer


@pytest.fixture(scope="module")
def reference(gemma_path: pathlib.Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name
    )


@pytest.mark.slow
def test_gemma_fields(gemma: Tokenizer) -> None:
    assert gemma.kind == "llama"
    assert gemma.vocab_size == 262144
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos) == (2, 1, True)
    assert {1, 106} <= gemma.eog_ids  # <eos>, <end_of_turn>
    assert len(gemma.special_ids) == 6249


@pytest.mark.slow
@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_matches_transformers(gemma: Tokenizer, reference: Any, text: str) -> None:
    ids = gemma.encode(text, add_bos=False)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert gemma.encode(text) == reference.encode(text) == [2, *ids]
    plain = gemma.encode(text, special=False, add_bos=False)
    assert plain == reference.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert gemma.decode(ids) == reference.decode(ids)
    assert gemma.decode(ids, skip_special=True) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_round_trip(gemma: Tokenizer, text: str) -> None:
    for special in (True, False):
        ids = gemma.encode(text, special=special, add_bos=False)
        assert gemma.decode(ids) == text
        assert _stream(gemma, ids)[1] == text


@pytest.mark.slow
def test_gemma_stream_holds_back_split_emoji(gemma: Tokenizer) -> None:
    ids = gemma.encode("Shaking 🫨!", add_bos=False)  # U+1FAE8 is not in the vocabulary
    assert [gemma.token_text(i) for i in ids[-5:]] == [
        "<0xF0>", "<0x9F>", "<0xAB>", "<0xA8>", "!",
    ]  # fmt: skip
    pieces, text = _stream(gemma, ids)
    assert text == "Shaking 🫨!"
    assert pieces[-5:] == ["", "", "", "🫨", "!"]
    assert gemma.token_bytes(ids[-5]) == b"\xf0"


@pytest.mark.slow
def test_gemma_special_tokens(gemma: Tokenizer) -> None:
    text = "<start_of_turn>user\nHi<end_of_turn>"
    ids = gemma.encode(text, add_bos=False)
    assert ids[0] == 105 and ids[-1] == 106 and 107 in ids  # "\n" is a user-defined token
    plain = gemma.encode(text, special=False, add_bos=False)
    assert not {105, 106} & set(plain)
    assert gemma.decode(plain) == text
    assert gemma.decode([2, *ids], skip_special=True) == "user\nHi"
    assert gemma.token_bytes(106) == b"<end_of_turn>"
    assert gemma.token_bytes(gemma.encode(" the", add_bos=False)[0]) == b" the"
    decoder = gemma.stream_decoder(skip_special=True)
    assert "".join(decoder.push(i) for i in ids) == "user\nHi"


# Builds Gemma 3's tokenizer in a fresh interpreter, encodes with and without control tokens,
# and reports how much resident memory that added to a process that had read the file.
_TOKENIZER_RSS = """
import json, sys
from stagerun.model import open_model
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
model = open_model(sys.argv[1])
model.config
before = rss_mib()
tokenizer = model.tokenizer
for special in (True, False):
    tokenizer.encode("<start_of_turn>user\\nOnce upon a time<end_of_turn>", special=special)
print(json.dumps({"growth_mib": rss_mib() - before}))
"""


@pytest.mark.slow
def test_gemma_tokenizer_holds_no_copy_of_the_vocabulary(gemma_path: pathlib.Path) -> None:
    # Gemma 3's 262,144 tokens built into a tokenizers BPE held 111 MB (and its copy for
    # special=False 94 MB more); the file's own arrays with a hash index hold 15.
    out = subprocess.run(
        [sys.executable, "-c", _TOKENIZER_RSS, str(gemma_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    growth = json.loads(out.stdout.splitlines()[-1])["growth_mib"]
    assert growth < 40, f"the tokenizer added {growth:.0f} MiB of resident memory"


# Pieces of text where Gemma's vocabulary is particular: runs of spaces, newlines and tabs
# (user-defined tokens), a token spanning a word start, control tokens, HTML tags, the
# metaspace itself, characters it lacks (byte fallback), and ordinary words.
_GEMMA_PIECES = st.sampled_from([
    " ", "  ", "   ", "\n", "\n\n", "\t", "\t\t", "> </", "<b>", "</b>", "<start_of_turn>",
    "<end_of_turn>", "<bos>", "\u2581", "the", " the", "The", "ing", "日本", "🫨", "👍🏽", "é",
    "e\u0301", "12", "3.5", "'s", "--", "==", "{", "}", "<0x41>", "\x00",
])  # fmt: skip


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(st.lists(_GEMMA_PIECES | st.text(max_size=4), max_size=12).map("".join))
def test_gemma_matches_transformers_on_any_text(
    gemma: Tokenizer, reference: Any, text: str
) -> None:
    assert gemma.encode(text, add_bos=False) == reference.encode(text, add_special_tokens=False)
    plain = gemma.encode(text, special=False, add_bos=False)
    assert plain == reference.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert gemma.decode(plain) == reference.decode(plain)


@pytest.mark.slow
def test_gemma_metaspace_in_the_text_reads_as_a_space(gemma: Tokenizer, reference: Any) -> None:
    # A literal "▁" is the vocabulary's own space, so it comes back as " ": the one text where
    # the round trip is lossy, in transformers as here.
    ids = gemma.encode("a▁b", add_bos=False)
    assert ids == reference.encode("a▁b", add_special_tokens=False)
    assert gemma.decode(ids) == reference.decode(ids) == "a b"


@pytest.mark.slow
def test_gemma_grammars_are_compiled_over_the_same_vocabulary(gemma: Tokenizer) -> None:
    # llguidance reads the tokenizers JSON that `to_json` builds for the call; a grammar then
    # accepts the ids the compact encoder gives its text and refuses others.
    grammars = Grammars(gemma, gemma.vocab_size)
    matcher = grammars.matcher(
        llguidance.LLMatcher.grammar_from_regex("(cat|dog)s? and (cat|dog)s?")
    )
    ids = gemma.encode("cats and dog", add_bos=False)
    assert matcher.valid_prefix(ids) == len(ids)
    refused = gemma.encode("cats or dogs", add_bos=False)
    assert matcher.valid_prefix(refused) == 1  # "cats"


def test_what_the_encoder_keeps_of_the_texts_it_saw_is_bounded() -> None:
    # A client chooses the texts: the words and lookups the encoder keeps stay few and short.
    from stagerun.model import _spm

    tok = FULL_BYTE[False]
    codec = tok._codec
    for k in range(3 * _spm._KEPT_WORDS // 1000):
        tok.encode(" ".join(f"{k}x{i}" for i in range(1000)), add_bos=False)
    tok.encode("the" * 10_000, add_bos=False)  # one long word
    assert 0 < len(codec._words) <= _spm._KEPT_WORDS
    assert max(map(len, codec._words)) <= _spm._KEPT_WORD_CHARS
    assert 0 < len(codec._looked_up) <= _spm._KEPT_LOOKUPS
