"""The tokenizer of a GGUF model, rebuilt offline from its vocabulary.

A GGUF carries no ``tokenizer.json``; it stores the vocabulary, token types and either merges or
scores under llama.cpp's keys. The tokenizer is rebuilt from them, for one of two kinds
(``tokenizer.ggml.model``):

* ``gpt2``, byte-level BPE (SmolLM2, Qwen): tokens are spelled in the GPT-2 byte alphabet, the
  file lists the merges, and the pre-tokenizer is the one the ``tokenizer.ggml.pre`` name implies.
  A ``tokenizers`` BPE model runs it.
* ``llama``, SentencePiece BPE (llama.cpp's SPM vocabulary; Gemma 3): tokens are UTF-8 text with
  ``▁`` (U+2581) for a space, the file lists no merges but a score per token, and a character
  missing from the vocabulary falls back to its UTF-8 bytes as ``<0xNN>`` tokens. SentencePiece
  repeatedly joins the adjacent pair whose joined piece scores highest; the same result comes
  from BPE merges derived from the vocabulary: every cut of a token into two tokens is a merge,
  ranked by that token's score. The normalizer writes spaces as ``▁`` and, when
  ``tokenizer.ggml.add_space_prefix`` says so, prepends one (after each special token too, as
  llama.cpp does). User-defined tokens spelled with real spaces (Gemma's runs of 2-31 spaces) are
  respelled with ``▁`` and merged first, ahead of every scored token. `_spm.SpmCodec` runs these
  joins on the file's own arrays; the ``tokenizers`` model with the derived merges, which holds
  the vocabulary several times over (Gemma 3: 111 MB), is built only for `Tokenizer.to_json`.

In both kinds every control token (type 3) is special, so ``<|im_end|>`` and ``<end_of_turn>``
stay whole, and every other user-defined token (type 4: Gemma's newline and tab runs, HTML tags)
is matched whole in the text as llama.cpp matches it. The ids match llama.cpp and Hugging Face
on SmolLM2, and Hugging Face on Gemma 3.

Streaming detokenization works on bytes: each token maps to the bytes it stands for (a GPT-2
character or an SPM byte token to its byte, ``▁`` to a space), and an incremental UTF-8 decoder
holds back a multi-byte character until its last byte has arrived.
"""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, assert_never

import numpy as np
import numpy.typing as npt
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from .._errors import UnsupportedModelError
from .._util import release_free_memory
from ._gguf_file import StringArray
from ._spm import SPM_SPACE, SpmCodec, respelled_space_runs

__all__ = ["StreamDecoder", "Tokenizer", "bytes_to_unicode", "eog_ids_from_vocab"]

TokenizerKind = Literal["gpt2", "llama"]
TokenTypes = Sequence[int] | npt.NDArray[np.uint8]  # tokenizer.ggml.token_type

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL = 1
CONTROL = 3
USER_DEFINED = 4
BYTE = 6

_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Token texts llama.cpp treats as end of generation whatever their id (llama-vocab.cpp).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
})  # fmt: skip

