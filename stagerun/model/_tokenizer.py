"""A byte-level BPE tokenizer built offline from a GGUF vocabulary.

A GGUF carries no ``tokenizer.json``; it stores the vocabulary, merges and token types under
llama.cpp's keys. We rebuild the tokenizer with the ``tokenizers`` library: a BPE model over the
GPT-2 byte alphabet, the pre-tokenizer the ``tokenizer.ggml.pre`` name implies, and every control
token (type 3) added as a special token so that ``<|im_end|>`` stays whole. The result matches
llama.cpp and Hugging Face on the default model.

Streaming detokenization works on bytes: each token maps to the bytes it stands for, and an
incremental UTF-8 decoder holds back a multi-byte character until its last byte has arrived.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from .._errors import UnsupportedModelError

__all__ = ["StreamDecoder", "Tokenizer", "bytes_to_unicode", "eog_ids_from_vocab"]

CONTROL = 3
USER_DEFINED = 4

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


class Tokenizer:
    """Byte-level BPE tokenizer of a GGUF model; see :meth:`from_gguf_fields`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokens: Sequence[str],
        token_types: Sequence[int],
        *,
        bos_id: int | None,
        eos_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
    ) -> None:
        self._backend = backend
        self._tokens = list(tokens)
        self._types = list(token_types) or [1] * len(self._tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.special_ids = frozenset(i for i, t in enumerate(self._types) if t == CONTROL)
        self._bytes_cache: dict[int, bytes] = {}

    def __repr__(self) -> str:
        return (
            f"<Tokenizer vocab={self.vocab_size} special={len(self.special_ids)} "
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
        source: str = "the model",
    ) -> Tokenizer:
        """Build the tokenizer from the ``tokenizer.ggml.*`` values of a GGUF file."""
        if model != "gpt2" or not tokens:
            raise UnsupportedModelError(
                f"{source} has a {model!r} tokenizer; stagerun supports byte-level BPE "
                f"('gpt2') vocabularies only."
            )
        vocab = {text: i for i, text in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab, pairs)  # type: ignore[arg-type]
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        types = list(token_types)
        backend.add_special_tokens([
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=False) if k == CONTROL
        ])  # fmt: skip
        backend.add_tokens([
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED
        ])  # fmt: skip
        return cls(
            backend, tokens, types, bos_id=bos_id, eos_id=eos_id, eog_ids=eog_ids, add_bos=add_bos
        )

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy that spells control-token strings out as ordinary text."""
        plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        Args:
            special: control-token strings in the text (``<|im_end|>``) become their ids; when
                False they are tokenized as plain text.
            add_bos: prepend the BOS id; None follows the model (``tokenizer.ggml.add_bos_token``).
        """
        backend = self._backend if special else self._plain_backend
        # encode_batch releases the GIL (encode does not), so a worker thread that tokenizes a
        # long prompt leaves the event loop free; the ids are the same.
        ids: list[int] = backend.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; control tokens are written out unless ``skip_special``."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special))

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
            text = self._tokens[token_id]
            table = _unicode_to_bytes()
            if self._types[token_id] in (CONTROL, USER_DEFINED) or not all(
                c in table for c in text
            ):
                cached = text.encode("utf-8")
            else:
                cached = bytes(table[c] for c in text)
            self._bytes_cache[token_id] = cached
        return cached

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer (one per generated sequence)."""
        return StreamDecoder(self, skip_special=skip_special)
