"""The ggml backend: one stage's layers computed on the GGUF file's own quantized blocks.

Theory of operation. The weights are never copied: the file is mapped read-only, one ggml
CPU buffer is made over the whole mapping, and each weight the stage uses is a tensor header
pointing at its bytes, in the file's own type (Q4_1, Q4_K, Q6_K, Q8_0, F16...). A stage's
resident memory is then the pages of its own layers (the first stage touches only the
embedding rows of the tokens it sees), the pages of the KV slab its sessions wrote and the
compute buffer.

Every forward builds graphs with ggml's C API through cffi (`_graph`): a batch's sessions
are stacked for the projections and the MLP, and each attends to its own float16 cache, a
slot of the stage's KV slab (`_kv`), sessions of consecutive slots in one attention. The
work is cut into graphs of whole layers, so that ``should_stop`` is polled between them as
the numpy backend polls between layers: a decode or verify step is one graph, a long prefill
several (`SEGMENT_ROW_LAYERS`). ggml quantizes activations to Q8 for
the quantized products (llama.cpp's numerics): results agree with the float32 reference to
about 1e-2 relative, the tokens with llama.cpp's.

ggml's compute threads spin at every node's barrier, so a stage given more threads than it
has idle cores slows down several-fold; `default_threads` gives each stage of the host its
share of the cores the process may use. Between graphs the threads sleep, in a pool of the
backend's own (`sleeping_pool`): stages of one stream take turns, and each can then use
every core while the others wait without polling.

Waking them costs, though: on the 2-core VMs these numbers come from, a core the host left
idle for 5 ms or more is often slow to come back (its vCPU is scheduled again first): 10
layers of SmolLM2, one row, on two threads took 1.6-1.8 ms after 0-4 ms of idle host, and
after 5-10 ms 1.8-2.5 ms at the median but 11-18 ms at the 90th percentile; one thread took
2.1-3.8 ms with no such tail. So a kept graph that one thread computes in under
`ONE_THREAD_S` (a decode step or verify window of a stage's few layers) runs on one thread
when it starts `WAKE_IDLE_S` or more after the host's latest graph ended (any stage's:
`HostCores.idle_for`); a longer one (Gemma 3's whole model, 38 ms on one thread against 19
on two) and a big one (a prefill chunk) take every core they may. A new kept graph (a
request's first rows) is judged by the latest kept graph's time, the first of all by none.
The host, not the stage: three stages of one stream each idle two thirds of the time while
the host computes throughout (judged by its own previous graph, 20 ms then, each of Gemma 3's
stages computed on one thread: 30 tokens/s against 36); stages whose hops cross 5 ms links
leave the host idle between graphs (two threads there: 20.5 tokens/s against one thread's
26.8).
"""

from __future__ import annotations

import itertools
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..._errors import ComputeCancelled
from ..._util import default_threads
from ...abc import ForwardItem
from ...model import ModelFile
from .._inputs import check_positions, forward_one, poll_stops, stage_input
from .._layers import GgufLayers
from ._blocks import Blocks, Layer
from ._cores import HostCores, sleeping_pool
from ._graph import Built, Graph, GraphAborted, Session, group_sessions, key_blocks
from ._kv import GgmlKVBlock, GgmlKVCache, Slabs
from ._lib import F32 as GGML_F32
from ._lib import I32, check_row_kernels, load, openmp, unavailable
from ._omp import on_compute_thread

__all__ = ["GgmlBackend"]

F32 = npt.NDArray[np.float32]
SEGMENT_ROW_LAYERS = 2048
"""Rows times layers per graph: a forward bigger than this is cut between layers (polled)."""
REUSE_ROWS = 64
"""A graph of at most this many rows (decode steps, verify windows) is kept for the next."""
WAKE_IDLE_S = 0.003
"""Seconds without a graph on the host after which a quick graph runs on one thread."""
ONE_THREAD_S = 0.01
"""A kept graph one thread computes in less than this is quick (see above)."""
REUSE_ROOM = 128
"""Positions of room a kept graph's attention is built with: steps it can serve again."""
KEPT_GRAPHS = 4
"""Kept graphs, the most recently used (micro-batches that take turns each keep theirs)."""