# tokenizer.ggml.pre names whose regex isolates every digit before the GPT-2 split (llama.cpp).
_DIGIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character that spells it in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def eog_ids_from_vocab(tokens: Sequence[str], ids: Iterable[int | None]) -> frozenset[int]:
    """End-of-generation ids: the given ids (eos, eot, eom) plus tokens llama.cpp names EOG."""
    found = {int(i) for i in ids if i is not None}
    found.update(i for i, text in enumerate(tokens) if text in EOG_TEXTS)
    return frozenset(found)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _byte_level_backend(
    tokens: Sequence[str], merges: Sequence[str], pre: str | None
) -> tokenizers.Tokenizer:
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab, pairs))  # type: ignore[arg-type]
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(
    spelled: Sequence[str],
    types: TokenTypes,
    scores: Sequence[float],
    vocab: Mapping[str, int],
    respelled: Iterable[int],
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's merge-by-highest-score.

    Each token that the model may build (a normal token, or a respelled run of spaces) yields a
    merge for every cut into two vocabulary pieces. Merges are ranked by the built token: the
    respelled runs first (llama.cpp matches user-defined tokens before merging), then normal
    tokens by score, highest first, ties by id; among the cuts of one token the longer left piece
    goes first. Control, byte and other added tokens are never built from text.
    """
    normal = [i for i, kind in enumerate(types) if kind == NORMAL]
    normal.sort(key=lambda i: (-scores[i], i))
    merges: list[tuple[str, str]] = []
    for i in [*sorted(respelled), *normal]:
        text = spelled[i]
        for cut in range(len(text) - 1, 0, -1):
            left = text[:cut]
            if left in vocab:
                right = text[cut:]
                if right in vocab:
                    merges.append((left, right))
    return merges


def _spm_backend(
    tokens: Sequence[str],
    types: npt.NDArray[np.uint8],
    scores: Sequence[float],
    *,
    unknown_id: int | None,
    add_space_prefix: bool,
) -> tuple[tokenizers.Tokenizer, list[str]]:
    """The SentencePiece BPE backend, and the spelling of each token it was built with."""
    runs = respelled_space_runs(tokens, _ids_of(types, USER_DEFINED))
    spelled = [runs.get(i, text) for i, text in enumerate(tokens)]
    respelled = sorted(runs)
    vocab = {text: i for i, text in enumerate(spelled)}
    unk = spelled[unknown_id] if unknown_id is not None and 0 <= unknown_id < len(spelled) else None
    bpe = models.BPE(
        vocab,
        _spm_merges(spelled, types, scores, vocab, respelled),
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=False,  # one <unk> per unknown character, as llama.cpp writes them
    )
    backend = tokenizers.Tokenizer(bpe)
    # Added tokens split the text first; each piece between them is normalized on its own, so
    # Prepend puts a space after every special token as well as at the start (llama.cpp's rule).
    replace = normalizers.Replace(" ", SPM_SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPM_SPACE), replace])
        if add_space_prefix
        else replace
    )
    steps: list[decoders.Decoder] = [
        decoders.Replace(SPM_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the prefix the normalizer added
    backend.decoder = decoders.Sequence(steps)
    return backend, spelled


def _add_vocab_tokens(
    backend: tokenizers.Tokenizer,
    spelled: Sequence[str],
    tokens: Sequence[str],
    types: TokenTypes,
) -> None:
    """Control tokens as special tokens; user-defined ones the model cannot build as plain ones."""
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=False) if k == CONTROL
    ])  # fmt: skip
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, s, k in zip(tokens, spelled, types, strict=False) if k == USER_DEFINED and t == s
    ])  # fmt: skip


class StreamDecoder:
    """Turns generated token ids into text as they arrive, one complete character at a time."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe empty)."""
        if token_id in self._skip:
            return ""
        return str(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def flush(self) -> str:
        """Return what is still held back (an incomplete character becomes U+FFFD)."""
        text = str(self._utf8.decode(b"", final=True))
        self._utf8.reset()
        return text


def _types_array(token_types: TokenTypes, size: int) -> npt.NDArray[np.uint8]:
    """The token types as bytes; a file without them has normal tokens only."""
    if not len(token_types):
        return np.full(size, NORMAL, np.uint8)
    return np.asarray(token_types, np.uint8)


def _ids_of(types: npt.NDArray[np.uint8], kind: int) -> list[int]:
    ids: list[int] = np.flatnonzero(types == kind).tolist()
    return ids


class _HfCodec:
    """A ``tokenizers`` backend (the byte-level vocabularies)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend

    @functools.cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        """A copy that spells control-token strings out as ordinary text.

        Made through the tokenizer's JSON, whose parsing leaves the C heap holding several
        times the copy's size, so the free pages are handed back at once.
        """
        plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        release_free_memory()
        return plain

    def encode(self, text: str, *, special: bool) -> list[int]:
        backend = self._backend if special else self._plain
        # encode_batch releases the GIL (encode does not), so a worker thread that tokenizes a
        # long prompt leaves the event loop free; the ids are the same.
        ids: list[int] = backend.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special))

    def to_json(self) -> str:
        return str(self._backend.to_str())


class _SpmCodec(SpmCodec):
    """`SpmCodec`, and the ``tokenizers`` form of the same vocabulary made when asked for."""

    def __init__(
        self,
        tokens: Sequence[str],
        types: npt.NDArray[np.uint8],
        scores: Sequence[float],
        *,
        unknown_id: int | None,
        add_space_prefix: bool,
    ) -> None:
        user_defined = _ids_of(types, USER_DEFINED)
        spelled = respelled_space_runs(tokens, user_defined)
        super().__init__(
            tokens,
            scores,
            spelled,
            specials=_ids_of(types, CONTROL),
            plain_added=[i for i in user_defined if i not in spelled],
            buildable=_ids_of(types, NORMAL),
            unknown_id=unknown_id,
            add_space_prefix=add_space_prefix,
        )
        self._types = types
        self._scores = np.asarray(scores, np.float32)

    def to_json(self) -> str:
        """The ``tokenizers`` JSON of this vocabulary (for llguidance), built for the call
        only: Gemma 3's takes about a second and 50-100 MB while it lives."""
        tokens = self._tokens
        backend, spelled = _spm_backend(
            tokens, self._types, self._scores.tolist(),
            unknown_id=self._unknown, add_space_prefix=bool(self._prefix),
        )  # fmt: skip
        _add_vocab_tokens(backend, spelled, tokens, self._types)
        text = str(backend.to_str())
        del backend, spelled
        release_free_memory()
        return text


class Tokenizer:
    """The BPE tokenizer of a GGUF model, byte-level or SentencePiece; see `from_gguf_fields`."""

    def __init__(
        self,
        codec: _HfCodec | _SpmCodec,
        tokens: Sequence[str],
        token_types: TokenTypes,
        *,
        bos_id: int | None,
        eos_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        kind: TokenizerKind = "gpt2",
    ) -> None:
        self._codec = codec
        # a GGUF's own string array is kept as it is, decoded per use: a list would hold an
        # object per token (Gemma 3: 262,144 tokens, 28 MB in the server process)
        self._tokens: Sequence[str] = tokens if isinstance(tokens, StringArray) else list(tokens)
        # one byte a token: a list would hold 8 (Gemma 3: 2 MiB)
        self._types = _types_array(token_types, len(self._tokens))
        self.kind: TokenizerKind = kind
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.special_ids = frozenset(_ids_of(self._types, CONTROL))
        self._bytes_cache: dict[int, bytes] = {}

    def __repr__(self) -> str:
        return (
            f"<Tokenizer {self.kind} vocab={self.vocab_size} special={len(self.special_ids)} "
            f"bos={self.bos_id} eos={self.eos_id} add_bos={self.add_bos}>"
        )

    @classmethod
    def from_gguf_fields(
        cls,
        *,
        model: str | None,
        pre: str | None,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        bos_id: int | None,
        eos_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        scores: Sequence[float] = (),
        unknown_id: int | None = None,
        add_space_prefix: bool = True,
        source: str = "the model",
    ) -> Tokenizer:
        """Build the tokenizer from the ``tokenizer.ggml.*`` values of a GGUF file.

        Args:
            model, pre, tokens, token_types, merges: ``tokenizer.ggml.model``, ``.pre``,
                ``.tokens``, ``.token_type`` and ``.merges`` (merges for 'gpt2' only).
            scores, unknown_id, add_space_prefix: ``tokenizer.ggml.scores``,
                ``.unknown_token_id`` and ``.add_space_prefix`` ('llama' only; llama.cpp's
                default for a missing ``add_space_prefix`` is True).
            bos_id, eos_id, eog_ids, add_bos: the special ids, and whether ``encode`` prepends
                BOS by default (``tokenizer.ggml.add_bos_token``).
            source: the file's name, for error messages.
        """
        types = _types_array(token_types, len(tokens))
        kind: TokenizerKind
        codec: _HfCodec | _SpmCodec
        if model == "gpt2" and tokens:
            kind = "gpt2"
            backend = _byte_level_backend(tokens, merges, pre)
            _add_vocab_tokens(backend, tokens, tokens, types)
            codec = _HfCodec(backend)
        elif model == "llama" and tokens:
            if len(scores) != len(tokens) or len(types) != len(tokens):
                raise UnsupportedModelError(
                    f"{source} has a 'llama' tokenizer with {len(tokens)} tokens but "
                    f"{len(scores)} scores and {len(types)} token types; a SentencePiece "
                    "vocabulary needs one of each per token (tokenizer.ggml.scores, "
                    "tokenizer.ggml.token_type)."
                )
            kind = "llama"
            codec = _SpmCodec(
                tokens, types, scores, unknown_id=unknown_id, add_space_prefix=add_space_prefix
            )
        else:
            raise UnsupportedModelError(
                f"{source} has a {model!r} tokenizer"
                f"{'' if tokens else ' with no tokens'}; stagerun supports byte-level BPE "
                "('gpt2') and SentencePiece ('llama') vocabularies only."
            )
        return cls(
            codec,
            tokens,
            types,
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=eog_ids,
            add_bos=add_bos,
            kind=kind,
        )

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        Args:
            special: control-token strings in the text (``<|im_end|>``) become their ids; when
                False they are tokenized as plain text.
            add_bos: prepend the BOS id; None follows the model (``tokenizer.ggml.add_bos_token``).
        """
        ids = self._codec.encode(text, special=special)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; control tokens are written out unless ``skip_special``."""
        return self._codec.decode(ids, skip_special=skip_special)

    def to_json(self) -> str:
        """The tokenizer in Hugging Face ``tokenizers``' JSON form (for grammar engines)."""
        return self._codec.to_json()

    def longest_token_chars(self) -> int:
        """The characters of the longest vocabulary entry, as the file spells it."""
        if isinstance(self._tokens, StringArray):
            return int(self._tokens.char_lengths().max(initial=0))
        return max((len(text) for text in self._tokens), default=0)

    def token_text(self, token_id: int | None) -> str:
        """The vocabulary entry of a token as the file spells it ('' for None)."""
        return "" if token_id is None else self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a control token stands for its UTF-8 text)."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            if not 0 <= token_id < len(self._tokens):
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})."
                )
            text, kind = self._tokens[token_id], int(self._types[token_id])
            match self.kind:
                case "gpt2":
                    cached = _byte_level_bytes(text, kind)
                case "llama":
                    cached = _spm_bytes(text, kind)
                case _:
                    assert_never(self.kind)
            self._bytes_cache[token_id] = cached
        return cached

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer (one per generated sequence)."""
        return StreamDecoder(self, skip_special=skip_special)


def _byte_level_bytes(text: str, kind: int) -> bytes:
    table = _unicode_to_bytes()
    if kind in (CONTROL, USER_DEFINED) or not all(c in table for c in text):
        return text.encode("utf-8")
    return bytes(table[c] for c in text)


def _spm_bytes(text: str, kind: int) -> bytes:
    if kind in (CONTROL, USER_DEFINED):
        return text.encode("utf-8")  # as the file spells it: Gemma's "  " is two real spaces
    if kind == BYTE and (byte := _SPM_BYTE.fullmatch(text)):
        return bytes([int(byte.group(1), 16)])
    return text.replace(SPM_SPACE, " ").encode("utf-8")
