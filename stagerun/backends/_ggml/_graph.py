"""One ggml graph: a run of a stage's layers over the stacked rows of a batch's sessions.

A `Graph` owns a ggml context of tensor headers (no data: the weights live in the file's
mapping, the KV caches in the stage's slabs, and everything else in the compute buffer
the allocator lays out), the graph, and the inputs to copy in once memory is laid out.
`build_layers` writes the blocks into it the way llama.cpp's graphs do:

* the rows of every session are stacked ``[d_model, R]`` for the norms, the projections and
  the MLP, so each weight is read once per graph;
* the new keys and values of every row go into the sessions' slots of the stage's KV slab
  (`_kv`) in one ``ggml_set_rows`` a layer, at row indices that are inputs, put in the graph
  before the nodes that read the slab;
* attention goes by groups of sessions (`Group`): sessions of as many rows in consecutive
  slots of a slab, their queries ``[head_dim, T, n_heads, sessions]`` against the keys and
  values of their slots ``[head_dim, L, n_kv, sessions]`` (ggml broadcasts the query heads
  over the KV heads), each session's rows masked to its own keys: one flash attention a
  layer for a tick's decode steps, where a graph per session attends apart would cost ggml a
  barrier per node of every session's attention (a 16-session graph had 6,755 nodes). Without
  flash attention (scores, a masked softmax and a product with the values copied transposed,
  `Blocks.attend`) every session is a group of its own.

Everything that changes from one decode step to the next is an input: the positions, the
token ids or hidden states, the masks and the cache rows written. A graph therefore serves
again for the next step of the sessions in the same slots (the same sessions, or new ones
that took the slots of ended ones) while each still fits in its ``L`` keys, and
the backend keeps the last few small graphs (`GgmlBackend` ``_graphs``) instead of building
one per step in Python.

Why a row's result never depends on the rows beside it (batched == solo, bitwise). Each
output of ``ggml_mul_mat`` is one dot product of a weight row with one activation row (the
activations quantized to Q8 row by row first); norms, RoPE and the activations work a row at
a time; the attention of one session never sees another's rows (in a group, the kernel
computes each row of each head of each session alone, over that session's slot only). What
is left is the keys a session attends to, ``L`` of them, which its chunk (and in a group, the
session of its group that needs the most) decides:

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
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._kv import KEY_BLOCK, KVSlab
from ._lib import F16, F32, I32, I64

NEG_INF = np.float32(-np.inf)
GROUP_KEYS_RATIO = 2
"""Sessions attend in one group only while the most keys of one is at most this many times
the fewest of another (`group_sessions`)."""


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
        self._laid_out = False

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
        elif len(ne) == 3:
            t = lib.ggml_new_tensor_3d(ctx, kind, ne[0], ne[1], ne[2])
        else:
            t = lib.ggml_new_tensor_4d(ctx, kind, ne[0], ne[1], ne[2], ne[3])
        lib.ggml_set_input(t)
        dtype = _DTYPES[kind]
        self.inputs.append((t, dtype, dtype.itemsize * math.prod(shape)))
        return t

    def expand(self, tensor: Any) -> None:
        self.lib.ggml_build_forward_expand(self.graph, tensor)

    def compute(
        self,
        backend: Any,
        values: Sequence[npt.NDArray[Any]],
        allocator: Any = None,
        into: tuple[Any, npt.NDArray[np.float32]] | None = None,
    ) -> None:
        """Lay out memory (in the graph's own allocator if it has one, else ``allocator``),
        copy ``values`` into the inputs and run the graph; with ``into``, a (tensor, array)
        of `output_array`, the graph writes that tensor straight into the array."""
        lib, ffi = self.lib, self.ffi
        if len(values) != len(self.inputs):
            raise ValueError(f"{len(values)} input values for {len(self.inputs)} inputs")
        # a graph with its own allocator stays in its own memory: laid out in a shared one, its
        # tensors would point into a buffer that the next bigger graph frees
        own = self.allocator if self.allocator is not None else allocator
        if own is None:
            raise ValueError("a graph without an allocator of its own needs one to compute")
        # laid out once in its own allocator (nothing else uses that memory): a call less into
        # the library, each of which gives the GIL up and may wait for it behind the loop
        if not self._laid_out and not lib.ggml_gallocr_alloc_graph(own, self.graph):
            raise MemoryError("ggml could not allocate the compute buffer for a forward")
        self._laid_out = self.allocator is not None
        # the inputs are in host memory (a CPU buffer): copied in with ffi.memmove, which keeps
        # the GIL, where every call into the library gives it up and waits to get it back
        for (tensor, dtype, nbytes), value in zip(self.inputs, values, strict=True):
            array = np.ascontiguousarray(value, dtype)
            if array.nbytes != nbytes:
                raise ValueError(f"an input of {array.nbytes} bytes for a tensor of {nbytes}")
            ffi.memmove(tensor.data, array, nbytes)
        if into is None:
            status = lib.ggml_backend_graph_compute(backend, self.graph)
        else:
            # the tensor's memory in the layout goes unused meanwhile: it is the graph's last
            # node and not a view, so no node after it reads or is laid out there
            tensor, array = into
            if tensor.view_src != ffi.NULL or not array.flags.c_contiguous:
                raise ValueError("only a tensor of its own is written into a dense array")
            if not array.flags.writeable or array.nbytes != lib.ggml_nbytes(tensor):
                raise ValueError(f"an array of {array.nbytes} bytes for a tensor's output")
            laid_out, tensor.data = tensor.data, ffi.cast("void *", array.ctypes.data)
            try:
                status = lib.ggml_backend_graph_compute(backend, self.graph)
            finally:
                tensor.data = laid_out
        if status == GGML_STATUS_ABORTED:
            raise GraphAborted("the graph was interrupted between two of its nodes")
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute failed with status {status}")

    def output_array(self, tensor: Any, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
        """A new array of ``shape`` for a float32 tensor's data, 64-byte aligned (as ggml
        lays tensors out); `compute` ``into`` it skips copying the data out: 1 MB of a
        Gemma 3 token's logits took 0.14 ms to copy."""
        ne = tuple(tensor.ne)
        nb = tuple(tensor.nb)
        dense = nb[0] == 4 and all(nb[i] == nb[i - 1] * ne[i - 1] for i in range(1, 4))
        if tensor.type != F32 or not dense or ne[::-1] != (1,) * (4 - len(shape)) + shape:
            raise ValueError(f"a float32 array of shape {shape} asked of {ne[::-1]}, {nb[::-1]}")
        n = math.prod(shape)
        whole = np.empty(n + 16, np.float32)
        skip = (-whole.ctypes.data % 64) // 4
        return whole[skip : skip + n].reshape(shape)


