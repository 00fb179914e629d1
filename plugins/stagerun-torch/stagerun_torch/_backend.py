"""One stage's layers of a llama GGUF model in PyTorch, on CUDA or the CPU.

Theory of operation: the weights come from stagerun's own GGUF loader (dequantized to float32),
packed the way the numpy reference packs them, so both compute the same function:

* Q, K and V are one ``(out, in)`` matrix, gate and up another; RMSNorm gains are folded into
  the columns of the matrix that follows the norm and 1/sqrt(head_dim) into W_q.
* Q/K rows are permuted once per head so that RoPE rotates contiguous halves.
* Attention is ``scaled_dot_product_attention`` over the cached keys with grouped-query heads
  (``enable_gqa``) and, for several new tokens, a causal mask offset by the cache length.
* The KV cache is preallocated on the device and grows by doubling.

On the CPU, torch's matrix multiply handles a few rows (a verify window) with little more
memory traffic than one row, where numpy's OpenBLAS path needs panel tricks; on CUDA the stage
runs on the GPU and only activations cross to the host. Float32 by default; ``dtype="float16"``
(or ``bfloat16``) is an opt-in on CUDA.

The backend is blocking code called from one worker thread at a time. ``threads`` sets torch's
intra-op threads for the process (torch has one setting per process).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from stagerun import ComputeCancelled, UnsupportedModelError
from stagerun.abc import ComputeBackend
from stagerun.backends import GgufLayers, check_positions, stage_input
from stagerun.model import (
    LayerWeights,
    ModelFile,
    QuantizedTensor,
    fuse_layer,
    qk_row_order,
)

__all__ = ["TorchBackend", "TorchInt4Backend", "TorchKVCache"]

DEVICE_ENV = "STAGERUN_TORCH_DEVICE"
DTYPE_ENV = "STAGERUN_TORCH_DTYPE"
WEIGHTS_ENV = "STAGERUN_TORCH_WEIGHTS"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CHUNK = 256  # first KV allocation, in tokens
_PACK_ROWS = 4  # oneDNN's reorder takes a batch-size hint: a verify window
_GROUP = 32  # weights per GGUF 4-bit block, and per int4 kernel group
_Q4_BLOCK = {"Q4_0": 18, "Q4_1": 20}  # bytes per block of 32 weights
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


def default_device() -> str:
    """``$STAGERUN_TORCH_DEVICE``, else ``cuda`` when a GPU is visible, else ``cpu``."""
    return os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")


class TorchKVCache:
    """Keys and values of one request on one stage: ``[layers, n_kv, capacity, head_dim]``."""

    def __init__(
        self,
        n_layers: int,
        n_kv: int,
        head_dim: int,
        max_length: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.length = 0
        self._max = max_length
        self._layers, self._n_kv, self._hd = n_layers, n_kv, head_dim
        self._device, self._dtype = device, dtype
        self.k = torch.empty((n_layers, n_kv, 0, head_dim), device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)

    def __repr__(self) -> str:
        return f"<TorchKVCache length={self.length} capacity={self.capacity} {self._device}>"

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        self.length = min(self.length, position)

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = min(max(needed, 2 * self.capacity, _CHUNK), max(needed, self._max))
        shape = (self._layers, self._n_kv, cap, self._hd)
        for name in ("k", "v"):
            new = torch.empty(shape, device=self._device, dtype=self._dtype)
            new[:, :, : self.length] = getattr(self, name)[:, :, : self.length]
            setattr(self, name, new)


def _host(array: npt.NDArray[Any]) -> torch.Tensor:
    """A float32 CPU tensor of ``array``, copied if it is a read-only view of the GGUF map."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


