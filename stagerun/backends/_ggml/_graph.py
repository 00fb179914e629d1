"""One ggml graph: a run of a stage's layers over the stacked rows of a batch's sessions.

A `Graph` owns a ggml context of tensor headers (no data: the weights live in the file's
mapping, the KV caches in their sessions' arrays, and everything else in the compute buffer
the allocator lays out), the graph, and the inputs to copy in once memory is laid out.
`build_layers` writes the blocks into it the way llama.cpp's graphs do:

* the rows of every session are stacked ``[d_model, R]`` for the norms, the projections and
  the MLP, so each weight is read once per graph;
* attention is per session: its new keys and values are written into its cache first
  (``ggml_set_rows`` at row indices that are inputs, put in the graph before the nodes that
  read the cache), then its queries ``[head_dim, T, n_heads]`` meet the cached keys and values
  ``[head_dim, L, n_kv]`` (ggml broadcasts the query heads over the KV heads): in ggml's flash
  attention kernel by default, or as scores, a masked softmax and a product with the values
  copied transposed (`Blocks.attend`).

Everything that changes from one decode step to the next is an input: the positions, the
token ids or hidden states, the masks and the cache rows written. A graph therefore serves
again for the next step of the same sessions while each still fits in its ``L`` keys, and
the backend keeps the last few small graphs (`GgmlBackend` ``_graphs``) instead of building
one per step in Python.

Why a row's result never depends on the rows beside it (batched == solo, bitwise). Each
output of ``ggml_mul_mat`` is one dot product of a weight row with one activation row (the
activations quantized to Q8 row by row first); norms, RoPE and the activations work a row at
a time; the attention of one session never sees another's rows. What is left is the keys a
session attends to, ``L`` of them, which its chunk decides:

* flash attention visits a row's keys in order and skips the masked ones, so ``L`` does not
  matter; but ggml has two faster kernels whose sums do depend on the batch, tiles of 64 query
  rows and, for a lone row over 512 keys or more, the keys split among the threads. The
  backend asks for the row kernel everywhere (``ggml_backend_cpu_set_use_ref``), so a row's
  sums are the same in any chunk and on any number of threads;
* the softmax and the value product are SIMD sums over ``L``, whose tail (``L`` mod 8 or 32)
  is summed apart. ``L`` is therefore always a whole number of 64-key blocks, and the keys
  past a row's position are masked to an exact zero weight.

Either way a row's sums are the same whatever chunk it came in: prefilled whole, in pieces,
or after a prefix restored from the prefix cache. For the same reason ``L`` may be any whole
number of blocks that holds the session's positions: a graph kept for reuse is built with a
few blocks of room.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._kv import KEY_BLOCK, GgmlKVCache
from ._lib import F16, F32, I32, I64

NEG_INF = np.float32(-np.inf)


GGML_STATUS_ABORTED = 1  # ggml's enum ggml_status


class GraphAborted(Exception):
    """A graph's compute stopped part-way: its backend's abort flag was raised."""


class Graph:
    """A ggml context with one graph, and its inputs (set before every compute).

    Args:
        allocator: a ``ggml_gallocr`` of this graph's own (freed with it), for a graph that is
            computed more than once; None: the caller passes a shared one to each `compute`.
    """

    def __init__(self, ffi: Any, lib: Any, n_nodes: int, *, own_allocator: bool = False) -> None:
        self.ffi, self.lib = ffi, lib
        size = lib.ggml_tensor_overhead() * 3 * n_nodes + lib.ggml_graph_overhead_custom(
            n_nodes, False
        )
        params = ffi.new("struct ggml_init_params *", {"mem_size": size, "no_alloc": True})
        self.ctx = lib.ggml_init(params[0])
        if self.ctx == ffi.NULL:
            raise MemoryError(f"ggml_init could not make a context of {size} bytes")
        self.graph = lib.ggml_new_graph_custom(self.ctx, n_nodes, False)
        self.inputs: list[tuple[Any, np.dtype[Any], int]] = []
        self.allocator = (
            lib.ggml_gallocr_new(lib.ggml_backend_cpu_buffer_type()) if own_allocator else None
        )

    def close(self) -> None:
        if self.allocator is not None:
            self.lib.ggml_gallocr_free(self.allocator)
            self.allocator = None
        if self.ctx is not None:
            self.lib.ggml_free(self.ctx)
            self.ctx = None

    def input(self, kind: int, *shape: int) -> Any:
        """An input tensor of numpy ``shape`` (ggml's is reversed); `compute` takes its values
        in the order the inputs were made."""
        lib, ctx = self.lib, self.ctx
        ne = shape[::-1]
        if len(ne) == 1:
            t = lib.ggml_new_tensor_1d(ctx, kind, ne[0])
        elif len(ne) == 2:
            t = lib.ggml_new_tensor_2d(ctx, kind, ne[0], ne[1])
        else:
            t = lib.ggml_new_tensor_3d(ctx, kind, ne[0], ne[1], ne[2])
        lib.ggml_set_input(t)
        dtype = _DTYPES[kind]
        self.inputs.append((t, dtype, dtype.itemsize * math.prod(shape)))
        return t

    def expand(self, tensor: Any) -> None:
        self.lib.ggml_build_forward_expand(self.graph, tensor)

    def compute(
        self, backend: Any, values: Sequence[npt.NDArray[Any]], allocator: Any = None
    ) -> None:
        """Lay out memory (in the graph's own allocator if it has one, else ``allocator``),
        copy ``values`` into the inputs and run the graph."""
        lib, ffi = self.lib, self.ffi
        if len(values) != len(self.inputs):
            raise ValueError(f"{len(values)} input values for {len(self.inputs)} inputs")
        # a graph with its own allocator stays in its own memory: laid out in a shared one, its
        # tensors would point into a buffer that the next bigger graph frees
        own = self.allocator if self.allocator is not None else allocator
        if own is None:
            raise ValueError("a graph without an allocator of its own needs one to compute")
        if not lib.ggml_gallocr_alloc_graph(own, self.graph):
            raise MemoryError("ggml could not allocate the compute buffer for a forward")
        # the inputs are in host memory (a CPU buffer): copied in with ffi.memmove, which keeps
        # the GIL, where every call into the library gives it up and waits to get it back
        for (tensor, dtype, nbytes), value in zip(self.inputs, values, strict=True):
            array = np.ascontiguousarray(value, dtype)
            if array.nbytes != nbytes:
                raise ValueError(f"an input of {array.nbytes} bytes for a tensor of {nbytes}")
            ffi.memmove(tensor.data, array, nbytes)
        status = lib.ggml_backend_graph_compute(backend, self.graph)
        if status == GGML_STATUS_ABORTED:
            raise GraphAborted("the graph was interrupted between two of its nodes")
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute failed with status {status}")

    def output(self, tensor: Any, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
        """A float32 tensor's data as a new numpy array of ``shape`` (numpy's order)."""
        out = np.empty(shape, np.float32)
        ne = tuple(tensor.ne)
        nb = tuple(tensor.nb)
        dense = nb[0] == 4 and all(nb[i] == nb[i - 1] * ne[i - 1] for i in range(1, 4))
        if tensor.type != F32 or not dense or ne[::-1] != (1,) * (4 - len(shape)) + shape:
            raise ValueError(f"a float32 array of shape {shape} asked of {ne[::-1]}, {nb[::-1]}")
        self.ffi.memmove(out, tensor.data, out.nbytes)  # host memory, as in `compute`
        return out


_DTYPES: dict[int, np.dtype[Any]] = {
    F32: np.dtype(np.float32),
    I32: np.dtype(np.int32),
    I64: np.dtype(np.int64),
    F16: np.dtype(np.float16),
}


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


def key_blocks(needed: int) -> int:
    """The fewest keys, in whole blocks, that hold ``needed`` positions."""
    return -(-needed // KEY_BLOCK) * KEY_BLOCK


class SessionRows:
    """One session's part of a graph: its rows in the stack, its cache, and its inputs.

    The cache is held weakly (a kept graph must not keep a finished session's memory):
    `fits` says whether the graph may serve the session's next step.

    Args:
        first: its first row in the stack; rows: how many.
        keys: the keys it attends to, a whole number of blocks within the cache's capacity.
        windows: the attention windows of the graph's layers (0: none), one mask each.
        flash: the masks are for ggml's flash attention (float16), else for its softmax.
    """

    __slots__ = ("buffers", "cache", "capacity", "first", "k", "k_rows", "keys", "masks",
                 "rows", "v", "width")  # fmt: skip

    def __init__(self, graph: Graph, cache: GgmlKVCache, first: int, rows: int, keys: int,
                 windows: Sequence[int], *, flash: bool = True) -> None:  # fmt: skip
        if keys % KEY_BLOCK or keys > cache.capacity:
            raise ValueError(f"{keys} keys for a cache of {cache.capacity}")
        self.first, self.rows, self.keys = first, rows, keys
        self.cache = weakref.ref(cache)
        self.capacity = cap = cache.capacity
        self.buffers = k_buf, v_buf = cache.buffers()
        lib, ctx = graph.lib, graph.ctx
        n_all, self.width = cache._shape
        self.k = lib.ggml_new_tensor_3d(ctx, F16, self.width, cap, n_all)
        lib.ggml_backend_tensor_alloc(k_buf, self.k, graph.ffi.cast("void *", cache._k.ctypes.data))
        self.v = lib.ggml_new_tensor_3d(ctx, F16, self.width, cap, n_all)
        lib.ggml_backend_tensor_alloc(v_buf, self.v, graph.ffi.cast("void *", cache._v.ctypes.data))
        kind = F16 if flash else F32  # what ggml's flash attention, or its softmax, reads
        self.masks = {w: graph.input(kind, rows, keys) for w in sorted(set(windows))}
        self.k_rows = graph.input(I64, rows)

    def fits(self, cache: GgmlKVCache, position: int) -> bool:
        """Whether this graph's part can compute ``cache``'s rows at ``position..``: the same
        cache, still in the same memory, and its rows within the keys."""
        return (
            self.cache() is cache
            and cache._buffers is self.buffers
            and position + self.rows <= self.keys
        )

    def values(self, position: int) -> list[npt.NDArray[Any]]:
        """This session's input values for rows at ``position..``, in the order of its inputs."""
        at = np.arange(position, position + self.rows, dtype=np.int64)
        masks = [attention_mask(position, self.rows, self.keys, w) for w in self.masks]
        return [*masks, at]


class Built:
    """A graph built for some sessions' rows, and how to give it inputs and read it out.

    Args:
        sessions: each session's part, in the order of its rows in the stack.
        out: the output tensor, ``shape`` rows by columns once read.
        picked: the stacked rows the head reads (on the head only), the graph's last input.
        bounds: where each session's output rows start in ``out``, and where the last ends.
    """

    __slots__ = ("bounds", "graph", "out", "picked", "sessions", "shape", "thread_seconds")

    def __init__(self, graph: Graph, sessions: list[SessionRows], out: Any,
                 shape: tuple[int, int], picked: npt.NDArray[np.int32] | None,
                 bounds: list[int]) -> None:  # fmt: skip
        self.graph, self.sessions, self.out, self.shape = graph, sessions, out, shape
        self.picked, self.bounds = picked, bounds
        # its latest compute's seconds times its threads: about what one thread takes, or
        # more (None before its first compute); the backend's `WAKE_IDLE_S` rule reads it
        self.thread_seconds: float | None = None

    def close(self) -> None:
        self.graph.close()

    def run(
        self, backend: Any, allocator: Any, positions: Sequence[int],
        rows: Sequence[npt.NDArray[Any]],
    ) -> list[npt.NDArray[np.float32]]:  # fmt: skip
        """Compute each session's ``rows`` of input (token ids or hidden states) at its first
        position: each session's output rows, logits on the head, else hidden states."""
        at = np.concatenate(
            [np.arange(p, p + len(r)) for p, r in zip(positions, rows, strict=True)]
        )
        values: list[npt.NDArray[Any]] = [at, np.concatenate(rows)]
        for p, s in zip(positions, self.sessions, strict=True):
            values += s.values(p)
        if self.picked is not None:
            values.append(self.picked)
        self.graph.compute(backend, values, allocator)
        out = self.graph.output(self.out, self.shape)
        return [out[a:b] for a, b in itertools.pairwise(self.bounds)]
