"""The GGUF file format as stagerun reads it: bounds on a header, and a fast reader.

`check_gguf_header` walks a header once, cheaply, and refuses counts and lengths the file
cannot hold or that pass the ``MAX_GGUF_*`` bounds, before `GgufReader` (``gguf.GGUFReader``
with arrays read in one piece) parses it. `stagerun.model.ModelFile` is built on both.
"""

from __future__ import annotations

import array
import math
import mmap
import os
import pathlib
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Literal, overload

import gguf
import numpy as np
import numpy.typing as npt

from .._errors import ModelError

__all__ = ["GgufReader", "StringArray", "StringIndex", "check_gguf_header"]

#: Where the strings of each array of strings lie, by the offset of its first item: the
#: ``(starts, ends)`` of their bytes. `check_gguf_header` makes it and `GgufReader` reads it.
StringIndex = dict[int, tuple["npt.NDArray[np.int64]", "npt.NDArray[np.int64]"]]

# Bounds on a GGUF header, checked before gguf.GGUFReader walks it: the reader builds numpy
# objects for every key (~45 us and ~4 KiB), tensor (~80 us, ~6 KiB) and nested array (~25 us,
# ~2.5 KiB), so a few bytes announcing many of them cost seconds and gigabytes. Every count must
# also fit in the bytes the file has left. At every bound at once the reader takes about 2 s.
MAX_GGUF_KEYS = 1 << 12  # real models carry 30-60 metadata keys
MAX_GGUF_TENSORS = 1 << 13  # a 30-layer llama has 272 tensors, a 126-layer one about 1,140
MAX_GGUF_KEY_BYTES = 65535  # the GGUF spec's limit on a key's length
MAX_GGUF_ARRAY_ITEMS = 1 << 20  # 4x Gemma 3's 262,144-token vocabulary (SmolLM2: 49,152)
MAX_GGUF_METADATA_ITEMS = 1 << 21  # all arrays together: Gemma 3's tokens+scores+types ~786k
MAX_GGUF_ARRAY_DEPTH = 2  # arrays of arrays, at most; no model nests deeper
MAX_GGUF_NESTED_ARRAYS = 1 << 10  # arrays inside arrays, all together; llama.cpp reads none
MAX_GGUF_DIMS = 4  # GGML_MAX_DIMS


class StringArray(Sequence[str]):
    """A GGUF array of strings, read in place: each item is decoded when it is asked for.

    Holds the mapped file and one offset per item (8 bytes), not an object per item: Gemma 3's
    262,144 tokens held as ``memoryview`` slices took 60 MB in every stage process.
    """

    def __init__(self, data: Any, starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]):
        self._data, self._starts, self._ends = data, starts, ends

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start, end = int(self._starts[index]), int(self._ends[index])
        return bytes(self._data[start:end]).decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        data = self._data
        for start, end in zip(self._starts.tolist(), self._ends.tolist(), strict=True):
            yield bytes(data[start:end]).decode("utf-8")

    def char_lengths(self) -> npt.NDArray[np.int64]:
        """Each item's length in characters, without decoding it: its UTF-8 bytes that do not
        continue a character (Gemma 3's 262,144 tokens: milliseconds, not 0.25 s)."""
        if not len(self):
            return np.zeros(0, np.int64)
        lo, hi = int(self._starts.min()), int(self._ends.max())
        raw = np.frombuffer(self._data[lo:hi], np.uint8)
        leading = ((raw & 0xC0) != 0x80).view(np.uint8)
        # sums over [start, end) of each item and [end, next start) between them
        bounds = np.stack([self._starts - lo, self._ends - lo], axis=1).ravel()
        sums = np.add.reduceat(np.append(leading, 0), bounds, dtype=np.int64)
        out: npt.NDArray[np.int64] = sums[::2]
        out[self._starts == self._ends] = 0  # reduceat gives an empty item the next byte
        return out


class GgufReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` with arrays read in one piece: 0.3 s for Gemma 3's header, not 9.

    The reader builds two numpy views per item of every array (about 12 us each), so the
    262,144 tokens, scores and types of Gemma 3's vocabulary cost 9 s. Here an array of
    numbers is one view and an array of strings one `StringArray` (read it with `value`;
    ``ReaderField.contents()`` does not know it). Given the `StringIndex` that
    `check_gguf_header` made of the same file, it does not walk the strings again.
    """

    def __init__(
        self,
        path: os.PathLike[str] | str,
        mode: Literal["r", "r+", "c"] = "r",
        *,
        strings: StringIndex | None = None,
    ) -> None:
        self._strings: StringIndex = strings or {}
        super().__init__(path, mode)

    @staticmethod
    def value(field: Any) -> Any:
        """A field's value: ``contents()``, or the `StringArray` of an array of strings."""
        last = field.parts[-1] if field.parts else None
        return last if isinstance(last, StringArray) else field.contents()

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[gguf.GGUFValueType]]:
        if raw_type != _ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        offs, n = orig_offs + 12, int(count[0])
        itype = gguf.GGUFValueType(int(raw_itype[0]))
        types = [gguf.GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, n)
            return 12 + int(values.nbytes), [raw_itype, count, values], [2], types
        if itype != gguf.GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        data = memoryview(self.data)  # type: ignore[arg-type]
        known = self._strings.get(offs)
        if known is not None and len(known[0]) == n:
            starts, ends = known
            size = int(ends[-1]) - offs if n else 0
            parts: list[Any] = [raw_itype, count, StringArray(data, starts, ends)]
            return 12 + size, parts, [2], types
        swapped: Literal["little", "big"] = "big" if sys.byteorder == "little" else "little"
        order: Literal["little", "big"] = sys.byteorder if self.byte_order == "I" else swapped
        starts = np.empty(n, np.int64)
        ends = np.empty(n, np.int64)
        for i in range(n):
            size = int.from_bytes(data[offs : offs + 8], order)
            starts[i], ends[i] = offs + 8, offs + 8 + size
            offs += 8 + size
        strings = StringArray(data, starts, ends)
        parts = [raw_itype, count, strings]  # gguf types parts as arrays
        return offs - orig_offs, parts, [2], types


# -- header bounds ------------------------------------------------------------------------

_STRING, _ARRAY = int(gguf.GGUFValueType.STRING), int(gguf.GGUFValueType.ARRAY)
_SCALAR_BYTES = {int(t): np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
_MIN_ITEM_BYTES = {**_SCALAR_BYTES, _STRING: 8, _ARRAY: 12}  # an empty string or array
_BLOCKS = {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}  # elements, bytes


def check_gguf_header(path: pathlib.Path) -> StringIndex:
    """Walk the header of the GGUF file ``path`` and refuse sizes it cannot hold.

    Reads lengths and counts only, building nothing per item but two offsets for each string
    of an array, in time linear in the header's bytes: every count of keys, tensors, array
    items, nested arrays and bytes must fit in what the file has left and stay under the
    ``MAX_GGUF_*`` bounds. A file that is not GGUF v2/v3 is left to the reader.

    Returns:
        where the strings of each array of strings lie, for `GgufReader` (so that the header
        is walked once).

    Raises:
        ModelError: a count or length is over a bound or runs past the end of the file.
    """
    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size < 8:
            raise ModelError(f"{path} is not a readable GGUF file (it is too short).")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return {}
            # A version with its low half zero was written on a machine of the other byte order.
            order: Literal["little", "big"] = "little"
            if int.from_bytes(data[4:8], order) & 0xFFFF == 0:
                order = "big"
            if int.from_bytes(data[4:8], order) not in (2, 3):
                return {}
            walk = _HeaderWalk(data, order)
            try:
                walk.walk()
            except _HeaderError as exc:
                raise ModelError(f"{path} is not a usable GGUF file: {exc}.") from None
            return walk.string_arrays


class _HeaderError(Exception):
    pass


class _HeaderWalk:
    """A cursor over a GGUF header that checks each length before it is used."""

    def __init__(self, data: mmap.mmap, order: Literal["little", "big"]) -> None:
        self.data, self.order = data, order
        self.offset = 8  # past the magic and the version
        self.items = 0
        self.nested = 0
        # where the items of each array of strings start: (starts, ends) of their bytes
        self.string_arrays: StringIndex = {}

    def walk(self) -> None:
        n_tensors = self.count("the tensor count", 32, MAX_GGUF_TENSORS)
        n_keys = self.count("the metadata key count", 13, MAX_GGUF_KEYS)
        for _ in range(n_keys):
            key = self.string("a metadata key", MAX_GGUF_KEY_BYTES)
            self.value(self.uint(4, f"the type of {key!r}"), repr(key), 0)
        for _ in range(n_tensors):
            name = self.string("a tensor name", MAX_GGUF_KEY_BYTES)
            n_dims = self.uint(4, f"tensor {name!r}'s dimension count")
            if not 1 <= n_dims <= MAX_GGUF_DIMS:
                raise _HeaderError(
                    f"tensor {name!r} has {n_dims} dimensions, not 1 to {MAX_GGUF_DIMS}"
                )
            dims = [self.uint(8, f"tensor {name!r}'s shape") for _ in range(n_dims)]
            qtype = self.uint(4, f"tensor {name!r}'s type")
            start = self.uint(8, f"tensor {name!r}'s offset")
            block = _BLOCKS.get(qtype)
            size = math.prod(dims) * block[1] // block[0] if block else 0
            if start + size > len(self.data):
                raise _HeaderError(
                    f"tensor {name!r} of shape {dims} needs {size} bytes at data offset "
                    f"{start}, but the file holds {len(self.data)}"
                )

    def take(self, n: int, what: str) -> int:
        start, left = self.offset, len(self.data) - self.offset
        if n > left:
            raise _HeaderError(f"{what} needs {n} bytes at offset {start}; only {left} follow")
        self.offset += n
        return start

    def uint(self, size: int, what: str) -> int:
        start = self.take(size, what)
        return int.from_bytes(self.data[start : start + size], self.order)

    def count(self, what: str, item_bytes: int, bound: int) -> int:
        n = self.uint(8, what)
        room = (len(self.data) - self.offset) // item_bytes
        if n > room:
            raise _HeaderError(f"{what} is {n}, but the rest of the file holds at most {room}")
        if n > bound:
            raise _HeaderError(f"{what} is {n}, more than the limit of {bound}")
        return n

    def string(self, what: str, bound: int) -> str:
        n = self.count(f"the length of {what}", 1, bound)
        start = self.take(n, what)
        return self.data[start : start + min(n, 60)].decode("utf-8", "replace")

    def value(self, vtype: int, what: str, depth: int) -> None:
        if vtype in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[vtype], what)
        elif vtype == _STRING:
            self.string(what, len(self.data))
        elif vtype == _ARRAY and depth < MAX_GGUF_ARRAY_DEPTH:
            self.array(what, depth)
        elif vtype == _ARRAY:
            raise _HeaderError(f"{what} nests arrays deeper than {MAX_GGUF_ARRAY_DEPTH}")
        else:
            raise _HeaderError(f"{what} has the unknown value type {vtype}")

    def array(self, what: str, depth: int) -> None:
        itype = self.uint(4, f"the item type of {what}")
        item_bytes = _MIN_ITEM_BYTES.get(itype, 1)
        n = self.count(f"the length of {what}", item_bytes, MAX_GGUF_ARRAY_ITEMS)
        self.items += n
        if self.items > MAX_GGUF_METADATA_ITEMS:
            raise _HeaderError(
                f"the metadata arrays hold more than {MAX_GGUF_METADATA_ITEMS} items (at {what})"
            )
        if itype == _ARRAY:  # counted before they are walked: gguf's reader is slow on them
            self.nested += n
            if self.nested > MAX_GGUF_NESTED_ARRAYS:
                raise _HeaderError(
                    f"{what} brings the nested arrays to {self.nested}, more than the limit of "
                    f"{MAX_GGUF_NESTED_ARRAYS}"
                )
        if itype in _SCALAR_BYTES:
            self.take(n * _SCALAR_BYTES[itype], what)
        elif itype == _STRING:
            self.strings(n, what)
        else:
            item = f"an item of {what}"
            for _ in range(n):
                self.value(itype, item, depth + 1)

    def strings(self, n: int, what: str) -> None:
        """Walk ``n`` strings in one tight loop, noting where each lies for `GgufReader`."""
        data, first, end = self.data, self.offset, len(self.data)
        unpack = struct.Struct("<Q" if self.order == "little" else ">Q").unpack_from
        starts, ends = array.array("q"), array.array("q")
        offset = first
        for _ in range(n):
            if offset + 8 > end:
                raise _HeaderError(f"an item of {what} needs 8 bytes at offset {offset}")
            (size,) = unpack(data, offset)
            starts.append(offset + 8)
            offset += 8 + size
            if offset > end:
                raise _HeaderError(
                    f"an item of {what} is {size} bytes long; only {end - starts[-1]} follow"
                )
            ends.append(offset)
        self.offset = offset
        self.string_arrays[first] = (np.frombuffer(starts, np.int64), np.frombuffer(ends, np.int64))
