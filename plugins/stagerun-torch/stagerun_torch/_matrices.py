"""The torch backend's matrix products ``x @ W.T``, each row's result independent of the others.

Theory of operation: a batched forward stacks the rows of several sessions, and stagerun
promises a session the same output, bit for bit, alone or in a batch. A matrix kernel picks its
algorithm (and so its order of summation) by the shape of the call, so a row can come out
differently beside other rows. Measured with torch 2.13 on an AVX-512 Xeon, rows alone against
the same rows at random offsets in calls of 2..2048 rows (1 to 5 threads, the default model's
shapes), per kernel:

* oneDNN float32 (`OneDNN`): every call of 2 rows or more gives the same rows; a single row
  takes another path where the input is long (``ffn_down``, 1536 inputs: up to 7e-6 apart), so
  one row is passed as two. Calls are cut at 128 rows, a bound the tests cover row by row.
* oneDNN bfloat16 (the int4 backend's output head): the same up to 32 rows, another kernel
  from 33 on, so calls are cut at 32 rows.
* the int4 kernel (`Int4`): the same at every size measured; calls are cut at 128 rows.
* ``F.linear`` (`Dense`: CUDA, or a CPU torch without oneDNN; MKL on the CPU): rows differ from
  2 rows
  on; calls padded to one fixed shape agree, so every call is exactly 64 rows (zero rows
  added). On CUDA this is the standard remedy (cuBLAS also picks kernels by shape) but was
  not measured here.

Every class runs its kernel through `in_blocks`, which cuts and pads the rows.

``F.rms_norm`` gave every row the same at every size measured, and the attention runs per
session, on the same shapes alone and in a batch. Elementwise ops are exact per element,
except the transcendental ones, the MLP's SiLU or GELU (`silu_mul`, `gelu_tanh_mul`) and the
logits' softcap (`softcap`): on the CPU torch vectorizes each thread's share of the elements
and ends a share that is not a multiple of the vector width with scalar code, whose ``exp``
rounds differently; how the elements are shared depends on their number, so a row's
activations depended on the batch (5 threads, 128 rows: 4 rows off). Calls under torch's
parallel grain run on one thread, every row alike, and on operands whose rows are not
contiguous with each other (a column slice, or `softcap`'s padded buffer) each row is its own
vectorized loop with its own tail: on a contiguous ``[R, W]`` operand with ``W`` not a
multiple of the vector width the tail moves with ``R`` (measured, one thread: GELU over 1500
columns, most rows off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from stagerun import UnsupportedModelError
from stagerun.model import QuantizedTensor

__all__ = [
    "HAS_ONEDNN",
    "Dense",
    "Int4",
    "Matrix",
    "OneDNN",
    "gelu_tanh_mul",
    "host",
    "in_blocks",
    "int4",
    "silu_mul",
    "softcap",
    "unpack_q4",
]

_PACK_ROWS = 4  # oneDNN's reorder takes a batch-size hint: a verify window
_GROUP = 32  # weights per GGUF 4-bit block, and per int4 kernel group
_Q4_BLOCK = {"Q4_0": 18, "Q4_1": 20}  # bytes per block of 32 weights
HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(  # type: ignore[no-untyped-call]
    torch.ops.mkldnn, "_reorder_linear_weight"
)


def in_blocks(
    x: torch.Tensor,
    product: Callable[[torch.Tensor], torch.Tensor],
    *,
    block: int,
    min_rows: int = 1,
) -> torch.Tensor:
    """``product(x)`` in calls of ``min_rows..block`` rows (see the module docstring).

    Rows go through in blocks of at most ``block``; a block of fewer than ``min_rows`` rows
    is padded with zero rows to ``min_rows``. Within those bounds the kernels give each row
    the same result whatever the other rows of the call and the row's place among them.
    """
    n = x.shape[0]
    if min_rows <= n <= block:
        return product(x)
    pieces = []
    for start in range(0, n, block):
        piece = x[start : start + block]
        rows = piece.shape[0]
        if rows < min_rows:
            piece = torch.cat([piece, piece.new_zeros((min_rows - rows, piece.shape[1]))])
        pieces.append(product(piece)[:rows])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class Dense:
    """``x @ W.T`` with ``F.linear`` (CUDA, or a CPU torch without oneDNN): 64 rows a call."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return in_blocks(x, self._product, block=64, min_rows=64)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class OneDNN:
    """``x @ W.T`` on the CPU with the weight reordered once for oneDNN.

    Without the reorder each call repacks the whole matrix (torch's MKL path does the same, and
    on AMD CPUs MKL takes a slow code path besides): a 4-token window over the default model
    costs 67 ms through ``F.linear`` and 29 ms prepacked. Float32 calls take 2..128 rows,
    bfloat16 ones 1..32 (see the module docstring).
    """

    __slots__ = ("block", "dtype", "min_rows", "weight")

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.block, self.min_rows = (128, 2) if dtype == torch.float32 else (32, 1)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), _PACK_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return in_blocks(x, self._product, block=self.block, min_rows=self.min_rows)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.to(self.dtype), self.weight, None, "none", [], ""
        )
        return y.float()


