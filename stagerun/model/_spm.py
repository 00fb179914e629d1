"""SentencePiece BPE on the GGUF's own vocabulary arrays: no second copy of the vocabulary.

A Hugging Face ``tokenizers`` BPE built from Gemma 3's 262,144 tokens holds its vocabulary
twice over in hash maps and 513,511 derived merges: 111 MB of a process whose model share is a
few times that. `SpmCodec` encodes with the file's own arrays instead: the token strings stay
in the mapped file (`StringArray`), and the index from text to id is two numpy arrays (each
token's string hash, sorted, and the ids in that order: 3 MB), beside one rank per token.

The algorithm is the one the ``tokenizers`` backend ran (`Tokenizer`'s module docstring), so
the ids are the same:

* the text is first cut at added tokens, leftmost and longest first: the control tokens (unless
  ``special`` is off, when a matched control token stays text) and the user-defined ones;
* each piece between them gets the space prefix when the file asks for one, and its spaces
  written as ``▁``;
* the piece starts as one symbol per character, and the adjacent pair whose joined text ranks
  first is joined, again and again. A join is allowed when both sides are vocabulary entries
  and the joined text is a token the model may build: a user-defined run of spaces (respelled
  with ``▁``, ranked first, by id) or a normal token (by score, highest first, then id); among
  the joins that build the same token the longer left side goes first, among equal ranks the
  leftmost pair;
* a symbol left as a character the vocabulary lacks becomes its UTF-8 bytes as ``<0xNN>``
  tokens, or one unknown token when a byte token is missing, written (as ``tokenizers``
  writes it) before the next vocabulary entry, the next unknown token or at the end, so after
  any byte tokens between; with no unknown token such a character is left out before the
  joins, and its neighbours may join.

A symbol is named by the position of its first character, so its text is a slice of the piece.
Python runs the joins, a word at a time (cut before each run of spaces, except where a token
spans the cut: Gemma 3 has one, ``>▁</``), and keeps the ids of the words it has seen. On this
machine, 20,000 characters of English and Markdown: 58 ms the first time (``tokenizers``: 9 ms),
6 ms again; building it for Gemma 3 0.8 s and 15 MB.

Where the file spells a text twice, the text means its highest id, as a dict built in id order
has it. ``tokenizers`` resolves such duplicates otherwise in places (a join ranked by the last
merge listed for its pair, a control token matched by content, lower duplicates decoded as
nothing), so a vocabulary with duplicate spellings can get other ids there; Gemma 3 and
SmolLM2 have none. Byte tokens are the upper-case ``<0xNN>`` spellings only.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["SpmCodec", "TextIndex", "respelled_space_runs"]

SPM_SPACE = "\u2581"
_WORD_START = re.compile(f"(?<=[^{SPM_SPACE}]){SPM_SPACE}")  # a run of spaces after a character
_CROSSING = re.compile(f"[^{SPM_SPACE}]{SPM_SPACE}")
_MAX_CROSSING = 256  # more tokens than this that span a word start: pieces are joined whole
# What is kept of the texts seen (then the store starts over): a client's text makes these,
# so each is bounded in entries and, words, in length (at most ~4 MiB each)
_KEPT_WORDS = 1 << 14  # words and their ids
_KEPT_WORD_CHARS = 48  # the longest word kept, in characters and in ids (byte fallback)
_KEPT_LOOKUPS = 1 << 14  # texts looked up in the vocabulary (at most twice a token's length)


def respelled_space_runs(tokens: Sequence[str], user_defined: Iterable[int]) -> dict[int, str]:
    """The user-defined runs of spaces, respelled with ``▁`` where that spelling is free.

    ``user_defined``: the ids of the user-defined tokens. The text's spaces are written as
    ``▁`` before the joins, so a token spelled with real spaces (Gemma's runs of 2-31) could
    never be built; respelled, it is joined like any other.
    """
    taken = {text for text in tokens if text and not text.strip(SPM_SPACE)}
    spelled: dict[int, str] = {}
    for i in user_defined:
        text = tokens[i]
        if text and not text.strip(" ") and (respelled := SPM_SPACE * len(text)) not in taken:
            spelled[i] = respelled
            taken.add(respelled)
    return spelled


class TextIndex:
    """Token id by text over a sequence of strings, in two numpy arrays (12 bytes a token).

    Where a text occurs twice the higher id wins, as in a dict built in id order.
    """

    def __init__(self, texts: Sequence[str], spelled: Mapping[int, str]) -> None:
        self._texts, self._spelled = texts, spelled
        hashes = np.fromiter(map(hash, texts), np.int64, count=len(texts))
        for i, text in spelled.items():
            hashes[i] = hash(text)
        order = np.argsort(hashes, kind="stable")
        self._hashes: npt.NDArray[np.int64] = hashes[order]
        self._ids: npt.NDArray[np.int32] = order.astype(np.int32)

    def text(self, token_id: int) -> str:
        spelled = self._spelled.get(token_id)
        return self._texts[token_id] if spelled is None else spelled

    def get(self, text: str) -> int:
        """The id of ``text``, or -1 (about 4 us)."""
        key = hash(text)
        return self._verify(text, key, int(np.searchsorted(self._hashes, key, side="right")) - 1)

    def _verify(self, text: str, key: int, at: int) -> int:
        # equal hashes are neighbours in sort order; the last of them has the highest id
        while at >= 0 and self._hashes[at] == key:
            token_id = int(self._ids[at])
            if self.text(token_id) == text:
                return token_id
            at -= 1
        return -1


class SpmCodec:
    """Encodes text with a SentencePiece vocabulary held in the file's arrays (see the module)."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        spelled: Mapping[int, str],
        *,
        specials: Iterable[int],
        plain_added: Iterable[int],
        buildable: Iterable[int],
        unknown_id: int | None,
        add_space_prefix: bool,
    ) -> None:
        """
        Args:
            tokens, scores: the file's ``tokenizer.ggml`` arrays.
            spelled: the ids whose vocabulary spelling differs from the file's (runs of spaces
                respelled with ``▁``), ranked first in id order.
            specials, plain_added: the control tokens, and the user-defined tokens matched
                whole in the text.
            buildable: the normal tokens, ranked by score after the respelled ones.
        """
        self.vocab = TextIndex(tokens, spelled)
        normal = np.fromiter(buildable, np.int64)
        by_score = normal[np.lexsort((normal, -np.asarray(scores, np.float32)[normal]))]
        rank = np.full(len(tokens), -1, np.int32)
        first = sorted(spelled)
        rank[first] = np.arange(len(first), dtype=np.int32)
        rank[by_score] = np.arange(len(first), len(first) + len(by_score), dtype=np.int32)
        self._rank = rank
        self._tokens = tokens
        # an unknown id outside the vocabulary is no unknown token (as tokenizers takes it)
        self._unknown = (
            unknown_id if unknown_id is not None and 0 <= unknown_id < len(tokens) else None
        )
        self._prefix = SPM_SPACE if add_space_prefix else ""
        self._bytes = [self.vocab.get(f"<0x{b:02X}>") for b in range(256)]
        self._byte_of = {i: b for b, i in enumerate(self._bytes) if i >= 0}
        self._specials = frozenset(specials)
        self._added: dict[str, tuple[int, bool]] = {}
        for is_special, ids in ((False, plain_added), (True, self._specials)):
            for i in ids:
                self._added[tokens[i]] = (i, is_special)
        crossing = [
            text
            for text, r in zip(tokens, rank.tolist(), strict=True)
            if r >= 0 and text.find(SPM_SPACE, 1) > 0 and _CROSSING.search(text)
        ]
        self._whole = len(crossing) > _MAX_CROSSING
        self._crossing = (
            # longest first: at each start the longest token found spans every shorter one's cuts
            re.compile("(?=(" + "|".join(map(re.escape, sorted(crossing, key=len)[::-1])) + "))")
            if crossing
            else None
        )
        self._words: dict[str, tuple[int, ...]] = {}
        self._looked_up: dict[str, tuple[int, int]] = {}
        self._added_lengths: dict[str, list[int]] = {}
        for text in self._added:
            if text:
                self._added_lengths.setdefault(text[0], []).append(len(text))
        for lengths in self._added_lengths.values():
            lengths[:] = sorted(set(lengths), reverse=True)
        starts = "".join(map(re.escape, self._added_lengths))
        self._added_start = re.compile(f"[{starts}]" if starts else "(?!)")  # (?!): never

    def encode(self, text: str, *, special: bool) -> list[int]:
        """The ids of ``text``; control tokens in it are matched only when ``special``."""
        out: list[int] = []
        for piece, token in self._split(text, special):
            if token >= 0:
                out.append(token)
                continue
            piece = (self._prefix + piece).replace(" ", SPM_SPACE)
            if self._unknown is None:
                # what has no id at all is left out before any join, as tokenizers does: its
                # neighbours may then join
                piece = "".join(c for c in piece if self._lookup(c)[1] >= 0 or self._has_bytes(c))
            if self._whole:
                self._join(piece, out)
                continue
            words = self._words
            for word in self._cut(piece):
                ids = words.get(word)
                if ids is None:
                    joined: list[int] = []
                    self._join(word, joined)
                    ids = tuple(joined)
                    if len(word) <= _KEPT_WORD_CHARS and len(ids) <= _KEPT_WORD_CHARS:
                        if len(words) >= _KEPT_WORDS:
                            words.clear()
                        words[word] = ids
                out.extend(ids)
        return out

    def _cut(self, text: str) -> list[str]:
        """``text`` cut before each run of spaces that follows a character, where no token
        could span the cut: no join crosses it, so the words join alone to the same ids."""
        cuts = [m.start() for m in _WORD_START.finditer(text)]
        if self._crossing is not None and cuts:
            spanned: set[int] = set()
            for m in self._crossing.finditer(text):
                spanned.update(range(m.start() + 1, m.start() + len(m.group(1))))
            cuts = [at for at in cuts if at not in spanned]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    def decode(self, ids: Iterable[int], *, skip_special: bool) -> str:
        """The text of ``ids``, as the ``tokenizers`` decoder wrote it.

        ``▁`` reads as a space; a run of byte tokens is joined into UTF-8 (a run that is not
        valid UTF-8 reads as one U+FFFD per byte); one leading space is dropped where the file
        adds a space prefix; ids outside the vocabulary are skipped.
        """
        parts: list[str] = []
        run = bytearray()
        tokens = self._tokens
        size = len(tokens)
        for i in ids:
            if not 0 <= i < size or (skip_special and i in self._specials):
                continue
            byte = self._byte_of.get(i)
            if byte is not None:
                run.append(byte)
                continue
            if run:
                parts.append(_utf8(run))
                run.clear()
            parts.append(tokens[i].replace(SPM_SPACE, " "))
        if run:
            parts.append(_utf8(run))
        text = "".join(parts)
        return text[1:] if self._prefix and text.startswith(" ") else text

    def _split(self, text: str, special: bool) -> Iterator[tuple[str, int]]:
        """The text between added tokens as (text, -1), each added token as ("", id)."""
        lengths, added, next_start = self._added_lengths, self._added, self._added_start.search
        start = at = 0
        end = len(text)
        while at < end:
            if (first := next_start(text, at)) is None:
                break
            at = first.start()
            found = None
            for size in lengths.get(text[at], ()):
                found = added.get(text[at : at + size])
                if found is not None:
                    break
            if found is None:
                at += 1
                continue
            token, is_special = found
            if is_special and not special:
                at += size  # matched, so nothing inside it is matched, but kept as text
                continue
            if at > start:
                yield text[start:at], -1
            yield "", token
            at = start = at + size
        if start < end:
            yield text[start:], -1

    def _lookup(self, text: str) -> tuple[int, int]:
        """(rank, id) of ``text``: its id, or -1, and where its joins rank, or -1 when it is
        not a token that joins build. Remembered: the same texts come back, and a search
        costs 4 us."""
        found = self._looked_up.get(text)
        if found is None:
            token = self.vocab.get(text)
            found = (int(self._rank[token]) if token >= 0 else -1, token)
            if len(self._looked_up) >= _KEPT_LOOKUPS:
                self._looked_up.clear()
            self._looked_up[text] = found
        return found

    def _join(self, text: str, out: list[int]) -> None:
        """Append the ids of one normalized piece: the joins of the module's docstring."""
        n = len(text)
        if not n:
            return
        looked_up, lookup = self._looked_up, self._lookup
        ids = [(looked_up.get(c) or lookup(c))[1] for c in text]  # -1: not in the vocabulary
        size = [1] * n  # characters in the symbol starting here; 0 once joined to the left
        after = [*range(1, n), -1]
        before = list(range(-1, n - 1))
        # (rank, -left size, left start, joined size, joined id): the first is joined first
        queue: list[tuple[int, int, int, int, int]] = []
        for i in range(n - 1):
            if ids[i] >= 0 and ids[i + 1] >= 0:
                pair = text[i : i + 2]
                rank, joined = looked_up.get(pair) or lookup(pair)
                if rank >= 0:
                    queue.append((rank, -1, i, 2, joined))
        heapq.heapify(queue)
        pop, push = heapq.heappop, heapq.heappush
        while queue:
            _, _, left, joined_size, joined = pop(queue)
            right = after[left]
            if not size[left] or right < 0 or size[left] + size[right] != joined_size:
                continue  # one side was joined to something else since
            ids[left] = joined
            size[left], size[right] = joined_size, 0
            after[left] = after[right]
            if after[left] >= 0:
                before[after[left]] = left
            for a in (before[left], left):
                b = after[a] if a >= 0 else -1
                if b >= 0 and ids[a] >= 0 and ids[b] >= 0:
                    both = size[a] + size[b]
                    piece = text[a : a + both]
                    rank, token = looked_up.get(piece) or lookup(piece)
                    if rank >= 0:
                        push(queue, (rank, -size[a], a, both, token))
        # A character that is no vocabulary entry: its byte tokens, else one unknown token,
        # which (as tokenizers writes them) comes out only before the next vocabulary
        # entry, another unknown token or the end, after any byte tokens between.
        unknown = -1 if self._unknown is None else self._unknown
        pending = False
        at = 0
        while at >= 0:
            if ids[at] >= 0:
                if pending:
                    out.append(unknown)
                    pending = False
                out.append(ids[at])
            elif not self._write_bytes(text[at], out) and unknown >= 0:
                if pending:
                    out.append(unknown)
                pending = True
            at = after[at]
        if pending:
            out.append(unknown)

    def _has_bytes(self, char: str) -> bool:
        return all(self._bytes[b] >= 0 for b in char.encode("utf-8"))

    def _write_bytes(self, char: str, out: list[int]) -> bool:
        """Append ``char``'s byte tokens, if the vocabulary has all of them."""
        by_byte = [self._bytes[b] for b in char.encode("utf-8")]
        if all(i >= 0 for i in by_byte):
            out.extend(by_byte)
            return True
        return False


def _utf8(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)