_DTYPES: dict[int, np.dtype[Any]] = {
    F32: np.dtype(np.float32),
    I32: np.dtype(np.int32),
    I64: np.dtype(np.int64),
    F16: np.dtype(np.float16),
}


def attention_masks(
    positions: npt.NDArray[np.int64], rows: int, keys: int, window: int
) -> npt.NDArray[np.float32]:
    """``[sessions, rows, keys]``: 0 where row ``t`` of the session at ``positions[b]`` sees
    key ``j``, else -inf.

    A row sees the keys up to its own position, and with a ``window`` only the last
    ``window`` of them.
    """
    at = positions[:, None, None] + np.arange(rows)[None, :, None]
    j = np.arange(keys)[None, None, :]
    hidden = j > at
    if window:
        hidden |= j <= at - window
    return np.where(hidden, NEG_INF, np.float32(0))


def key_blocks(needed: int) -> int:
    """The fewest keys, in whole blocks, that hold ``needed`` positions."""
    return -(-needed // KEY_BLOCK) * KEY_BLOCK


class Session:
    """One session's rows in a graph's stack: its slot, its first row and how many."""

    __slots__ = ("first", "index", "rows", "slab", "slot")

    def __init__(self, index: int, slab: KVSlab, slot: int, first: int, rows: int) -> None:
        self.index, self.slab, self.slot, self.first, self.rows = index, slab, slot, first, rows


class SlabRows:
    """The rows of a graph's sessions whose caches are in one slab, consecutive in the stack:
    their keys and values go into it in one ``ggml_set_rows`` a layer, at the rows of their
    slots and positions (an input)."""

    __slots__ = ("first", "index", "k", "rows", "sessions", "slab", "v")

    def __init__(self, graph: Graph, sessions: list[Session]) -> None:
        self.slab, self.sessions = sessions[0].slab, sessions
        self.first, self.rows = sessions[0].first, sum(s.rows for s in sessions)
        lib, ffi, n = graph.lib, graph.ffi, math.prod(self.slab.shape)
        self.k = lib.ggml_new_tensor_1d(graph.ctx, F16, n)
        self.v = lib.ggml_new_tensor_1d(graph.ctx, F16, n)
        for tensor, buffer, array in zip(
            (self.k, self.v), self.slab.buffers, (self.slab.k, self.slab.v), strict=True
        ):
            status = lib.ggml_backend_tensor_alloc(
                buffer, tensor, ffi.cast("void *", array.ctypes.data)
            )
            if status != 0:
                raise RuntimeError(f"ggml could not place a KV slab (status {status})")
        self.index = graph.input(I64, self.rows)

    def values(self, positions: Sequence[int]) -> npt.NDArray[np.int64]:
        cap = self.slab.capacity
        return np.concatenate(
            [
                np.arange(s.slot * cap + positions[s.index], s.slot * cap + positions[s.index]
                          + s.rows, dtype=np.int64)
                for s in self.sessions
            ]
        )  # fmt: skip


class Group:
    """Sessions of as many rows each, in consecutive slots of one slab, consecutive in the
    stack: one attention a layer reads all their caches (a batch of ``count`` in its fourth
    dimension), each session's rows masked to its own keys.

    Args:
        keys: the keys each session's rows see at most, a whole number of blocks.
        windows: the attention windows of the graph's layers (0: none), one mask each.
        flash: the masks are for ggml's flash attention (float16), else for its softmax.
    """

    __slots__ = ("count", "first", "keys", "masks", "part", "rows", "sessions", "slot")

    def __init__(self, graph: Graph, part: SlabRows, sessions: list[Session], keys: int,
                 windows: Sequence[int], *, flash: bool = True) -> None:  # fmt: skip
        if keys % KEY_BLOCK or keys > part.slab.capacity:
            raise ValueError(f"{keys} keys for a cache of {part.slab.capacity}")
        self.part, self.sessions, self.keys = part, sessions, keys
        self.first, self.rows, self.slot = sessions[0].first, sessions[0].rows, sessions[0].slot
        self.count = len(sessions)
        kind = F16 if flash else F32  # what ggml's flash attention, or its softmax, reads
        self.masks = {
            w: graph.input(kind, self.count, 1, self.rows, keys) for w in sorted(set(windows))
        }

    def fits(self, positions: Sequence[int]) -> bool:
        """Whether every session's rows at its position are within the keys."""
        return all(positions[s.index] + self.rows <= self.keys for s in self.sessions)

    def values(self, positions: Sequence[int]) -> list[npt.NDArray[np.float32]]:
        at = np.array([positions[s.index] for s in self.sessions], np.int64)
        return [attention_masks(at, self.rows, self.keys, w) for w in self.masks]


def group_sessions(
    graph: Graph, sessions: list[Session], keys: Sequence[int], windows: Sequence[int], *,
    flash: bool,
) -> tuple[list[SlabRows], list[Group]]:  # fmt: skip
    """The slab parts and attention groups of ``sessions`` (in stack order), each session
    attending to at most ``keys[i]`` keys: a session joins the group before it if it has as
    many rows, the next slot of the same slab, and keys within `GROUP_KEYS_RATIO` of every
    member's (with flash attention only). Every row of a group reads the mask of the most
    keys any member needs: a short session beside a long one would scan the long one's."""
    parts = [
        SlabRows(graph, list(run))
        for _, run in itertools.groupby(sessions, key=lambda s: id(s.slab))
    ]
    runs: list[list[Session]] = []
    span = (0, 0)  # the fewest and the most keys of the last run
    for s in sessions:
        last, k = (runs[-1][-1] if runs else None), keys[s.index]
        near = max(span[1], k) <= GROUP_KEYS_RATIO * min(span[0], k)
        if (flash and last is not None and last.slab is s.slab and last.rows == s.rows
                and last.slot + 1 == s.slot and near):  # fmt: skip
            runs[-1].append(s)
            span = (min(span[0], k), max(span[1], k))
        else:
            runs.append([s])
            span = (k, k)
    part_of = {id(s): part for part in parts for s in part.sessions}
    groups = [
        Group(graph, part_of[id(run[0])], run, max(keys[s.index] for s in run), windows,
              flash=flash)
        for run in runs
    ]  # fmt: skip
    return parts, groups


class Built:
    """A graph built for some sessions' rows, and how to give it inputs and read it out.

    Args:
        parts, groups: its sessions by slab and by attention (`group_sessions`).
        out: the output tensor, ``shape`` rows by columns once read.
        picked: the stacked rows the head reads (on the head only), the graph's last input.
        bounds: where each session's output rows start in ``out``, and where the last ends.
    """

    __slots__ = ("bounds", "graph", "groups", "out", "parts", "picked", "shape",
                 "thread_seconds")  # fmt: skip

    def __init__(self, graph: Graph, parts: list[SlabRows], groups: list[Group], out: Any,
                 shape: tuple[int, int], picked: npt.NDArray[np.int32] | None,
                 bounds: list[int]) -> None:  # fmt: skip
        self.graph, self.parts, self.groups = graph, parts, groups
        self.out, self.shape, self.picked, self.bounds = out, shape, picked, bounds
        # its latest compute's seconds times its threads: about what one thread takes, or
        # more (None before its first compute); the backend's `WAKE_IDLE_S` rule reads it
        self.thread_seconds: float | None = None

    def close(self) -> None:
        self.graph.close()

    def fits(self, positions: Sequence[int]) -> bool:
        """Whether the graph can compute its sessions' rows at ``positions`` (stack order)."""
        return all(group.fits(positions) for group in self.groups)

    def run(
        self, backend: Any, allocator: Any, positions: Sequence[int],
        rows: Sequence[npt.NDArray[Any]],
    ) -> list[npt.NDArray[np.float32]]:  # fmt: skip
        """Compute each session's ``rows`` of input (token ids or hidden states) at its first
        position, in stack order: each session's output rows, logits on the head, else
        hidden states."""
        at = np.concatenate(
            [np.arange(p, p + len(r)) for p, r in zip(positions, rows, strict=True)]
        )
        values: list[npt.NDArray[Any]] = [at, np.concatenate(rows)]
        values += [part.values(positions) for part in self.parts]
        for group in self.groups:
            values += group.values(positions)
        if self.picked is not None:
            values.append(self.picked)
        out = self.graph.output_array(self.out, self.shape)  # written in place, not copied
        self.graph.compute(backend, values, allocator, into=(self.out, out))
        return [out[a:b] for a, b in itertools.pairwise(self.bounds)]
