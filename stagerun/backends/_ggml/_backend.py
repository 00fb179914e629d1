"""The ggml backend: one stage's layers computed on the GGUF file's own quantized blocks.

Theory of operation. The weights are never copied: the file is mapped read-only, one ggml
CPU buffer is made over the whole mapping, and each weight the stage uses is a tensor header
pointing at its bytes, in the file's own type (Q4_1, Q4_K, Q6_K, Q8_0, F16...). A stage's
resident memory is then the pages of its own layers (the first stage touches only the
embedding rows of the tokens it sees), its sessions' KV caches and the compute buffer.

Every forward builds graphs with ggml's C API through cffi (`_graph`): a batch's sessions
are stacked for the projections and the MLP and attend apart, each to its own float16 cache
(`_kv`). The work is cut into graphs of whole layers, so that ``should_stop`` is polled
between them as the numpy backend polls between layers: a decode or verify step is one
graph, a long prefill several (`SEGMENT_ROW_LAYERS`). ggml quantizes activations to Q8 for
the quantized products (llama.cpp's numerics): results agree with the float32 reference to
about 1e-2 relative, the tokens with llama.cpp's.

ggml's compute threads spin at every node's barrier, so a stage given more threads than it
has idle cores slows down several-fold; `default_threads` gives each stage of the host its
share of the cores the process may use.
"""

from __future__ import annotations

import itertools
import math
import os
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
from ._graph import Graph, SessionRows
from ._kv import GgmlKVBlock, GgmlKVCache
from ._lib import ROPE_NEOX, ROPE_NORMAL, load, unavailable

__all__ = ["GgmlBackend"]

F32 = npt.NDArray[np.float32]
SEGMENT_ROW_LAYERS = 2048
"""Rows times layers per graph: a forward bigger than this is cut between layers (polled)."""


class _Layer:
    """The tensors of one block (headers over the mapped file), by role."""

    __slots__ = (
        "attn_norm", "bk", "bq", "bv", "ffn_norm", "k_norm", "post_attn", "post_ffn", "q_norm",
        "rope", "w_down", "w_gate", "w_k", "w_o", "w_q", "w_qkv", "w_up", "w_v", "window",
    )  # fmt: skip

    def __init__(self, get: Callable[[str], Any], prefix: str, fused_qkv: bool,
                 fused_gate_up: bool) -> None:  # fmt: skip
        self.attn_norm = get(prefix + "attn_norm.weight")
        self.w_qkv = get(prefix + "attn_qkv.weight") if fused_qkv else None
        self.w_q = None if fused_qkv else get(prefix + "attn_q.weight")
        self.w_k = None if fused_qkv else get(prefix + "attn_k.weight")
        self.w_v = None if fused_qkv else get(prefix + "attn_v.weight")
        self.w_o = get(prefix + "attn_output.weight")
        self.ffn_norm = get(prefix + "ffn_norm.weight")
        self.w_gate = None if fused_gate_up else get(prefix + "ffn_gate.weight")
        self.w_up = get(prefix + "ffn_up.weight")
        self.w_down = get(prefix + "ffn_down.weight")
        self.bq = self.bk = self.bv = self.q_norm = self.k_norm = None
        self.post_attn = self.post_ffn = None
        self.rope: tuple[float, float, bool] = (0.0, 1.0, False)
        self.window = 0