class _Dense:
    """``x @ W.T`` with ``torch.nn.functional.linear`` (CUDA, or a CPU torch without oneDNN)."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _OneDNN:
    """``x @ W.T`` on the CPU with the weight reordered once for oneDNN.

    Without the reorder each call repacks the whole matrix (torch's MKL path does the same, and
    on AMD CPUs MKL takes a slow code path besides): a 4-token window over the default model
    costs 67 ms through ``F.linear`` and 29 ms prepacked.
    """

    __slots__ = ("dtype", "weight")

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), _PACK_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, None, "none", [], "")
        return y.float()


class _Int4:
    """``x @ W.T`` straight from the GGUF's 4-bit blocks (Q4_0 or Q4_1, 32 weights a block).

    A block stores ``w = d * q + m`` (Q4_1; Q4_0 is ``d * (q - 8)``) with ``q`` in 0..15;
    torch's int4 CPU kernel computes ``(q - 8) * scale + zero`` per 32-column group, so
    ``scale = d`` and ``zero = m + 8 d`` reproduce the file's weights (rounded to bfloat16 for
    the kernel). The kernel takes bfloat16 rows; the result is returned as float32.
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
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, _GROUP, self.scales_zeros
        )
        return y.float()


_Matrix = _Dense | _OneDNN | _Int4


_Q4 = tuple[npt.NDArray[np.int32], npt.NDArray[np.float32], npt.NDArray[np.float32]]


def _unpack_q4(
    t: QuantizedTensor, rows: npt.NDArray[np.intp] | None = None, *, scale: float = 1.0
) -> _Q4:
    """``(q, scale, zero)`` of a Q4_0/Q4_1 tensor, rows reordered by ``rows``, scaled by ``scale``.

    ``q`` is ``[out, in]`` in 0..15; ``scale`` and ``zero`` are ``[out, in / 32]``.
    """
    if t.qtype not in _Q4_BLOCK:
        raise UnsupportedModelError(
            f"the torch backend's int4 weights need Q4_0 or Q4_1 tensors; {t.name} is "
            f"{t.qtype}. Use the float weights (backend 'torch') for this model."
        )
    out, n_in = t.shape
    blocks = t.data if rows is None else t.data[rows]
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


def _int4(*parts: _Q4) -> _Int4:
    """One `_Int4` whose output rows are those of ``parts`` in order (fused projections)."""
    q, d, zero = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return _Int4(q, d, zero)


class _Layer:
    __slots__ = ("attn_norm", "ffn_norm", "w_down", "w_gu", "w_o", "w_qkv")

    def __init__(
        self,
        w_qkv: _Matrix,
        w_o: _Matrix,
        w_gu: _Matrix,
        w_down: _Matrix,
        attn_norm: torch.Tensor | None = None,
        ffn_norm: torch.Tensor | None = None,
    ) -> None:
        self.w_qkv, self.w_o, self.w_gu, self.w_down = w_qkv, w_o, w_gu, w_down
        self.attn_norm, self.ffn_norm = attn_norm, ffn_norm


