"""The reference compute backend: one stage's layers of a llama model in float32 numpy.

Theory of operation. Decoding one token is a chain of matrix-vector products over ~530 MB of
float32 weights for the default model, so the speed limit is memory bandwidth, and what matters
is how the weights are laid out and how many numpy calls each layer makes:

* Weights are stored as column panels ``[P, in, 64]`` (an ``(in, out)`` matrix cut into
  64-column slabs, each C-contiguous) and ``x @ W`` is one batched matmul: a small gemm per
  panel while the panel is in cache. OpenBLAS's sgemm packs the whole matrix on every call, so
  on plain ``(in, out)`` weights 2..16 rows cost 2-5x one row; on panels a 5-token verify
  window costs 1.3-1.5x a one-token step (10 layers, 1 thread: 8.3 vs 6.3 ms; was 17.9 vs
  7.6 ms), and one row is passed as two (the batched gemv path is slower than a 2-row gemm).
  Prompts of 64+ rows run as fast as before on one thread, about 25% slower on two.
* The weight rewrites of `stagerun.model.fuse_layer`: Q/K/V and gate/up fused, RMSNorm gains
  folded into the following matrix, 1/sqrt(head_dim) into W_q, and the Q/K rows of each head
  reordered so that RoPE rotates the halves ``(i, i + head_dim/2)`` with contiguous slices and
  precomputed tables.
* Grouped-query attention never repeats K/V: queries are viewed as ``[n_kv, group*T, head_dim]``
  and batched matmul broadcasts over the KV heads.
* The KV cache is preallocated and grows in place by doubling; a decode step writes one slot.
* Everything is float32; constants are np.float32 (NEP 50 would promote to float64 otherwise).

The backend is plain blocking code. ``threads`` limits OpenBLAS for the duration of each
``forward`` (and ``new_cache`` is free): the thread count is process-wide, so it is set on entry
and restored on exit, which costs about 8 us a call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
from threadpoolctl import ThreadpoolController

from .._errors import ComputeCancelled
from ..model import LayerWeights, ModelFile, fuse_layer
from ._inputs import check_positions, stage_input
from ._layers import GgufLayers

__all__ = ["KVCache", "NumpyBackend"]

F32 = npt.NDArray[np.float32]
_CHUNK = 256  # first KV allocation, in tokens; later growth doubles
_PANEL = 64  # columns per weight panel
_controller: ThreadpoolController | None = None


def _blas_limit(threads: int | None) -> contextlib.AbstractContextManager[object]:
    """Limit BLAS threads for a with-block (process-wide); None changes nothing."""
    global _controller
    if threads is None:
        return contextlib.nullcontext()
    if _controller is None:
        _controller = ThreadpoolController()
    return _controller.limit(limits=threads, user_api="blas")  # type: ignore[no-any-return]


class KVCache:
    """Keys and values of one session on one stage, for positions ``0..length-1``.

    Storage is ``[layers, n_kv, capacity, head_dim]`` for K and for V, grown in place by doubling.
    """

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, max_length: int) -> None:
        self.length = 0
        self._max = max_length
        self._shape = (n_layers, n_kv, 0, head_dim)
        self._k: F32 = np.empty(self._shape, np.float32)
        self._v: F32 = np.empty(self._shape, np.float32)

    def __repr__(self) -> str:
        return f"<KVCache length={self.length} capacity={self.capacity} layers={self._shape[0]}>"

    @property
    def capacity(self) -> int:
        return int(self._k.shape[2])

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        self.length = min(self.length, position)

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = min(max(needed, 2 * self.capacity, _CHUNK), max(needed, self._max))
        n_layers, n_kv, _, hd = self._shape
        for name in ("_k", "_v"):
            new = np.empty((n_layers, n_kv, cap, hd), np.float32)
            new[:, :, : self.length] = getattr(self, name)[:, :, : self.length]
            setattr(self, name, new)


class _Layer:
    """One block, packed for speed (see the module docstring)."""

    __slots__ = ("w_down", "w_gu", "w_o", "w_qkv")

    def __init__(self, w_qkv: _Panels, w_o: _Panels, w_gu: _Panels, w_down: _Panels) -> None:
        self.w_qkv, self.w_o, self.w_gu, self.w_down = w_qkv, w_o, w_gu, w_down


class _Panels:
    """A weight matrix ``(in, out)`` stored as column panels ``[P, in, PANEL]``, C-contiguous.

    ``x @ W`` then is one batched matmul, a small gemm per panel whose panel stays in cache
    while every row of ``x`` passes over it (see the module docstring). ``out`` is padded with
    zero columns up to a multiple of the panel width.
    """

    __slots__ = ("data", "n_out")

    def __init__(self, w: F32) -> None:
        n_in, n_out = w.shape
        panels = -(-n_out // _PANEL)
        padded = np.zeros((n_in, panels * _PANEL), np.float32)
        padded[:, :n_out] = w
        self.data: F32 = np.ascontiguousarray(
            padded.reshape(n_in, panels, _PANEL).transpose(1, 0, 2)
        )
        self.n_out = n_out

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[1], self.n_out)


def _matmul(x: F32, w: _Panels) -> F32:
    """``x @ W`` for ``x`` of shape ``[T, in]``: ``[T, out]``."""
    n = x.shape[0]
    if n == 1:  # as two rows: the batched gemv path is slower than a 2-row gemm
        x = np.concatenate([x, np.zeros_like(x)])
    y = np.matmul(x, w.data)  # [P, T, PANEL]
    out: F32 = y.transpose(1, 0, 2).reshape(x.shape[0], -1)
    return out[:n, : w.n_out]


def _panels(w: F32) -> _Panels:
    """Panels for an ``(out, in)`` matrix (the orientation `stagerun.model` uses)."""
    return _Panels(w.T)


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
        self._head: _Panels | None = None
        if w.output is not None and w.output_norm is not None:
            self._head = _panels(w.output * w.output_norm[None, :])
        hd, half = c.head_dim, c.head_dim // 2
        inv_freq = 1.0 / (c.rope_base ** (np.arange(half, dtype=np.float64) * 2.0 / hd))
        angles = np.arange(c.context_length, dtype=np.float64)[:, None] * inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        # [position, half of the head, frequency], to broadcast over [T, heads, 2, hd/2]
        self._cos = np.stack([cos, cos], axis=1).astype(np.float32)
        self._sin = np.stack([-sin, sin], axis=1).astype(np.float32)

    def _pack_layer(self, lw: LayerWeights) -> _Layer:
        f = fuse_layer(lw, self.config)
        return _Layer(_panels(f.qkv), _panels(f.wo), _panels(f.gate_up), _panels(f.down))

    def __repr__(self) -> str:
        return (
            f"<NumpyBackend layers=[{self._lo}, {self._hi}) of {self.config.n_layers} "
            f"first={self.is_first} last={self.is_last} threads={self.threads}>"
        )

    def new_cache(self) -> KVCache:
        """An empty KV cache for one session on this stage."""
        c = self.config
        return KVCache(self._hi - self._lo, c.n_kv_heads, c.head_dim, c.context_length)

    def forward(
        self,
        cache: KVCache,
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
        ``should_stop`` is called before every layer (and so between layers).

        Returns:
            float32 hidden states ``[T, d_model]`` on a non-last stage; on the last stage, logits
            ``[T, vocab]`` (``logits="all"``) or ``[1, vocab]`` for the last position. The
            array is new; the caller owns it.

        Raises:
            ComputeCancelled: ``should_stop()`` returned True at a layer boundary; the cache is
                then back at ``position``.
        """
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {logits!r}.")
        h = self._input(tokens, hidden)
        n = h.shape[0]
        self._check_position(cache, position, n)
        cache.trim(position)
        cache._reserve(position + n)
        with _blas_limit(self.threads), np.errstate(over="ignore"):
            for i, layer in enumerate(self._layers):
                if should_stop is not None and should_stop():
                    raise ComputeCancelled(
                        f"compute at position {position} stopped before layer {self._lo + i}."
                    )
                self._block(layer, i, cache, position, h)
            cache.length = position + n
            if self._head is None:
                return h
            rows = h if logits == "all" else h[-1:]
            return _matmul(self._norm(rows), self._head)

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
        return embedded

    def _check_position(self, cache: KVCache, position: int, n: int) -> None:
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

    def _block(self, layer: _Layer, i: int, cache: KVCache, pos: int, h: F32) -> None:
        c = self.config
        n, hd, n_kv = h.shape[0], c.head_dim, c.n_kv_heads
        group = c.n_heads // n_kv
        qkv = _matmul(self._norm(h), layer.w_qkv)  # [T, (n_heads + 2 n_kv) hd]
        nqk = c.n_heads + n_kv
        end = pos + n
        qk = qkv[:, : nqk * hd].reshape(n, nqk, 2, hd // 2)
        rot = qk[:, :, ::-1] * self._sin[pos:end, None]
        qk *= self._cos[pos:end, None]
        qk += rot
        k = qkv[:, c.n_heads * hd : nqk * hd].reshape(n, n_kv, hd)
        v = qkv[:, nqk * hd :].reshape(n, n_kv, hd)
        cache._k[i, :, pos:end] = k.transpose(1, 0, 2)
        cache._v[i, :, pos:end] = v.transpose(1, 0, 2)
        q = qkv[:, : c.n_heads * hd].reshape(n, n_kv, group, hd)
        q = q.transpose(1, 2, 0, 3).reshape(n_kv, group * n, hd)  # type: ignore[assignment]
        s: F32 = q @ cache._k[i, :, :end].transpose(0, 2, 1)  # [n_kv, group*T, L]
        if n > 1:
            mask = np.triu(np.full((n, end), -np.inf, np.float32), k=pos + 1)
            s_view = s.reshape(n_kv, group, n, end)
            s_view += mask
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        o = (s @ cache._v[i, :, :end]).reshape(n_kv, group, n, hd).transpose(2, 0, 1, 3)
        attn: F32 = o.reshape(n, c.n_heads * hd)
        h += _matmul(attn, layer.w_o)
        gu = _matmul(self._norm(h), layer.w_gu)  # [T, 2 d_ff]
        g, u = gu[:, : c.d_ff], gu[:, c.d_ff :]
        act: F32 = np.negative(g)
        np.exp(act, out=act)
        act += np.float32(1.0)
        np.divide(g, act, out=act)
        act *= u
        h += _matmul(act, layer.w_down)