class GgmlBackend(GgufLayers):
    """Runs blocks ``lo..hi-1`` of a GGUF model with ggml, on the file's quantized blocks.

    Args:
        model: an open ModelFile, a model name (``smollm2``) or a GGUF path.
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: ggml compute threads; None: the cores this process may use.

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
    ) -> None:
        c = self._open_layers(model, layers, threads)
        self._ffi, self._lib = ffi, lib = load()
        self.threads = threads if threads is not None else default_threads()
        self._eps = float(c.rms_eps)
        family = c.family
        self._rope_mode = ROPE_NORMAL if family.rope_interleaved else ROPE_NEOX
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
        self._allocator = lib.ggml_gallocr_new(lib.ggml_backend_cpu_buffer_type())
        self._finalizer = weakref.finalize(
            self, _free, lib, self._weights_ctx, self._weights_buffer, self._cpu, self._allocator
        )
        tensors = {name: self._weight(name, base) for name in wanted}
        self._tensors = tensors
        self._layers: list[_Layer] = []
        for layer in range(self._lo, self._hi):
            self._layers.append(self._block(tensors, layer))
        self._embd = tensors.get("token_embd.weight")
        self._out_norm = tensors.get("output_norm.weight")
        self._head = tensors.get("token_embd.weight" if c.tied_output else "output.weight")
        if not self.is_last:
            self._head = None
        self._factors = tensors.get("rope_freqs.weight")
        self._embd_scale = float(np.float32(np.sqrt(c.d_model))) if family.embedding_scale else 0.0
        self._gelu = family.activation == "gelu_tanh"
        self._kq_scale = float(1.0 / math.sqrt(c.head_dim))

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

    def _block(self, tensors: dict[str, Any], layer: int) -> _Layer:
        c, family = self.config, self.config.family
        p = f"blk.{layer}."
        b = _Layer(tensors.__getitem__, p, family.fused_qkv, family.fused_gate_up)
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
        """An empty KV cache for one session on this stage."""
        c = self.config
        return GgmlKVCache(
            self._ffi, self._lib, self._hi - self._lo, c.n_kv_heads * c.head_dim, c.context_length
        )

    def export_kv(self, cache: GgmlKVCache, start: int, stop: int) -> GgmlKVBlock:
        """A copy of the keys and values of positions ``start..stop-1`` (for the prefix cache)."""
        if not 0 <= start <= stop <= cache.length:
            raise ValueError(
                f"cannot export positions {start}..{stop - 1} of a cache of {cache.length}."
            )
        return GgmlKVBlock(cache._k[:, start:stop].copy(), cache._v[:, :, start:stop].copy())

    def import_kv(self, cache: GgmlKVCache, blocks: Sequence[GgmlKVBlock]) -> None:
        """Fill the empty ``cache`` with ``blocks``, consecutive from position 0."""
        if cache.length:
            raise ValueError(f"import_kv needs an empty cache, not one of {cache.length}.")
        total = sum(block.positions for block in blocks)
        self._check_cache(cache)
        check_positions(0, 0, total, self.config.context_length)
        cache.reserve(total)
        at = 0
        for block in blocks:
            end = at + block.positions
            cache._k[:, at:end] = block.k
            cache._v[:, :, at:end] = block.v
            at = end
        cache.length = total

    def _check_cache(self, cache: object) -> None:
        c = self.config
        shape = (self._hi - self._lo, c.n_kv_heads * c.head_dim)
        if not isinstance(cache, GgmlKVCache) or cache._shape != shape:
            raise ValueError("this KV cache was made by a backend with another layer range.")

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
            outputs = self._run(items, rows, live, lo, hi, head=hi == n)
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
        hidden states otherwise). With ``head`` on the last stage, logits come out.
        """
        c = self.config
        sizes = [len(rows[k]) for k in live]
        total = sum(sizes)
        n_nodes = (hi - lo) * (40 + 24 * len(live)) + 8 * len(live) + 64
        g = Graph(self._ffi, self._lib, n_nodes)
        try:
            lib, ctx = self._lib, g.ctx
            windows = [b.window for b in self._layers[lo:hi]]
            sessions, at = [], 0
            for k, size in zip(live, sizes, strict=True):
                item = items[k]
                sessions.append(
                    SessionRows(g, item.cache, item.position, at, size, hi - lo, windows)
                )
                at += size
            positions = np.concatenate(
                [
                    np.arange(items[k].position, items[k].position + s)
                    for k, s in zip(live, sizes, strict=True)
                ]
            ).astype(np.int32)
            pos = g.input(positions)
            if lo == 0 and self.is_first:
                ids = g.input(np.concatenate([rows[k] for k in live]).astype(np.int32))
                x = lib.ggml_get_rows(ctx, self._embd, ids)
                if self._embd_scale:
                    x = lib.ggml_scale(ctx, x, self._embd_scale)
            else:
                x = g.input(np.concatenate([rows[k] for k in live]).astype(np.float32, copy=False))
            for i in range(lo, hi):
                x = self._build_block(g, self._layers[i], i, x, pos, sessions, total)
            if head and self._head is not None:
                picks = []
                for k, s in zip(live, sessions, strict=True):
                    n = s.rows if items[k].logits == "all" else 1
                    picks.append(np.arange(s.first + s.rows - n, s.first + s.rows))
                picked = np.concatenate(picks).astype(np.int32)
                out = self._build_head(g, x, picked)
                lib.ggml_set_output(out)
                g.expand(out)
                g.compute(self._cpu, self._allocator)
                logits = g.output(out, (len(picked), c.vocab_size))
                bounds = np.cumsum([0] + [len(p) for p in picks])
                return [logits[a:b] for a, b in itertools.pairwise(bounds)]
            lib.ggml_set_output(x)
            g.expand(x)
            g.compute(self._cpu, self._allocator)
            hidden = g.output(x, (total, c.d_model))
            return [hidden[s.first : s.first + s.rows] for s in sessions]
        finally:
            g.close()

    def _norm(self, g: Graph, x: Any, weight: Any) -> Any:
        lib = self._lib
        return lib.ggml_mul(g.ctx, lib.ggml_rms_norm(g.ctx, x, self._eps), weight)

    def _build_block(
        self, g: Graph, b: _Layer, i: int, x: Any, pos: Any, sessions: list[SessionRows], R: int
    ) -> Any:
        """Block ``i`` (local number) on the stacked rows ``x`` ``[d_model, R]``."""
        lib, ctx, c = self._lib, g.ctx, self.config
        hd, nh, nkv = c.head_dim, c.n_heads, c.n_kv_heads
        cur = self._norm(g, x, b.attn_norm)
        if b.w_qkv is not None:  # Phi-3: one product, then views of its rows
            qkv = lib.ggml_mul_mat(ctx, b.w_qkv, cur)
            row = (nh + 2 * nkv) * hd * 4
            q = lib.ggml_view_3d(ctx, qkv, hd, nh, R, hd * 4, row, 0)
            k = lib.ggml_view_3d(ctx, qkv, hd, nkv, R, hd * 4, row, nh * hd * 4)
            v = lib.ggml_view_2d(ctx, qkv, nkv * hd, R, row, (nh + nkv) * hd * 4)
            v = lib.ggml_cont_2d(ctx, v, nkv * hd, R)
        else:
            q = lib.ggml_mul_mat(ctx, b.w_q, cur)
            k = lib.ggml_mul_mat(ctx, b.w_k, cur)
            v = lib.ggml_mul_mat(ctx, b.w_v, cur)
            if b.bq is not None:
                q = lib.ggml_add(ctx, q, b.bq)
                k = lib.ggml_add(ctx, k, b.bk)
                v = lib.ggml_add(ctx, v, b.bv)
            q = lib.ggml_reshape_3d(ctx, q, hd, nh, R)
            k = lib.ggml_reshape_3d(ctx, k, hd, nkv, R)
        if b.q_norm is not None:
            q = self._norm(g, q, b.q_norm)
            k = self._norm(g, k, b.k_norm)
        base, scale, scaled = b.rope
        factors = self._factors if scaled and self._factors is not None else g.ffi.NULL
        rope = (hd, self._rope_mode, c.context_length, base, 1.0 / scale, 0.0, 1.0, 32.0, 1.0)
        q = lib.ggml_rope_ext(ctx, q, pos, factors, *rope)
        k = lib.ggml_rope_ext(ctx, k, pos, factors, *rope)
        parts = [self._attend(g, b, i, s, q, k, v) for s in sessions]
        attn = _concat_rows(lib, ctx, parts)
        attn = lib.ggml_mul_mat(ctx, b.w_o, attn)
        if b.post_attn is not None:
            attn = self._norm(g, attn, b.post_attn)
        x = lib.ggml_add(ctx, x, attn)
        cur = self._norm(g, x, b.ffn_norm)
        if b.w_gate is None:  # Phi-3: [gate; up] in one matrix
            up = lib.ggml_mul_mat(ctx, b.w_up, cur)
            act = lib.ggml_geglu(ctx, up) if self._gelu else lib.ggml_swiglu(ctx, up)
        else:
            gate = lib.ggml_mul_mat(ctx, b.w_gate, cur)
            up = lib.ggml_mul_mat(ctx, b.w_up, cur)
            split = lib.ggml_geglu_split if self._gelu else lib.ggml_swiglu_split
            act = split(ctx, gate, up)
        down = lib.ggml_mul_mat(ctx, b.w_down, act)
        if b.post_ffn is not None:
            down = self._norm(g, down, b.post_ffn)
        return lib.ggml_add(ctx, x, down)

    def _attend(self, g: Graph, b: _Layer, i: int, s: SessionRows, q: Any, k: Any, v: Any) -> Any:
        """One session's attention in block ``i``: ``[n_heads * head_dim, T]``."""
        lib, ctx, c = self._lib, g.ctx, self.config
        hd, nh, nkv = c.head_dim, c.n_heads, c.n_kv_heads
        width, T, cap, L = nkv * hd, s.rows, s.cache.capacity, s.keys
        f16 = 2
        k_layer = i * cap * width * f16
        v_layer = i * width * cap * f16
        # the session's new keys and values, into its cache (before anything reads it)
        k_new = lib.ggml_view_2d(ctx, k, width, T, width * 4, s.first * width * 4)
        k_dst = lib.ggml_view_2d(
            ctx, s.k, width, T, width * f16, k_layer + s.position * width * f16
        )
        g.expand(lib.ggml_cpy(ctx, k_new, k_dst))
        v_new = lib.ggml_transpose(
            ctx, lib.ggml_view_2d(ctx, v, width, T, width * 4, s.first * width * 4)
        )
        v_dst = lib.ggml_view_2d(ctx, s.v, T, width, cap * f16, v_layer + s.position * f16)
        g.expand(lib.ggml_cpy(ctx, v_new, v_dst))
        keys = lib.ggml_view_3d(ctx, s.k, hd, L, nkv, width * f16, hd * f16, k_layer)
        values = lib.ggml_view_3d(ctx, s.v, L, hd, nkv, cap * f16, hd * cap * f16, v_layer)
        qs = lib.ggml_view_3d(ctx, q, hd, nh, T, hd * 4, nh * hd * 4, s.first * nh * hd * 4)
        qs = lib.ggml_permute(ctx, qs, 0, 2, 1, 3)  # [hd, T, nh]
        kq = lib.ggml_mul_mat(ctx, keys, qs)  # [L, T, nh]
        cap_scores = c.attn_softcap
        mask = s.masks[b.window]
        if cap_scores:
            kq = lib.ggml_scale(ctx, kq, self._kq_scale / cap_scores)
            kq = lib.ggml_scale(ctx, lib.ggml_tanh(ctx, kq), cap_scores)
            kq = lib.ggml_soft_max_ext(ctx, kq, mask, 1.0, 0.0)
        else:
            kq = lib.ggml_soft_max_ext(ctx, kq, mask, self._kq_scale, 0.0)
        out = lib.ggml_mul_mat(ctx, values, kq)  # [hd, T, nh]
        out = lib.ggml_permute(ctx, out, 0, 2, 1, 3)  # [hd, nh, T]
        return lib.ggml_cont_2d(ctx, out, nh * hd, T)

    def _build_head(self, g: Graph, x: Any, picked: npt.NDArray[np.int32]) -> Any:
        lib, ctx = self._lib, g.ctx
        rows = lib.ggml_get_rows(ctx, x, g.input(picked))
        logits = lib.ggml_mul_mat(ctx, self._head, self._norm(g, rows, self._out_norm))
        cap = self.config.final_softcap
        if cap:
            logits = lib.ggml_scale(
                ctx, lib.ggml_tanh(ctx, lib.ggml_scale(ctx, logits, 1 / cap)), cap
            )
        return logits


def _concat_rows(lib: Any, ctx: Any, parts: list[Any]) -> Any:
    """The parts ``[n, T_i]`` side by side ``[n, sum T_i]``, joined as a balanced tree."""
    while len(parts) > 1:
        joined = [
            lib.ggml_concat(ctx, a, b, 1) for a, b in zip(parts[::2], parts[1::2], strict=False)
        ]
        parts = joined + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


def _free(lib: Any, ctx: Any, buffer: Any, backend: Any, allocator: Any) -> None:
    lib.ggml_gallocr_free(allocator)
    lib.ggml_backend_free(backend)
    lib.ggml_backend_buffer_free(buffer)
    lib.ggml_free(ctx)