class TorchBackend(GgufLayers, ComputeBackend):
    """Runs blocks ``lo..hi-1`` of a llama GGUF model with PyTorch.

    Args:
        model: an open ModelFile, a model name (``smollm2``) or a GGUF path.
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: torch intra-op threads (process-wide); None leaves torch's setting alone.
        device: ``cpu``, ``cuda``, ``cuda:1``...; default `default_device()`.
        dtype: ``float32`` (default, ``$STAGERUN_TORCH_DTYPE``), or ``float16``/``bfloat16``
            on CUDA.
        weights: ``float`` (default, ``$STAGERUN_TORCH_WEIGHTS``): dequantized to ``dtype``;
            ``int4`` (CPU only): the GGUF's own Q4_0/Q4_1 blocks through torch's int4 kernel,
            with bfloat16 matmul inputs; the backend ``torch-int4`` is this setting.
    """

    default_weights: ClassVar[str] = "float"

    def __init__(
        self,
        model: ModelFile | str | os.PathLike[str],
        layers: tuple[int, int] | None = None,
        *,
        threads: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        weights: str | None = None,
    ) -> None:
        c = self._open_layers(model, layers, threads)
        lo, hi = self._lo, self._hi
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = threads
        self.device = torch.device(device or default_device())
        dtype_name = dtype or os.environ.get(DTYPE_ENV) or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype_name!r}.")
        if dtype_name != "float32" and self.device.type == "cpu":
            raise ValueError(
                f"{dtype_name} is for CUDA; on the CPU the torch backend runs float32 "
                "(or int4 weights: backend 'torch-int4')."
            )
        self.dtype = _DTYPES[dtype_name]
        self.weights = weights or os.environ.get(WEIGHTS_ENV) or self.default_weights
        if self.weights not in ("float", "int4"):
            raise ValueError(f"weights must be 'float' or 'int4', not {self.weights!r}.")
        if self.weights == "int4" and self.device.type != "cpu":
            raise ValueError(
                f"int4 weights run on the CPU only; on {self.device} use float weights "
                "(dtype float16 or bfloat16 to halve the memory)."
            )
        w = self.model.load_weights(
            lo, hi, embeddings=lo == 0, head=hi == c.n_layers, blocks=self.weights == "float"
        )
        with torch.inference_mode():
            if self.weights == "int4":
                self._layers = [self._int4_layer(i) for i in range(lo, hi)]
            else:
                self._layers = [self._float_layer(lw) for lw in w.layers]
            self._embd = self._tensor(w.token_embd) if w.token_embd is not None else None
            self._head: _Matrix | None = None
            if w.output is not None and w.output_norm is not None:
                head_dtype = torch.bfloat16 if self.weights == "int4" else self.dtype
                self._head = self._matrix(w.output * w.output_norm[None, :], head_dtype)
            hd, half = c.head_dim, c.head_dim // 2
            inv_freq = 1.0 / (c.rope_base ** (np.arange(half, dtype=np.float64) * 2.0 / hd))
            angles = np.arange(c.context_length, dtype=np.float64)[:, None] * inv_freq[None, :]
            self._cos = self._tensor(np.cos(angles))  # [position, half]
            self._sin = self._tensor(np.sin(angles))
        self._eps = c.rms_eps

    def _tensor(self, array: npt.NDArray[Any]) -> torch.Tensor:
        return _host(array).to(self.device, self.dtype)

    def _matrix(self, w: npt.NDArray[np.float32], dtype: torch.dtype) -> _Matrix:
        if self.device.type == "cpu" and _HAS_ONEDNN:
            return _OneDNN(_host(w), dtype)
        return _Dense(self._tensor(w))

    def _float_layer(self, lw: LayerWeights) -> _Layer:
        f = fuse_layer(lw, self.config)
        return _Layer(*(self._matrix(m, self.dtype) for m in (f.qkv, f.wo, f.gate_up, f.down)))

    def _int4_layer(self, i: int) -> _Layer:
        c = self.config
        q = self.model.quantized
        name = f"blk.{i}.{{}}.weight".format
        qkv = _int4(
            _unpack_q4(q(name("attn_q")), qk_row_order(c, c.n_heads), scale=c.head_dim**-0.5),
            _unpack_q4(q(name("attn_k")), qk_row_order(c, c.n_kv_heads)),
            _unpack_q4(q(name("attn_v"))),
        )
        gu = _int4(_unpack_q4(q(name("ffn_gate"))), _unpack_q4(q(name("ffn_up"))))
        norms = [self._tensor(self.model.load_tensor(name(n))) for n in ("attn_norm", "ffn_norm")]
        return _Layer(
            qkv,
            _int4(_unpack_q4(q(name("attn_output")))),
            gu,
            _int4(_unpack_q4(q(name("ffn_down")))),
            *norms,
        )

    def __repr__(self) -> str:
        return (
            f"<TorchBackend layers=[{self._lo}, {self._hi}) of {self.config.n_layers} "
            f"device={self.device} dtype={str(self.dtype).removeprefix('torch.')} "
            f"weights={self.weights}>"
        )

    def new_cache(self) -> TorchKVCache:
        c = self.config
        return TorchKVCache(
            self._hi - self._lo, c.n_kv_heads, c.head_dim, c.context_length, self.device, self.dtype
        )

    def forward(
        self,
        cache: Any,
        position: int,
        *,
        tokens: npt.ArrayLike | Sequence[int] | None = None,
        hidden: npt.ArrayLike | None = None,
        logits: Literal["last", "all"] = "last",
        should_stop: Callable[[], bool] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Run this stage's layers on new positions (see `stagerun.abc.ComputeBackend`)."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {logits!r}.")
        if not isinstance(cache, TorchKVCache):
            raise ValueError("this cache was not made by a TorchBackend.")
        with torch.inference_mode():
            h = self._input(tokens, hidden)
            n = h.shape[0]
            self._check_position(cache, position, n)
            cache.trim(position)
            cache.reserve(position + n)
            end = position + n
            cos = self._cos[position:end, None, :]
            sin = self._sin[position:end, None, :]
            mask = None
            if n > 1:  # row t sees the cache and new rows up to itself
                mask = torch.arange(end, device=h.device)[None, :] <= (
                    position + torch.arange(n, device=h.device)[:, None]
                )
            for i, layer in enumerate(self._layers):
                if should_stop is not None and should_stop():
                    raise ComputeCancelled(
                        f"compute at position {position} stopped before layer {self._lo + i}."
                    )
                h = self._block(layer, i, cache, position, h, cos, sin, mask)
            cache.length = end
            if self._head is None:
                out = h
            else:
                rows = h if logits == "all" else h[-1:]
                out = self._head(self._norm(rows))
            return out.to("cpu", torch.float32).numpy()

    def _input(self, tokens: object, hidden: object) -> torch.Tensor:
        rows = stage_input(
            tokens,
            hidden,
            first=self.is_first,
            lo=self._lo,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
        )
        if self.is_first:
            assert self._embd is not None
            return self._embd[torch.from_numpy(rows).to(self.device)]
        return torch.from_numpy(rows).to(self.device, self.dtype)

    def _check_position(self, cache: TorchKVCache, position: int, n: int) -> None:
        c = self.config
        if (cache._layers, cache._n_kv, cache._hd) != (
            self._hi - self._lo,
            c.n_kv_heads,
            c.head_dim,
        ):
            raise ValueError("this KV cache was made by a backend with another layer range.")
        check_positions(cache.length, position, n, c.context_length)

    def _norm(self, h: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
        return F.rms_norm(h, (h.shape[-1],), gain, self._eps)

    def _block(
        self,
        layer: _Layer,
        i: int,
        cache: TorchKVCache,
        pos: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        c = self.config
        n, hd, n_kv, n_heads = h.shape[0], c.head_dim, c.n_kv_heads, c.n_heads
        end, half = pos + n, hd // 2
        qkv = layer.w_qkv(self._norm(h, layer.attn_norm)).view(n, n_heads + 2 * n_kv, hd)
        # RoPE on the Q and K heads at once: their rows are in halves order (fuse_layer)
        qk = qkv[:, : n_heads + n_kv]
        x1, x2 = qk[..., :half], qk[..., half:]
        qk = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        cache.k[i, :, pos:end] = qk[:, n_heads:].transpose(0, 1)
        cache.v[i, :, pos:end] = qkv[:, n_heads + n_kv :].transpose(0, 1)
        keys = cache.k[i, :, :end].unsqueeze(0)  # [1, n_kv, L, hd]
        values = cache.v[i, :, :end].unsqueeze(0)
        query = qk[:, :n_heads].transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, hd]
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=1.0, enable_gqa=n_heads != n_kv
        )
        h = h + layer.w_o(attn[0].transpose(0, 1).reshape(n, n_heads * hd))
        gu = layer.w_gu(self._norm(h, layer.ffn_norm))
        g, u = gu[:, : c.d_ff], gu[:, c.d_ff :]
        return h + layer.w_down(F.silu(g) * u)


class TorchInt4Backend(TorchBackend):
    """`TorchBackend` with ``weights="int4"``: the GGUF's 4-bit blocks on the CPU."""

    default_weights: ClassVar[str] = "int4"