class Int4:
    """``x @ W.T`` straight from the GGUF's 4-bit blocks (Q4_0 or Q4_1, 32 weights a block).

    A block stores ``w = d * q + m`` (Q4_1; Q4_0 is ``d * (q - 8)``) with ``q`` in 0..15;
    torch's int4 CPU kernel computes ``(q - 8) * scale + zero`` per 32-column group, so
    ``scale = d`` and ``zero = m + 8 d`` reproduce the file's weights (rounded to bfloat16 for
    the kernel). The kernel takes bfloat16 rows, 1..128 a call; the result is float32.
    """

    __slots__ = ("n_in", "packed", "scales_zeros")

    def __init__(
        self,
        rows: npt.NDArray[np.int32],
        scale: npt.NDArray[np.float32],
        zero: npt.NDArray[np.float32],
    ) -> None:
        self.n_in = rows.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(np.ascontiguousarray(rows)), 1
        )
        sz = np.stack([scale.T, zero.T], axis=-1)  # [in / 32, out, 2]
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return in_blocks(x, self._product, block=128)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, _GROUP, self.scales_zeros
        )
        return y.float()


Matrix = Dense | OneDNN | Int4

_GRAIN = 32768  # at::internal::GRAIN_SIZE: a CPU elementwise op on fewer elements is one thread
_GELU_GRAIN = 16384  # GELU_MIN_ELEMENTS_FOR_MULTI_THREADING in ATen's activation kernels


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``[R, W]`` rows, each row's result independent of the other rows.

    On the CPU the rows go in calls of fewer than ``_GRAIN`` elements (see the module
    docstring); on CUDA every element runs the same code, so it is one call.
    """
    return _rowwise(lambda g, u: F.silu(g) * u, g, u)


def gelu_tanh_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(g) * u`` (Gemma's GeGLU), row by row as `silu_mul`.

    torch's GELU goes parallel from `_GELU_GRAIN` elements, under the common grain.
    """
    return _rowwise(lambda g, u: F.gelu(g, approximate="tanh") * u, g, u, grain=_GELU_GRAIN)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` for ``[R, W]`` rows (the logits), row by row as `silu_mul`.

    The rows are first copied into a buffer one element wider than a row: torch then runs
    each row as its own inner loop, vectorized the same whatever the rows around it (on a
    contiguous ``[R, W]`` torch runs one flat loop, whose scalar tail depends on ``R``).
    """
    n, width = x.shape
    rows = x.new_empty((n, width + 1))[:, :width]
    rows.copy_(x)
    # in place: a new output would be contiguous, and the next op on it one flat loop again
    capped = _rowwise(lambda r: r.div_(cap).tanh_().mul_(cap), rows)
    return capped.contiguous()


def _rowwise(
    op: Callable[..., torch.Tensor], *xs: torch.Tensor, grain: int = _GRAIN
) -> torch.Tensor:
    """``op(*xs)`` for ``[R, W]`` operands, on the CPU in calls of fewer than ``grain``."""
    n, width = xs[0].shape
    rows = max(1, (grain - 1) // width)
    if xs[0].device.type != "cpu" or n <= rows:
        return op(*xs)
    return torch.cat([op(*(x[s : s + rows] for x in xs)) for s in range(0, n, rows)])


_Q4 = tuple[npt.NDArray[np.int32], npt.NDArray[np.float32], npt.NDArray[np.float32]]


def unpack_q4(
    t: QuantizedTensor, rows: npt.NDArray[np.intp] | None = None, *, scale: float = 1.0
) -> _Q4:
    """``(q, scale, zero)`` of a Q4_0/Q4_1 tensor's ``rows`` (all: None), scaled by ``scale``.

    ``q`` is ``[out, in]`` in 0..15; ``scale`` and ``zero`` are ``[out, in / 32]``.
    """
    if t.qtype not in _Q4_BLOCK:
        raise UnsupportedModelError(
            f"the torch backend's int4 weights need Q4_0 or Q4_1 tensors; {t.name} is "
            f"{t.qtype}. Use the float weights (backend 'torch') for this model."
        )
    out, n_in = t.shape
    blocks = t.data if rows is None else t.data[rows]
    out = blocks.shape[0]
    blocks = blocks.reshape(out, n_in // _GROUP, _Q4_BLOCK[t.qtype])
    f = np.float32(scale)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32) * f
    if t.qtype == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) * f
        qs = blocks[..., 4:]
        zero = m + np.float32(8) * d
    else:
        qs = blocks[..., 2:]
        zero = np.zeros_like(d)
    # Each block's 16 bytes hold weights 0..15 in the low nibbles and 16..31 in the high ones.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out, n_in).astype(np.int32)
    return q, d, zero


def int4(*parts: _Q4) -> Int4:
    """One `Int4` whose output rows are those of ``parts`` in order (fused projections)."""
    q, d, zero = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return Int4(q, d, zero)


def host(array: npt.NDArray[Any]) -> torch.Tensor:
    """A float32 CPU tensor of ``array``, copied if it is a read-only view of the GGUF map."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)
