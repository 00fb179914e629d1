"""The ggml backend's KV cache of one session, in numpy memory that ggml computes on.

Keys and values are each ``[layers, capacity, n_kv * head_dim]``, float16 (llama.cpp's cache
type): a new position's keys and values are one contiguous row each, the layout ggml's flash
attention reads. ggml sees each array through a CPU buffer made over its memory (`buffers`);
export and import are numpy slices.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

F16 = npt.NDArray[np.float16]
KEY_BLOCK = 64  # the attention reads keys in whole blocks of 64 (see `_graph`)
_CHUNK = 256  # first allocation, in positions; later growth doubles
_ALIGN = 64  # ggml's CPU buffers want 32-byte aligned memory; numpy gives 16


def aligned_zeros(shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
    """A zeroed array whose data starts on a 64-byte boundary."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.zeros(size + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    out: npt.NDArray[Any] = raw[start : start + size].view(dtype).reshape(shape)
    return out


class GgmlKVCache:
    """Keys and values of one session on one ggml stage, for positions ``0..length-1``.

    Storage grows by doubling in whole key blocks, up to the context length; the room past
    ``length`` holds zeros or stale positions, which the attention masks.
    """

    def __init__(self, ffi: Any, lib: Any, n_layers: int, width: int, max_length: int) -> None:
        self.length = 0
        self._ffi, self._lib = ffi, lib
        self._max = -(-max_length // KEY_BLOCK) * KEY_BLOCK
        self._shape = (n_layers, width)
        self._k: F16 = np.zeros((n_layers, 0, width), np.float16)
        self._v: F16 = np.zeros((n_layers, 0, width), np.float16)
        self._buffers: tuple[Any, Any] | None = None
        self._release: weakref.finalize[Any, Any] | None = None

    def __repr__(self) -> str:
        return (
            f"<GgmlKVCache length={self.length} capacity={self.capacity} layers={self._shape[0]}>"
        )

    @property
    def capacity(self) -> int:
        return int(self._k.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self._k.nbytes + self._v.nbytes)

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        self.length = min(self.length, position)

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` positions, in whole key blocks."""
        needed = -(-needed // KEY_BLOCK) * KEY_BLOCK
        if needed <= self.capacity:
            return
        cap = max(needed, min(max(2 * self.capacity, _CHUNK), self._max))
        n_layers, width = self._shape
        k = aligned_zeros((n_layers, cap, width), np.float16)
        v = aligned_zeros((n_layers, cap, width), np.float16)
        k[:, : self.length] = self._k[:, : self.length]
        v[:, : self.length] = self._v[:, : self.length]
        self._drop_buffers()
        self._k, self._v = k, v

    def buffers(self) -> tuple[Any, Any]:
        """ggml CPU buffers over the key and the value arrays (made once per allocation)."""
        if self._buffers is None:
            lib, ffi = self._lib, self._ffi
            k = lib.ggml_backend_cpu_buffer_from_ptr(
                ffi.cast("void *", self._k.ctypes.data), self._k.nbytes
            )
            v = lib.ggml_backend_cpu_buffer_from_ptr(
                ffi.cast("void *", self._v.ctypes.data), self._v.nbytes
            )
            self._buffers = (k, v)
            self._release = weakref.finalize(self, _free_buffers, lib, k, v)
        return self._buffers

    def _drop_buffers(self) -> None:
        if self._release is not None:
            self._release()
        self._buffers = self._release = None


def _free_buffers(lib: Any, *buffers: Any) -> None:
    for buffer in buffers:
        lib.ggml_backend_buffer_free(buffer)


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