class GgmlBackend(GgufLayers):
    """Runs blocks ``lo..hi-1`` of a GGUF model with ggml, on the file's quantized blocks.

    Args:
        model: an open ModelFile, a model name (``smollm2``) or a GGUF path.
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: ggml compute threads; None: the cores this process may use.
        flash_attention: attend with ggml's fused attention kernel (llama.cpp's ``-fa on``, the
            default of its server on CPUs): 7-13% less time a step here. False computes the
            scores, a softmax and the value product apart (``-fa off``; its numerics, with
            which greedy tokens equal llama.cpp's run that way), and copies each session's
            values transposed for it at every step.

    Raises:
        GgmlUnavailableError: ggml cannot run on this machine (the message says why).
    """

    @staticmethod
    def unavailable() -> str | None:
        """Why ggml cannot run on this machine, or None (stagerun then offers numpy)."""
        return unavailable()

    def __init__(
        self,
        model: ModelFile | str | os.PathLike[str],
        layers: tuple[int, int] | None = None,
        *,
        threads: int | None = None,
        flash_attention: bool = True,
    ) -> None:
        c = self._open_layers(model, layers, threads)
        self._ffi, self._lib = ffi, lib = load()
        self.threads = threads if threads is not None else default_threads()
        self._cores = HostCores(default_threads())  # shared with the host's other stages
        family = c.family
        mapping = self.model.mapping
        self._mapping = mapping  # the weights point into it: keep it mapped
        base = mapping.ctypes.data
        if base % 32:
            raise RuntimeError("the model file's mapping is not 32-byte aligned")
        wanted = self._tensor_names()
        params = ffi.new(
            "struct ggml_init_params *",
            {"mem_size": lib.ggml_tensor_overhead() * (len(wanted) + 4), "no_alloc": True},
        )
        self._weights_ctx = lib.ggml_init(params[0])
        self._weights_buffer = lib.ggml_backend_cpu_buffer_from_ptr(
            ffi.cast("void *", base), mapping.nbytes
        )
        self._cpu = lib.ggml_backend_cpu_init()
        lib.ggml_backend_cpu_set_n_threads(self._cpu, self.threads)
        self._n_threads = self.threads
        # ggml's reference kernels where it has faster ones whose sums depend on the batch: its
        # flash attention's tiles (64 rows and more) and its split of one row's keys among the
        # threads (512 keys and more) would make a row's result depend on its chunk and on the
        # thread count (`_graph`). The one other thing it turns off, fusing a norm with its
        # weight, gives bitwise the same rows.
        lib.ggml_backend_cpu_set_use_ref(self._cpu, True)
        # The abort flag ggml reads between a graph's nodes (`interrupt`): libc's strlen of a
        # two-byte string, nonzero once its first byte is, so no Python runs per node.
        self._abort = ffi.new("char[2]")
        strlen = ffi.cast("ggml_abort_callback", ffi.addressof(lib, "strlen"))
        lib.ggml_backend_cpu_set_abort_callback(self._cpu, strlen, self._abort)
        self._pool = sleeping_pool(ffi, lib, self.threads)
        if self._pool != ffi.NULL:
            lib.ggml_backend_cpu_set_threadpool(self._cpu, self._pool)
        self._allocator = lib.ggml_gallocr_new(lib.ggml_backend_cpu_buffer_type())
        self._openmp = openmp(lib)  # every graph on one compute thread (`_omp`)
        self._graphs: dict[tuple[Any, ...], Built] = {}  # kept graphs, by their sessions
        width = c.n_kv_heads * c.head_dim  # the sessions' caches, in slots (`_kv`)
        self._slabs = Slabs(ffi, lib, self._hi - self._lo, width, key_blocks(c.context_length))
        self._finalizer = weakref.finalize(
            self, _free, lib, self._weights_ctx, self._weights_buffer, self._cpu,
            self._pool, self._allocator, self._graphs, self._cores,
        )  # fmt: skip
        tensors = {name: self._weight(name, base) for name in wanted}
        self._tensors = tensors
        self._layers: list[Layer] = []
        for layer in range(self._lo, self._hi):
            self._layers.append(self._block(tensors, layer))
        self._embd = tensors.get("token_embd.weight")
        self._embd_scale = float(np.float32(np.sqrt(c.d_model))) if family.embedding_scale else 0.0
        head = "token_embd.weight" if c.tied_output else "output.weight"
        matrices = {n: t.type for n, t in tensors.items() if t.ne[1] > 1 and n.startswith("blk.")}
        if self.is_last:
            matrices[head] = tensors[head].type
        check_row_kernels(lib, matrices, flash=flash_attention)
        self._ops = Blocks(
            lib, c,
            factors=tensors.get("rope_freqs.weight"),
            out_norm=tensors.get("output_norm.weight"),
            head_weight=tensors.get(head) if self.is_last else None,
            flash=flash_attention,
        )  # fmt: skip

    # -- weights ---------------------------------------------------------------------------

    def _tensor_names(self) -> list[str]:
        c, family = self.config, self.config.family
        names = [f"blk.{i}.{t}" for i in range(self._lo, self._hi) for t in family.layer_tensors()]
        if self.is_first:
            names.append("token_embd.weight")
        if self.is_last:
            names.append("output_norm.weight")
            names.append("token_embd.weight" if c.tied_output else "output.weight")
        if c.rope_factors:
            names.append("rope_freqs.weight")
        return list(dict.fromkeys(names))

    def _weight(self, name: str, base: int) -> Any:
        """A tensor header over ``name``'s bytes in the mapping."""
        lib, ffi = self._lib, self._ffi
        stored = self.model.stored(name)
        ne = stored.ne
        if len(ne) == 1:
            t = lib.ggml_new_tensor_1d(self._weights_ctx, stored.qtype, ne[0])
        elif len(ne) == 2:
            t = lib.ggml_new_tensor_2d(self._weights_ctx, stored.qtype, ne[0], ne[1])
        else:
            raise ValueError(
                f"{name} has {len(ne)} dimensions; stagerun reads matrices and vectors"
            )
        if lib.ggml_nbytes(t) != stored.nbytes:
            raise ValueError(
                f"{name}: ggml sizes it {lib.ggml_nbytes(t)} bytes, the file {stored.nbytes}"
            )
        status = lib.ggml_backend_tensor_alloc(
            self._weights_buffer, t, ffi.cast("void *", base + stored.offset)
        )
        if status != 0:
            raise RuntimeError(f"ggml could not place {name} in the mapped file (status {status})")
        return t

    def _block(self, tensors: dict[str, Any], layer: int) -> Layer:
        c, family = self.config, self.config.family
        p = f"blk.{layer}."
        b = Layer(tensors.__getitem__, p, family.fused_qkv, family.fused_gate_up)
        get = tensors.get
        b.bq, b.bk, b.bv = get(p + "attn_q.bias"), get(p + "attn_k.bias"), get(p + "attn_v.bias")
        b.q_norm, b.k_norm = get(p + "attn_q_norm.weight"), get(p + "attn_k_norm.weight")
        b.post_attn = get(p + "post_attention_norm.weight")
        b.post_ffn = get(p + "post_ffw_norm.weight")
        b.rope = c.layer_rope(layer)
        b.window = c.sliding_window if c.is_local(layer) else 0
        return b

    def close(self) -> None:
        """Free ggml's memory now (the backend cannot compute afterwards)."""
        self._finalizer()

    # -- caches ----------------------------------------------------------------------------

    def new_cache(self) -> GgmlKVCache:
        """An empty KV cache for one session on this stage: a slot of one of its slabs."""
        return self._slabs.new_cache()

    def release_memory(self) -> int:
        """Give the system the memory of ended sessions' caches (their slots' written pages):
        the bytes freed. Stages call it when idle; safe while another thread computes."""
        return self._slabs.release()

    def export_kv(self, cache: GgmlKVCache, start: int, stop: int) -> GgmlKVBlock:
        """A copy of the keys and values of positions ``start..stop-1`` (for the prefix cache)."""
        if not 0 <= start <= stop <= cache.length:
            raise ValueError(
                f"cannot export positions {start}..{stop - 1} of a cache of {cache.length}."
            )
        return cache.export(start, stop)

    def import_kv(self, cache: GgmlKVCache, blocks: Sequence[GgmlKVBlock]) -> None:
        """Fill the empty ``cache`` with ``blocks``, consecutive from position 0."""
        if cache.length:
            raise ValueError(f"import_kv needs an empty cache, not one of {cache.length}.")
        total = sum(block.positions for block in blocks)
        self._check_cache(cache)
        check_positions(0, 0, total, self.config.context_length)
        cache.fill(blocks)

    def _check_cache(self, cache: object) -> None:
        if not isinstance(cache, GgmlKVCache) or cache._shape != self._slabs.shape:
            raise ValueError("this KV cache was made by a backend with another layer range.")
        self._slabs.index(cache)  # this backend's

    # -- forwards --------------------------------------------------------------------------

    def forward(
        self,
        cache: GgmlKVCache,
        position: int,
        *,
        tokens: npt.ArrayLike | Sequence[int] | None = None,
        hidden: npt.ArrayLike | None = None,
        logits: Literal["last", "all"] = "last",
        should_stop: Callable[[], bool] | None = None,
    ) -> F32:
        """Run this stage's layers on T new positions ``position..position+T-1``.

        As `stagerun.abc.ComputeBackend.forward`; this is `forward_batch` of one item.
        """
        return forward_one(self, ForwardItem(cache, position, tokens, hidden, logits, should_stop))

    def forward_batch(self, items: Sequence[ForwardItem]) -> list[F32 | ComputeCancelled]:
        """Several sessions in one pass: rows stacked for the matrices, attention per session.

        Each item's result is bitwise what it would be alone (see `_graph`). An item whose
        ``should_stop`` says so between graphs leaves the batch (its cache back at its
        position); the others go on.
        """
        if not items:
            return []
        if len({id(item.cache) for item in items}) != len(items):
            raise ValueError("two items of one batched forward share a KV cache.")
        rows = [self._start(item) for item in items]
        results: list[F32 | ComputeCancelled | None] = [None] * len(items)
        live = list(range(len(items)))
        n = self._hi - self._lo
        per_graph = max(1, SEGMENT_ROW_LAYERS // max(1, sum(len(r) for r in rows)))
        lo = 0
        while lo < n and live:
            for k, stop in poll_stops(items, live, self._lo + lo).items():
                results[k] = stop
            live = [k for k in live if results[k] is None]
            if not live:
                break
            hi = min(n, lo + per_graph)
            self._abort[0] = b"\x00"
            try:
                outputs = self._run(items, rows, live, lo, hi, head=hi == n)
            except GraphAborted:  # `interrupt`: every item left wants to stop
                for k in live:
                    results[k] = ComputeCancelled(f"stopped inside layers {lo}..{hi - 1}")
                live = []
                break
            for k, out in zip(live, outputs, strict=True):
                rows[k] = out
            lo = hi
        for k in live:
            item = items[k]
            item.cache.length = item.position + item.rows
            results[k] = rows[k]
        done: list[F32 | ComputeCancelled] = [r for r in results if r is not None]
        assert len(done) == len(items)
        return done

    def interrupt(self) -> None:
        """Stop the graph computing now at its next node (from any thread).

        For a caller that knows every item of the running forward wants to stop (the tick
        batcher, when all its jobs were abandoned): `forward_batch` then answers each with
        `ComputeCancelled`, its cache back at its position. Between graphs it does nothing.
        """
        self._abort[0] = b"\x01"

    def _start(self, item: ForwardItem) -> npt.NDArray[Any]:
        """An item's input rows, its cache checked, trimmed to its position and made room in."""
        if item.logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {item.logits!r}.")
        rows = stage_input(
            item.tokens,
            item.hidden,
            first=self.is_first,
            lo=self._lo,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
        )
        cache = item.cache
        self._check_cache(cache)
        check_positions(cache.length, item.position, len(rows), self.config.context_length)
        cache.trim(item.position)
        cache.reserve(item.position + len(rows))
        return rows

    def _run(
        self,
        items: Sequence[ForwardItem],
        rows: list[npt.NDArray[Any]],
        live: list[int],
        lo: int,
        hi: int,
        *,
        head: bool,
    ) -> list[F32]:
        """Layers ``lo..hi-1`` of the stage (local numbers) over the live items, as one graph.

        ``rows[k]`` is item k's input (token ids before the first layer of the first stage,
        hidden states otherwise). With ``head`` on the last stage, logits come out. A small
        graph (decode steps, verify windows) is kept and serves the same sessions' next steps
        while they fit in it; a bigger one is built, run and freed.
        """
        # the sessions in stack order: by slab, rows and slot, so that sessions of as many
        # rows in consecutive slots attend together (`group_sessions`)
        slabs = {k: self._slabs.index(items[k].cache) for k in live}
        order = sorted(live, key=lambda k: (slabs[k], len(rows[k]), items[k].cache.slot))
        sizes = [len(rows[k]) for k in order]
        head = head and self._ops.head_weight is not None
        picks = [(n if items[k].logits == "all" else 1) if head else 0
                 for k, n in zip(order, sizes, strict=True)]  # fmt: skip
        slots = [(slabs[k], items[k].cache.slot) for k in order]
        positions = [items[k].position for k in order]
        keep = sum(sizes) <= REUSE_ROWS
        key = (lo, hi, tuple(zip(slots, sizes, picks, strict=True)))
        built = self._graphs.pop(key, None) if keep else None
        if built is not None and not built.fits(positions):
            built.close()
            built = None
        if built is None:
            room = REUSE_ROOM if keep else 0
            keys = [
                min(items[k].cache.capacity, key_blocks(items[k].position + n + room))
                for k, n in zip(order, sizes, strict=True)
            ]
            caches = [items[k].cache for k in order]
            built = self._build(caches, sizes, keys, picks, lo, hi, keep)
        try:
            cost = built.thread_seconds
            if cost is None and self._graphs:  # a new graph: judged by the latest kept one
                cost = next(reversed(self._graphs.values())).thread_seconds
            quick = keep and cost is not None and cost < ONE_THREAD_S
            idle = quick and self._cores.idle_for() >= WAKE_IDLE_S
            with self._cores.taken(1 if idle else self.threads) as threads:
                if threads != self._n_threads:  # a call into the library less (`_graph`)
                    self._lib.ggml_backend_cpu_set_n_threads(self._cpu, threads)
                    self._n_threads = threads
                started = time.perf_counter()
                inputs = [rows[k] for k in order]
                outputs = on_compute_thread(
                    self._openmp,
                    lambda: built.run(self._cpu, self._allocator, positions, inputs),
                )
                built.thread_seconds = (time.perf_counter() - started) * threads
        except BaseException:
            built.close()
            raise
        if keep:
            self._graphs[key] = built  # the most recent last
            while len(self._graphs) > KEPT_GRAPHS:
                self._graphs.pop(next(iter(self._graphs))).close()
        else:
            built.close()
        by_item = dict(zip(order, outputs, strict=True))
        return [by_item[k] for k in live]

    def _build(
        self,
        caches: list[GgmlKVCache],
        sizes: list[int],
        keys: list[int],
        picks: list[int],
        lo: int,
        hi: int,
        keep: bool,
    ) -> Built:
        """The graph of layers ``lo..hi-1`` for sessions of ``sizes`` rows attending to
        ``keys`` keys, with ``picks[k]`` logits rows of each (all 0 but on the head)."""
        c, lib = self.config, self._lib
        total = sum(sizes)
        n_nodes = (hi - lo) * (40 + 24 * len(sizes)) + 8 * len(sizes) + 64  # at most
        g = Graph(self._ffi, lib, n_nodes, own_allocator=keep)
        try:
            ctx = g.ctx
            # the inputs, in the order `_Built.run` gives their values
            pos = g.input(I32, total)
            embed = lo == 0 and self.is_first
            if embed:
                x = lib.ggml_get_rows(ctx, self._embd, g.input(I32, total))
                if self._embd_scale:
                    x = lib.ggml_scale(ctx, x, self._embd_scale)
            else:
                x = g.input(GGML_F32, total, c.d_model)
            windows = [b.window for b in self._layers[lo:hi]]
            firsts = itertools.accumulate(sizes, initial=0)
            sessions = [
                Session(n, cache.slab, cache.slot, first, rows)
                for n, (cache, first, rows) in enumerate(zip(caches, firsts, sizes, strict=False))
            ]
            parts, groups = group_sessions(g, sessions, keys, windows, flash=self._ops.flash)
            for i in range(lo, hi):
                x = self._ops.block(g, self._layers[i], i, x, pos, parts, groups, total)
            picked = None
            if any(picks):
                picked = np.concatenate(
                    [
                        np.arange(s.first + s.rows - n, s.first + s.rows)
                        for s, n in zip(sessions, picks, strict=True)
                    ]
                ).astype(np.int32)
                x = self._ops.head(g, x, len(picked))
                shape = (len(picked), c.vocab_size)
                bounds = list(itertools.accumulate(picks, initial=0))
            else:
                shape = (total, c.d_model)
                bounds = [s.first for s in sessions] + [total]
            lib.ggml_set_output(x)
            g.expand(x)
        except BaseException:
            g.close()
            raise
        return Built(g, parts, groups, x, shape, picked, bounds)


def _free(lib: Any, ctx: Any, buffer: Any, backend: Any, pool: Any, allocator: Any,
          graphs: dict[Any, Built], cores: HostCores) -> None:  # fmt: skip
    cores.close()
    for built in graphs.values():
        built.close()
    graphs.clear()
    lib.ggml_gallocr_free(allocator)
    lib.ggml_backend_free(backend)
    if pool:
        lib.ggml_threadpool_free(pool)
    lib.ggml_backend_buffer_free(buffer)
    lib.ggml_free(ctx)
