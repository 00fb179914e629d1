"""The numeric building blocks of the numpy backend: weight panels and their matmul, the
activations, and RoPE tables.

Every one of them computes each row independently of the others (see `_numpy`'s module
docstring for why the weights are laid out as panels, and for the bitwise batch invariance
this keeps).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
_PANEL = 64  # columns per weight panel
_GEMM_ROWS = 4  # rows of every small gemm call: one kernel path for every row (see `_numpy`)
_WIDE_GEMM_ROWS = 8  # rows of the matrices' calls past 4 rows: the same bits per row as 4


class _Panels:
    """A weight matrix ``(in, out)`` stored as column panels ``[P, in, PANEL]``, C-contiguous.

    ``x @ W`` then is one batched matmul, a small gemm per panel whose panel stays in cache
    while every row of ``x`` passes over it (see the module docstring). ``out`` is padded with
    zero columns up to a multiple of the panel width.
    """

    __slots__ = ("data", "n_out")

    def __init__(self, w: F32, gain: F32 | None = None) -> None:
        self.data, self.n_out = _panel_data(w.T, gain), w.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[1], self.n_out)


def _in_blocks(x: F32, rows: int, axis: int) -> F32:
    """``x`` with its ``axis`` cut into blocks of exactly ``rows`` (zero rows pad the last).

    The blocks become a new axis before ``axis``, so a batched matmul over them makes one
    gemm call of ``rows`` rows per block.
    """
    n = x.shape[axis]
    pad = -n % rows
    if pad:
        shape = list(x.shape)
        shape[axis] = pad
        x = np.concatenate([x, np.zeros(shape, np.float32)], axis=axis)
    blocked: F32 = x.reshape(*x.shape[:axis], -1, rows, *x.shape[axis + 1 :])
    return blocked


def _matmul(x: F32, w: _Panels) -> F32:
    """``x @ W`` for ``x`` of shape ``[T, in]``: ``[T, out]``, each row independent of the others.

    Every gemm call computes exactly 4 or 8 rows of one panel, which put each row through the
    same kernel path whatever the rows beside it (see `_numpy`'s module docstring): up to 4
    rows in one 4-row call, more in 8-row calls (a panel read once per 8 rows, not per 4),
    the last 1-4 of them in a 4-row call.
    """
    n = x.shape[0]
    if n <= _GEMM_ROWS:
        return _blocked_matmul(x, w, _GEMM_ROWS)
    wide = n - n % _WIDE_GEMM_ROWS if 0 < n % _WIDE_GEMM_ROWS <= _GEMM_ROWS else n
    if wide == n:
        return _blocked_matmul(x, w, _WIDE_GEMM_ROWS)
    head = _blocked_matmul(x[:wide], w, _WIDE_GEMM_ROWS)
    return np.concatenate([head, _blocked_matmul(x[wide:], w, _GEMM_ROWS)])


def _blocked_matmul(x: F32, w: _Panels, rows: int) -> F32:
    """``x @ W`` in gemm calls of exactly ``rows`` rows (the last block padded with zeros)."""
    y = np.matmul(_in_blocks(x, rows, 0)[:, None], w.data)  # [C, P, rows, PANEL]
    out: F32 = y.transpose(0, 2, 1, 3).reshape(-1, y.shape[1] * _PANEL)
    return out[: x.shape[0], : w.n_out]


def _panels(w: F32, gain: F32 | None = None) -> _Panels:
    """Panels for an ``(out, in)`` matrix (the orientation `stagerun.model` uses).

    ``gain`` scales the input columns (a norm's gain folded in) as the panels are written.
    """
    return _Panels(w.T, gain)


def _panel_data(w_rows: F32, gain: F32 | None) -> F32:
    """``[P, in, PANEL]`` from an ``(out, in)`` matrix, in one pass over it (no padded copy
    unless ``out`` is not a multiple of the panel width): the head of a 262k vocabulary is
    670 MB."""
    n_out, n_in = w_rows.shape
    panels = -(-n_out // _PANEL)
    data: F32 = np.empty((panels, n_in, _PANEL), np.float32)
    whole = n_out // _PANEL
    for p in range(0, whole, 256):  # slabs of panels: each a strided copy that fits in cache
        q = min(whole, p + 256)
        data[p:q] = w_rows[p * _PANEL : q * _PANEL].reshape(q - p, _PANEL, n_in).transpose(0, 2, 1)
    if whole < panels:
        data[whole] = 0.0
        data[whole, :, : n_out - whole * _PANEL] = w_rows[whole * _PANEL :].T
    if gain is not None:
        data *= gain[None, :, None]
    return data


def _silu(g: F32) -> F32:
    """``g * sigmoid(g)``, a new array."""
    act: F32 = np.negative(g)
    np.exp(act, out=act)
    act += np.float32(1.0)
    np.divide(g, act, out=act)
    return act


_GELU_C = np.float32(np.sqrt(2.0 / np.pi))


def _gelu_tanh(g: F32) -> F32:
    """GELU's tanh approximation, ``g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``, new."""
    t: F32 = g * g
    t *= g
    t *= np.float32(0.044715)
    t += g
    t *= _GELU_C
    np.tanh(t, out=t)
    t += np.float32(1.0)
    t *= g
    t *= np.float32(0.5)
    return t


class _Rope:
    """RoPE tables of one (base, scaling) for positions ``0..len-1``, grown on demand.

    ``cos``/``sin`` are ``[position, 2, head_dim/2]`` (the two halves of a head), to broadcast
    over ``[T, heads, 2, hd/2]``; ``sin`` carries the minus sign of the first half.
    """

    __slots__ = ("_inv_freq", "_scale", "cos", "sin")

    def __init__(self, head_dim: int, base: float, scale: float, factors: F32 | None) -> None:
        half = head_dim // 2
        inv_freq = 1.0 / (base ** (np.arange(half, dtype=np.float64) * 2.0 / head_dim))
        if factors is not None:  # Llama 3: each frequency divided by its factor
            inv_freq = inv_freq / factors.astype(np.float64)
        self._inv_freq, self._scale = inv_freq, scale
        self.cos: F32 = np.empty((0, 2, half), np.float32)
        self.sin: F32 = np.empty((0, 2, half), np.float32)

    def reach(self, positions: int) -> None:
        """Make the tables cover positions ``0..positions-1``."""
        have = self.cos.shape[0]
        if positions <= have:
            return
        n = max(positions, 2 * have, 1024)
        angles = (np.arange(n, dtype=np.float64) / self._scale)[:, None] * self._inv_freq
        cos, sin = np.cos(angles), np.sin(angles)
        self.cos = np.stack([cos, cos], axis=1).astype(np.float32)
        self.sin = np.stack([-sin, sin], axis=1).astype(np.float32)
