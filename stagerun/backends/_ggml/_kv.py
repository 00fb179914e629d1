"""The ggml backend's KV caches: slots of a stage's slabs, in memory that ggml computes on.

A `KVSlab` holds the keys and the values of up to `SLAB_SLOTS` sessions of one stage, each
``[layers, slots, capacity, n_kv * head_dim]`` float16 (llama.cpp's cache type), where the
capacity is the model's whole context. A session's cache (`GgmlKVCache`) is one slot of it:
a new position's keys and values are one contiguous row each, the layout ggml's flash
attention reads, and the slots of a slab lie at one stride from each other, so that one
attention can read the caches of several sessions (sessions of consecutive slots, see
`_graph`).

The slab is mapped without reserving its memory: a page of it becomes resident when a
position in it is first written, and the pages of slots given back are returned to the
system when the stage is idle (`KVSlab.release`). So a stage holds the keys its sessions
reached, not the capacity. ggml sees each array
through one CPU buffer made over it; export and import are numpy slices of a slot.
"""

from __future__ import annotations

import collections
import functools
import heapq
import mmap
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

F16 = npt.NDArray[np.float16]
KEY_BLOCK = 64  # the attention reads keys in whole blocks of 64 (see `_graph`)
SLAB_SLOTS = 16
"""Sessions one slab holds; a stage maps another slab when its slabs are full."""

