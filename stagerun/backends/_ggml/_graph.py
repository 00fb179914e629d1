"""One ggml graph: a run of a stage's layers over the stacked rows of a batch's sessions.

A `Graph` owns a ggml context of tensor headers (no data: the weights live in the file's
mapping, the KV caches in their sessions' arrays, and everything else in the compute buffer
the allocator lays out), the graph, and the inputs to copy in once memory is laid out.
`build_layers` writes the blocks into it the way llama.cpp's graphs do:

* the rows of every session are stacked ``[d_model, R]`` for the norms, the projections and
  the MLP, so each weight is read once per graph;
* attention is per session: its new keys and values are copied into its cache first (the
  copies are put in the graph before the nodes that read the cache), then its queries
  ``[head_dim, T, n_heads]`` meet the cached keys ``[head_dim, L, n_kv]`` (ggml broadcasts
  the query heads over the KV heads), a masked softmax, and the transposed values.

Why a row's result never depends on the rows beside it (batched == solo, bitwise). Each
output of ``ggml_mul_mat`` is one dot product of a weight row with one activation row (the
activations quantized to Q8 row by row first); norms, RoPE and the activations work a row at
a time; the attention of one session never sees another's rows. What is left is the length
``L`` of the keys a session attends to, which its chunk decides: the softmax and the value
product are SIMD sums over ``L``, whose tail (``L`` mod 8 or 32) is summed apart. ``L`` is
therefore always a whole number of 64-key blocks, and the keys past a row's position are
masked to an exact zero weight, so a row's sums are the same whatever chunk it came in:
prefilled whole, in pieces, or after a prefix restored from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._kv import KEY_BLOCK, GgmlKVCache
from ._lib import F16, F32, I32

NEG_INF = np.float32(-np.inf)


class Graph:
    """A ggml context with one graph, and the inputs to set once it is allocated."""

    def __init__(self, ffi: Any, lib: Any, n_nodes: int) -> None:
        self.ffi, self.lib = ffi, lib
        size = lib.ggml_tensor_overhead() * 3 * n_nodes + lib.ggml_graph_overhead_custom(
            n_nodes, False
        )
        params = ffi.new("struct ggml_init_params *", {"mem_size": size, "no_alloc": True})
        self.ctx = lib.ggml_init(params[0])
        if self.ctx == ffi.NULL:
            raise MemoryError(f"ggml_init could not make a context of {size} bytes")
        self.graph = lib.ggml_new_graph_custom(self.ctx, n_nodes, False)
        self._inputs: list[tuple[Any, npt.NDArray[Any]]] = []

    def close(self) -> None:
        if self.ctx is not None:
            self.lib.ggml_free(self.ctx)
            self.ctx = None

    def input(self, array: npt.NDArray[Any]) -> Any:
        """A tensor holding ``array`` (C-contiguous; ggml's shape is numpy's reversed)."""
        lib, ctx = self.lib, self.ctx
        kind = {np.dtype(np.float32): F32, np.dtype(np.int32): I32}[array.dtype]
        shape = array.shape[::-1]
        if len(shape) == 1:
            t = lib.ggml_new_tensor_1d(ctx, kind, shape[0])
        elif len(shape) == 2:
            t = lib.ggml_new_tensor_2d(ctx, kind, shape[0], shape[1])
        else:
            t = lib.ggml_new_tensor_3d(ctx, kind, shape[0], shape[1], shape[2])
        lib.ggml_set_input(t)
        self._inputs.append((t, np.ascontiguousarray(array)))
        return t

    def expand(self, tensor: Any) -> None:
        self.lib.ggml_build_forward_expand(self.graph, tensor)

    def compute(self, backend: Any, allocator: Any) -> None:
        """Lay out memory, copy the inputs in and run the graph."""
        lib, ffi = self.lib, self.ffi
        if not lib.ggml_gallocr_alloc_graph(allocator, self.graph):
            raise MemoryError("ggml could not allocate the compute buffer for a forward")
        for tensor, array in self._inputs:
            lib.ggml_backend_tensor_set(
                tensor, ffi.cast("void *", array.ctypes.data), 0, array.nbytes
            )
        status = lib.ggml_backend_graph_compute(backend, self.graph)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute failed with status {status}")

    def output(self, tensor: Any, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
        """A float32 tensor's data as a new numpy array of ``shape`` (numpy's order)."""
        out = np.empty(shape, np.float32)
        self.lib.ggml_backend_tensor_get(
            tensor, self.ffi.cast("void *", out.ctypes.data), 0, out.nbytes
        )
        return out


def attention_mask(position: int, rows: int, keys: int, window: int) -> npt.NDArray[np.float32]:
    """``[rows, keys]``: 0 where the row at ``position + t`` sees key ``j``, else -inf.

    A row sees the keys up to its own position, and with a ``window`` only the last
    ``window`` of them.
    """
    at = np.arange(position, position + rows)[:, None]
    j = np.arange(keys)[None, :]
    hidden = j > at
    if window:
        hidden |= j <= at - window
    mask = np.zeros((rows, keys), np.float32)
    mask[hidden] = NEG_INF
    return mask


class SessionRows:
    """One session's part of a graph: its rows in the stack, position, cache and masks."""

    __slots__ = ("cache", "first", "k", "keys", "masks", "position", "rows", "v")

    def __init__(self, graph: Graph, cache: GgmlKVCache, position: int, first: int, rows: int,
                 n_layers: int, windows: Sequence[int]) -> None:  # fmt: skip
        self.cache, self.position, self.first, self.rows = cache, position, first, rows
        self.keys = -(-(position + rows) // KEY_BLOCK) * KEY_BLOCK
        lib, ctx = graph.lib, graph.ctx
        k_buf, v_buf = cache.buffers()
        n_all, width = cache._shape
        cap = cache.capacity
        self.k = lib.ggml_new_tensor_3d(ctx, F16, width, cap, n_all)
        lib.ggml_backend_tensor_alloc(k_buf, self.k, graph.ffi.cast("void *", cache._k.ctypes.data))
        self.v = lib.ggml_new_tensor_3d(ctx, F16, cap, width, n_all)
        lib.ggml_backend_tensor_alloc(v_buf, self.v, graph.ffi.cast("void *", cache._v.ctypes.data))
        self.masks = {
            w: graph.input(attention_mask(position, rows, self.keys, w)) for w in set(windows)
        }
