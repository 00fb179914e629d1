"""The reference compute backend: one stage's layers of a GGUF model in float32 numpy.

It runs every built-in family (`stagerun.model.Family`) and any plugin family made of their
traits: biases, query/key norms, post-norms, SwiGLU or GeGLU, scaled embeddings, sliding
windows with their own RoPE base, linear and Llama 3 RoPE scaling, and softcapped scores
and logits.

Theory of operation. Decoding one token is a chain of matrix-vector products over ~530 MB of
float32 weights for the default model, so the speed limit is memory bandwidth, and what matters
is how the weights are laid out and how many numpy calls each layer makes:

* Weights are stored as column panels ``[P, in, 64]`` (an ``(in, out)`` matrix cut into
  64-column slabs, each C-contiguous) and ``x @ W`` is one batched matmul: a small gemm per
  panel while the panel is in cache. OpenBLAS's sgemm packs the whole matrix on every call, so
  on plain ``(in, out)`` weights 2..16 rows cost 2-5x one row; on panels a 5-token verify
  window costs 1.3-1.5x a one-token step (10 layers, 1 thread: 8.3 vs 6.3 ms; was 17.9 vs
  7.6 ms).
* Every gemm call computes exactly 4 or 8 rows (the last block padded with zero rows): the
  attention's calls 4 (`_GEMM_ROWS`), the matrices' 4 up to 4 rows and 8 past that
  (`_WIDE_GEMM_ROWS`, the last 1-4 rows in a 4-row call). OpenBLAS sums a row in an order
  that depends on where the row falls in its call: on AVX2 cores (Haswell kernels, AMD Zen
  included) the rows of whole 12- and 24-row tiles sum in one order and the remainder rows
  (8, 4, 2, 1) in others, so a row's bits would depend on how many rows came with it. Calls
  of a fixed small shape put every row through the same kernel path: measured on Zen with 1
  and 2 threads, 4- and 8-row calls give every row bitwise the same result, whatever its
  place and the other rows (12- and 16-row calls do not). A 4-row call costs no more per row
  than a 2-row one; past 4 rows an 8-row call reads each panel once instead of twice (8
  gathered decode rows: 82 us a panel set against 108 us in two 4-row calls).
* The weight rewrites of `stagerun.model.fuse_layer`: Q/K/V and gate/up fused, RMSNorm gains
  folded into the following matrix, 1/sqrt(head_dim) into W_q, and the Q/K rows of each head
  reordered so that RoPE rotates the halves ``(i, i + head_dim/2)`` with contiguous slices and
  precomputed tables.
* Grouped-query attention never repeats K/V: queries are viewed as ``[n_kv, group*T, head_dim]``
  and batched matmul broadcasts over the KV heads.
* The KV cache is preallocated and grows in place by doubling; a decode step writes one slot.
  A local (sliding-window) layer keeps every position too, but attends only to the key blocks
  its window reaches, so its cost stays flat however long the context grows.
* RoPE tables are computed per distinct (base, scaling) of the stage's layers, for the
  positions used so far, and grow by doubling.
* Everything is float32; constants are np.float32 (NEP 50 would promote to float64 otherwise).

The backend is plain blocking code. ``threads`` limits OpenBLAS for the duration of each
``forward`` (and ``new_cache`` is free): the thread count is process-wide, so it is set on entry
and restored on exit, which costs about 8 us a call.

The pieces: `_kernels` (weight panels and their matmul, the activations, RoPE tables), `_kv`
(a session's KV cache and the blocks the prefix cache copies), `_batch` (the sessions of one
batched forward); this module packs the layers and runs them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
from threadpoolctl import ThreadpoolController

from .._errors import ComputeCancelled
from ..abc import ForwardItem
from ..model import LayerWeights, ModelFile, fuse_layer
from ._batch import _Batch
from ._inputs import check_positions, forward_one, stage_input
from ._kernels import (
    _GEMM_ROWS,
    _gelu_tanh,
    _in_blocks,
    _matmul,
    _Panels,
    _panels,
    _Rope,
    _silu,
)
from ._kv import _KEY_BLOCK, KVBlock, NumpyKVCache
from ._layers import GgufLayers

__all__ = ["KVBlock", "NumpyBackend", "NumpyKVCache"]

F32 = npt.NDArray[np.float32]
_ATTENTION_ROWS = 80  # query positions attended at once (bounds the score arrays)
_controller: ThreadpoolController | None = None


def _blas_limit(threads: int | None) -> contextlib.AbstractContextManager[object]:
    """Limit BLAS threads for a with-block (process-wide); None changes nothing."""
    global _controller
    if threads is None:
        return contextlib.nullcontext()
    if _controller is None:
        _controller = ThreadpoolController()
    return _controller.limit(limits=threads, user_api="blas")  # type: ignore[no-any-return]


class _Layer:
    """One block, packed for speed (see the module docstring)."""

    __slots__ = (
        "k_norm", "post_attn", "post_ffn", "q_norm", "qkv_bias", "w_down", "w_gu", "w_o", "w_qkv",
    )  # fmt: skip

    def __init__(
        self,
        w_qkv: _Panels,
        w_o: _Panels,
        w_gu: _Panels,
        w_down: _Panels,
        qkv_bias: F32 | None = None,
        q_norm: F32 | None = None,
        k_norm: F32 | None = None,
        post_attn: F32 | None = None,
        post_ffn: F32 | None = None,
    ) -> None:
        self.w_qkv, self.w_o, self.w_gu, self.w_down = w_qkv, w_o, w_gu, w_down
        self.qkv_bias, self.q_norm, self.k_norm = qkv_bias, q_norm, k_norm
        self.post_attn, self.post_ffn = post_attn, post_ffn


class NumpyBackend(GgufLayers):
    """Runs blocks ``lo..hi-1`` of a llama GGUF model with numpy.

    Args:
        model: an open ModelFile, a model name (``smollm2``) or a GGUF path.
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: OpenBLAS threads during ``forward``; None leaves the process setting alone.
    """

    def __init__(
        self,
        model: ModelFile | str | os.PathLike[str],
        layers: tuple[int, int] | None = None,
        *,
        threads: int | None = None,
    ) -> None:
        c = self._open_layers(model, layers, threads)
        self.threads = threads
        self._eps = np.float32(c.rms_eps)
        self._inv_d = np.float32(1.0 / c.d_model)
        w = self.model.load_weights(self._lo, self._hi, embeddings=self.is_first, head=self.is_last)
        self._layers = [self._pack_layer(lw) for lw in w.layers]
        self._embd: F32 | None = w.token_embd
        self._embd_scale = np.float32(np.sqrt(c.d_model)) if c.family.embedding_scale else None
        self._head: _Panels | None = None
        if w.output is not None and w.output_norm is not None:
            self._head = _panels(w.output, w.output_norm)
        factors = self.model.rope_factors()
        ropes: dict[tuple[float, float, bool], _Rope] = {}
        self._ropes: list[_Rope] = []  # per layer of the stage, shared by equal settings
        self._windows: list[int] = []
        for layer in range(self._lo, self._hi):
            key = c.layer_rope(layer)
            base, scale, scaled = key
            if key not in ropes:
                ropes[key] = _Rope(c.head_dim, base, scale, factors if scaled else None)
            self._ropes.append(ropes[key])
            self._windows.append(c.sliding_window if c.is_local(layer) else 0)
        self._gelu = c.family.activation == "gelu_tanh"

    def _pack_layer(self, lw: LayerWeights) -> _Layer:
        f = fuse_layer(lw, self.config)
        return _Layer(
            _panels(f.qkv),
            _panels(f.wo),
            _panels(f.gate_up),
            _panels(f.down),
            f.qkv_bias,
            f.q_norm,
            f.k_norm,
            f.post_attn_norm,
            f.post_ffn_norm,
        )

    def new_cache(self) -> NumpyKVCache:
        """An empty KV cache for one session on this stage."""
        c = self.config
        return NumpyKVCache(self._hi - self._lo, c.n_kv_heads, c.head_dim, c.context_length)

    def forward(
        self,
        cache: NumpyKVCache,
        position: int,
        *,
        tokens: npt.ArrayLike | Sequence[int] | None = None,
        hidden: npt.ArrayLike | None = None,
        logits: Literal["last", "all"] = "last",
        should_stop: Callable[[], bool] | None = None,
    ) -> F32:
        """Run this stage's layers on T new positions ``position..position+T-1``.

        The first stage takes ``tokens`` (T ids), the others ``hidden`` (``[T, d_model]``, cast
        to float32 and never modified). A cache longer than ``position`` is trimmed first; a
        shorter one is a gap (ValueError). ``logits`` only matters on the last stage.
        ``should_stop`` is called before every layer (and so between layers). This is
        `forward_batch` of one item: a session computes the same alone as in a batch.

        Returns:
            float32 hidden states ``[T, d_model]`` on a non-last stage; on the last stage, logits
            ``[T, vocab]`` (``logits="all"``) or ``[1, vocab]`` for the last position. The
            array is new; the caller owns it.

        Raises:
            ComputeCancelled: ``should_stop()`` returned True at a layer boundary; the cache is
                then back at ``position``.
        """
        return forward_one(self, ForwardItem(cache, position, tokens, hidden, logits, should_stop))

    def export_kv(self, cache: NumpyKVCache, start: int, stop: int) -> KVBlock:
        """A copy of the keys and values of positions ``start..stop-1`` (for the prefix cache)."""
        if not 0 <= start <= stop <= cache.length:
            raise ValueError(
                f"cannot export positions {start}..{stop - 1} of a cache of {cache.length}."
            )
        return KVBlock(cache._k[..., start:stop].copy(), cache._v[:, :, start:stop].copy())

    def import_kv(self, cache: NumpyKVCache, blocks: Sequence[KVBlock]) -> None:
        """Fill the empty ``cache`` with ``blocks``, consecutive from position 0."""
        if cache.length:
            raise ValueError(f"import_kv needs an empty cache, not one of {cache.length}.")
        total = sum(block.positions for block in blocks)
        self._check_position(cache, 0, total)
        cache._reserve(total)
        at = 0
        for block in blocks:
            end = at + block.positions
            cache._k[..., at:end] = block.k
            cache._v[:, :, at:end] = block.v
            at = end
        cache.length = total

    def forward_batch(self, items: Sequence[ForwardItem]) -> list[F32 | ComputeCancelled]:
        """Several sessions in one pass: rows stacked for the matrices, attention per session.

        Every matrix product runs in row blocks of one fixed size (`_matmul`), so a row's
        result never depends on the rows beside it: each item's result is bitwise what it
        would be alone. An item whose ``should_stop`` says so leaves the batch at that layer
        boundary (its cache back at its position); the others go on.
        """
        if not items:
            return []
        if len({id(item.cache) for item in items}) != len(items):
            raise ValueError("two items of one batched forward share a KV cache.")
        batch = _Batch([self._start(item) for item in items], items)
        end = max(item.position + n for item, n in zip(items, batch.sizes, strict=True))
        for rope in self._ropes:
            rope.reach(end)
        with _blas_limit(self.threads), np.errstate(over="ignore"):
            for i, layer in enumerate(self._layers):
                batch.poll(self._lo + i)
                if not batch.live:
                    break
                self._block(layer, i, batch)
            return self._finish(batch)

    def _start(self, item: ForwardItem) -> F32:
        """An item's input rows, its cache checked, trimmed to its position and made room in."""
        if item.logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {item.logits!r}.")
        h = self._input(item.tokens, item.hidden)
        cache = item.cache
        self._check_position(cache, item.position, h.shape[0])
        cache.trim(item.position)
        cache._reserve(item.position + h.shape[0])
        return h

    def _finish(self, batch: _Batch) -> list[F32 | ComputeCancelled]:
        """Each live item's output: its hidden rows, or on the last stage its logits."""
        picked: list[F32] = []
        for k, item in enumerate(batch.items):
            if batch.cancelled[k] is not None:
                continue
            item.cache.length = item.position + batch.sizes[k]
            rows = batch.rows_of(k)
            picked.append(rows if self._head is None or item.logits == "all" else rows[-1:])
        if self._head is not None and picked:
            heads = _matmul(self._norm(np.concatenate(picked)), self._head)
            cap = self.config.final_softcap
            if cap:
                heads /= np.float32(cap)
                np.tanh(heads, out=heads)
                heads *= np.float32(cap)
            bounds = np.cumsum([0] + [p.shape[0] for p in picked])
            picked = [heads[a:b] for a, b in itertools.pairwise(bounds)]
        live = iter(picked)
        return [r if r is not None else next(live).copy() for r in batch.cancelled]

    def _input(self, tokens: object, hidden: object) -> F32:
        rows = stage_input(
            tokens,
            hidden,
            first=self.is_first,
            lo=self._lo,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
        )
        if not self.is_first:
            hidden_rows: F32 = rows
            return hidden_rows
        assert self._embd is not None
        embedded: F32 = self._embd[rows]
        if self._embd_scale is not None:
            embedded *= self._embd_scale
        return embedded

    def _check_position(self, cache: NumpyKVCache, position: int, n: int) -> None:
        c = self.config
        if cache._shape != (self._hi - self._lo, c.n_kv_heads, 0, c.head_dim):
            raise ValueError("this KV cache was made by a backend with another layer range.")
        check_positions(cache.length, position, n, c.context_length)

    def _norm(self, h: F32) -> F32:
        """RMS-normalize rows (the gain is folded into the next matrix)."""
        r = np.einsum("ij,ij->i", h, h)
        r *= self._inv_d
        r += self._eps
        np.sqrt(r, out=r)
        out: F32 = h / r[:, None]
        return out

    def _block(self, layer: _Layer, i: int, batch: _Batch) -> None:
        c = self.config
        h, hd = batch.h, c.head_dim
        qkv = _matmul(self._norm(h), layer.w_qkv)  # [R, (n_heads + 2 n_kv) hd]
        nqk = c.n_heads + c.n_kv_heads
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        if layer.q_norm is not None and layer.k_norm is not None:
            heads = qkv[:, : nqk * hd].reshape(h.shape[0], nqk, hd)
            self._head_norms(heads, layer.q_norm, layer.k_norm)
        qk = qkv[:, : nqk * hd].reshape(h.shape[0], nqk, 2, hd // 2)
        cos, sin = batch.rope(self._ropes[i])
        rot = qk[:, :, ::-1] * sin
        qk *= cos
        qk += rot
        attn: F32 = np.empty((h.shape[0], c.n_heads * hd), np.float32)
        for k, (a, b) in batch.spans():
            attn[a:b] = self._attend(i, batch.items[k], qkv[a:b])
        h += self._post_norm(_matmul(attn, layer.w_o), layer.post_attn)
        gu = _matmul(self._norm(h), layer.w_gu)  # [R, 2 d_ff]
        g, u = gu[:, : c.d_ff], gu[:, c.d_ff :]
        act = _gelu_tanh(g) if self._gelu else _silu(g)
        act *= u
        h += self._post_norm(_matmul(act, layer.w_down), layer.post_ffn)

    def _post_norm(self, out: F32, gain: F32 | None) -> F32:
        """A block output as it joins the residual stream: normalized first, if the family says."""
        if gain is None:
            return out
        normed = self._norm(out)
        normed *= gain
        return normed

    def _head_norms(self, qk: F32, q_norm: F32, k_norm: F32) -> None:
        """RMS-normalize each head's query and key rows in place (``[R, heads, hd]``)."""
        r = np.einsum("rhd,rhd->rh", qk, qk)
        r *= np.float32(1.0 / qk.shape[2])
        r += self._eps
        np.sqrt(r, out=r)
        qk /= r[:, :, None]
        n_heads = self.config.n_heads
        qk[:, :n_heads] *= q_norm
        qk[:, n_heads:] *= k_norm

    def _attend(self, i: int, item: ForwardItem, qkv: F32) -> F32:
        """One session's attention in layer ``i``: its new K/V cached, its rows' outputs.

        Keys go in blocks of `_KEY_BLOCK` (the last one padded and masked), and every sum over
        keys has a fixed shape: scores and weighted values per block are small gemms with a
        fixed inner length, a block's softmax mass is a sum of `_KEY_BLOCK` terms, and blocks
        are added in order (`np.cumsum`). A block past a row's position adds exact zeros. So
        a row's output depends on its position and the cache, not on how many rows its chunk
        has nor where the chunk ends: a prompt prefilled in one chunk, in many, or restored
        from the prefix cache and finished in a chunk of its own, computes bitwise the same.
        """
        c = self.config
        cache: NumpyKVCache = item.cache
        n, hd, n_kv = qkv.shape[0], c.head_dim, c.n_kv_heads
        group, nqk = c.n_heads // n_kv, c.n_heads + n_kv
        pos = item.position
        end = pos + n
        cache._k[i, :, :, pos:end] = (
            qkv[:, c.n_heads * hd : nqk * hd].reshape(n, n_kv, hd).transpose(1, 2, 0)
        )
        cache._v[i, :, pos:end] = qkv[:, nqk * hd :].reshape(n, n_kv, hd).transpose(1, 0, 2)
        n_blocks = -(-end // _KEY_BLOCK)
        span = n_blocks * _KEY_BLOCK
        keys_t = cache._k[i, :, :, :span].reshape(n_kv, hd, n_blocks, _KEY_BLOCK)
        keys_t = keys_t.transpose(0, 2, 1, 3)  # [n_kv, blocks, hd, KEY_BLOCK], each plain
        values = cache._v[i, :, :span].reshape(n_kv, n_blocks, _KEY_BLOCK, hd)
        q = qkv[:, : c.n_heads * hd].reshape(n, n_kv, group, hd)
        out: F32 = np.empty((n, c.n_heads * hd), np.float32)
        step = _ATTENTION_ROWS
        window, cap = self._windows[i], np.float32(c.attn_softcap)
        for t0 in range(0, n, step):
            t1 = min(n, t0 + step)
            out[t0:t1] = self._attend_rows(q[t0:t1], pos + t0, keys_t, values, window, cap)
        return out

    @staticmethod
    def _attend_rows(
        q: F32, first: int, keys_t: F32, values: F32, window: int, cap: np.float32
    ) -> F32:
        """Attention of the rows ``q`` (``[m, n_kv, group, hd]``, positions from ``first``).

        With a ``window``, the row at position p sees the keys ``p-window+1..p``: key blocks
        wholly before the first row's window, like those wholly after the last row, would add
        exact zeros to every row, so they are left out. ``cap`` softcaps the scores (0: not).
        """
        m, n_kv, group, hd = q.shape
        # blocks wholly after the last row are masked for every row: they would add zeros
        n_blocks = (first + m - 1) // _KEY_BLOCK + 1
        lo = max(0, first - window + 1) // _KEY_BLOCK if window else 0
        keys_t, values = keys_t[:, lo:n_blocks], values[:, lo:n_blocks]
        base, n_blocks = lo * _KEY_BLOCK, n_blocks - lo
        span = base + n_blocks * _KEY_BLOCK
        n_rows = group * m
        rows = _in_blocks(q.transpose(1, 2, 0, 3).reshape(n_kv, n_rows, hd), _GEMM_ROWS, 1)
        # one gemm of _GEMM_ROWS rows per (kv head, key block, row block): [n_kv, blocks, R, 64]
        s: F32 = np.matmul(rows[:, None], keys_t[:, :, None]).reshape(
            n_kv, n_blocks, -1, _KEY_BLOCK
        )
        if s.shape[2] != n_rows:  # padded: keep the real rows, contiguous (views follow)
            s = np.ascontiguousarray(s[:, :, :n_rows])
        if cap:
            s /= cap
            np.tanh(s, out=s)
            s *= cap
        # key j is seen by the row at position p iff j <= p (and p - j < window): without a
        # window only the blocks from the first row's own on hold keys some row does not see
        b0 = 0 if window else first // _KEY_BLOCK - lo
        keys = np.arange(base + b0 * _KEY_BLOCK, span)
        at = np.arange(first, first + m)[:, None]
        hidden = keys[None, :] > at
        if window:
            hidden |= keys[None, :] <= at - window
        mask = np.zeros(hidden.shape, np.float32)
        mask[hidden] = -np.inf
        s_view = s.reshape(n_kv, n_blocks, group, m, _KEY_BLOCK)
        tail = mask.reshape(m, n_blocks - b0, _KEY_BLOCK).transpose(1, 0, 2)
        s_view[:, b0:] += tail[None, :, None]
        s -= s.max(axis=3, keepdims=True).max(axis=1, keepdims=True)
        np.exp(s, out=s)
        per_block = s.sum(axis=-1)  # [n_kv, blocks, rows]
        weighted: F32 = np.matmul(_in_blocks(s, _GEMM_ROWS, 2), values[:, :, None]).reshape(
            n_kv, n_blocks, -1, hd
        )[:, :, :n_rows]  # [n_kv, blocks, rows, hd]
        mass, o = per_block[:, 0].copy(), weighted[:, 0].copy()
        for b in range(1, n_blocks):  # in order: a fixed sum whatever the row count
            mass += per_block[:, b]
            o += weighted[:, b]
        o /= mass[..., None]
        result: F32 = o.reshape(n_kv, group, m, hd).transpose(2, 0, 1, 3).reshape(m, -1)
        return result