# Linux's MAP_NORESERVE (Python 3.11 does not name it): memory counted once it is touched
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _reserve(nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE
    return mmap.mmap(-1, nbytes, flags=flags)


class KVSlab:
    """Keys and values of up to ``slots`` sessions on one stage, ``capacity`` positions each.

    Raises:
        MemoryError: the system would not map the slab (its size is in the message).
    """

    def __init__(self, ffi: Any, lib: Any, n_layers: int, width: int, capacity: int,
                 slots: int = SLAB_SLOTS) -> None:  # fmt: skip
        self.shape = (n_layers, slots, capacity, width)
        nbytes = n_layers * slots * capacity * width * 2
        try:
            self._maps = (_reserve(nbytes), _reserve(nbytes))
        except OSError as e:
            raise MemoryError(
                f"could not map {2 * nbytes / 2**30:.1f} GiB of address space for the KV caches "
                f"of {slots} sessions ({e}); the pages are used only once written"
            ) from e
        self.k: F16 = np.frombuffer(self._maps[0], np.float16).reshape(self.shape)
        self.v: F16 = np.frombuffer(self._maps[1], np.float16).reshape(self.shape)
        self.buffers = tuple(
            lib.ggml_backend_cpu_buffer_from_ptr(ffi.cast("void *", a.ctypes.data), nbytes)
            for a in (self.k, self.v)
        )
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._dirty: dict[int, int] = {}  # free slots whose pages hold positions: how many
        self._lock = threading.Lock()
        weakref.finalize(self, _free_buffers, lib, *self.buffers)

    def __repr__(self) -> str:
        _, slots, capacity, width = self.shape
        return f"<KVSlab slots={slots} free={len(self._free)} capacity={capacity} width={width}>"

    @property
    def slots(self) -> int:
        return self.shape[1]

    @property
    def capacity(self) -> int:
        return self.shape[2]

    def take(self) -> int | None:
        """The lowest free slot, now taken; None when every slot is."""
        with self._lock:
            self._collect()
            if not self._free:
                return None
            slot = heapq.heappop(self._free)
            self._dirty.pop(slot, None)  # its pages are the new session's to write
            return slot

    def give(self, slot: int, reached: int) -> None:
        """Give ``slot`` back, its first ``reached`` positions written (`release` frees them).

        Safe from a finalizer: it takes no lock (`take` collects what was given back).
        """
        self._returned.append((slot, reached))

    def release(self) -> int:
        """Give the system the pages of the free slots' written positions; the bytes freed.

        A stage calls it when idle (`GgmlBackend.release_memory`): at a session's end it
        would hold the event loop for a millisecond, and a new session in the slot would fault
        the pages in again.
        """
        freed = 0
        row = self.shape[3] * 2
        stride = self.capacity * row
        with self._lock:
            self._collect()
            for slot, reached in self._dirty.items():
                for i in range(self.shape[0]):
                    start = (i * self.slots + slot) * stride
                    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
                    end = (start + reached * row) // mmap.PAGESIZE * mmap.PAGESIZE
                    if end > first:
                        for m in self._maps:
                            m.madvise(mmap.MADV_DONTNEED, first, end - first)
                        freed += 2 * (end - first)
            self._dirty.clear()
        return freed

    def _collect(self) -> None:
        while self._returned:  # given back by finalizers (any thread, any time)
            slot, reached = self._returned.popleft()
            heapq.heappush(self._free, slot)
            self._dirty[slot] = reached


def _free_buffers(lib: Any, *buffers: Any) -> None:
    for buffer in buffers:
        lib.ggml_backend_buffer_free(buffer)


class GgmlKVCache:
    """Keys and values of one session on one ggml stage, for positions ``0..length-1``.

    A slot of a `KVSlab`, given back when the cache is collected; the positions past
    ``length`` hold zeros or stale keys, which the attention masks.
    """

    def __init__(self, slab: KVSlab, slot: int) -> None:
        self.length = 0
        self.slab, self.slot = slab, slot
        self._k: F16 = slab.k[:, slot]  # [layers, capacity, width]
        self._v: F16 = slab.v[:, slot]
        self._shape = (slab.shape[0], slab.shape[3])
        self._reached = [0]  # positions ever written, shared with the finalizer
        weakref.finalize(self, _give_back, slab, slot, self._reached)

    def __repr__(self) -> str:
        return (
            f"<GgmlKVCache length={self.length} slot={self.slot} reached={self._reached[0]} "
            f"layers={self._shape[0]}>"
        )

    @property
    def capacity(self) -> int:
        return self.slab.capacity

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values of the positions written so far (resident memory)."""
        return 2 * self._shape[0] * self._reached[0] * self._shape[1] * 2

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        self.length = min(self.length, position)

    def reserve(self, needed: int) -> None:
        """Note that positions up to ``needed`` will be written (all within the capacity)."""
        if needed > self.capacity:
            raise ValueError(f"{needed} positions for a KV cache of {self.capacity}.")
        self._reached[0] = max(self._reached[0], needed)

    def export(self, start: int, stop: int) -> GgmlKVBlock:
        """A copy of the keys and values of positions ``start..stop-1``."""
        return GgmlKVBlock(self._k[:, start:stop].copy(), self._v[:, start:stop].copy())

    def fill(self, blocks: Sequence[GgmlKVBlock]) -> None:
        """Positions ``0..`` from ``blocks``, consecutive, as the cache's whole length."""
        total = sum(block.positions for block in blocks)
        self.reserve(total)
        at = 0
        for block in blocks:
            end = at + block.positions
            self._k[:, at:end] = block.k
            self._v[:, at:end] = block.v
            at = end
        self.length = total


class Slabs:
    """A stage's slabs: a slot of the first one with a free slot for each new cache, a new
    slab when none has one."""

    def __init__(self, ffi: Any, lib: Any, n_layers: int, width: int, capacity: int) -> None:
        self._new = functools.partial(KVSlab, ffi, lib, n_layers, width, capacity)
        self.shape = (n_layers, width)
        self._slabs: list[KVSlab] = []

    def new_cache(self) -> GgmlKVCache:
        while True:
            for slab in self._slabs:
                slot = slab.take()
                if slot is not None:
                    return GgmlKVCache(slab, slot)
            self._slabs.append(self._new())  # every slot taken: the next loop finds one

    def release(self) -> int:
        """`KVSlab.release` on every slab: the bytes freed."""
        return sum(slab.release() for slab in self._slabs)

    def index(self, cache: GgmlKVCache) -> int:
        """The number of ``cache``'s slab, in the order the slabs were made."""
        for n, slab in enumerate(self._slabs):
            if slab is cache.slab:
                return n
        raise ValueError("this KV cache was made by another backend; use its new_cache().")


def _give_back(slab: KVSlab, slot: int, reached: list[int]) -> None:
    slab.give(slot, reached[0])


@attrs.frozen(eq=False)
class GgmlKVBlock:
    """A copy of one cache's keys and values for a run of positions (`GgmlBackend.export_kv`)."""

    k: F16  # [layers, positions, n_kv * head_dim]
    v: F16  # [layers, positions, n_kv * head_dim]

    @property
    def positions(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)
